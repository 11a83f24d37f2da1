"""Mixed precision's compute copies: each floating parameter cast to ``param_dtype`` once after every change
of its master weight, and kept until the next one. After an optimizer update every copy is stale at once,
so the first copy asked for then refreshes them all in place with one ``torch._foreach_copy_`` (one
multi-tensor kernel on CUDA instead of a cast per parameter: ~290 launches a step on a 24-layer GPT), into
the buffers they already have. The executor asks for that refresh at the end of a step that updated
(``State.refresh_compute_copies``): there the host is ahead of the device, which still runs the update,
where at the next step's start the device waits for the host's multi-tensor launch (an H200 profile of
the 350M bench GPT: a 2.5 ms gap there)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class _Copy(NamedTuple):
    key: tuple[int, int, int]  # (updates, master version, master data pointer) it was made from
    copy: torch.Tensor
    source: torch.Tensor  # the master it was cast from (a later lookup checks the master it is given)


class ComputeCopies:
    """fqn -> the compute copy of that parameter. ``updates`` (the optimizer steps so far) is part of every
    key, so a copy made before the last update is never handed out."""

    def __init__(self) -> None:
        self._copies: dict[str, _Copy] = {}

    def get(self, fqn: str, master: torch.Tensor, dtype: torch.dtype, updates: int) -> torch.Tensor:
        """The copy of ``master`` in ``dtype``: the kept one if ``master`` did not change since, else
        refreshed (every stale copy at once) or made."""
        key = (updates, master._version, master.data_ptr())
        have = self._copies.get(fqn)
        if have is not None and have.key != key:
            self.refresh(updates)
            have = self._copies[fqn]
        if have is not None and have.key == key and have.copy.dtype == dtype:
            return have.copy
        copy = master.detach().to(dtype)
        self._copies[fqn] = _Copy(key, copy, master)
        return copy

    def refresh(self, updates: int) -> None:
        """Copy every stale copy's master into it, in one call (those whose master still has its storage
        and shape; the others are made again when asked for)."""
        names, dsts, srcs = [], [], []
        keys = []
        for fqn, c in self._copies.items():
            src = c.source
            key = (updates, src._version, src.data_ptr())
            if key == c.key or key[2] == 0 or src.shape != c.copy.shape:  # fresh, or released (no storage)
                continue
            names.append(fqn)
            dsts.append(c.copy)
            srcs.append(src.detach())
            keys.append(key)
        if not names:
            return
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
        for fqn, key, dst in zip(names, keys, dsts):
            self._copies[fqn] = _Copy(key, dst, self._copies[fqn].source)

    def held(self) -> list[torch.Tensor]:
        """The copies held now."""
        return [c.copy for c in self._copies.values()]
