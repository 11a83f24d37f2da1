"""This rank's piece of a parameter split across a group of ranks (experts, tensor-parallel layers)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from piper_compile.ir.shard import ParamShard
from piper_compile.runtime import comm


@dataclass
class LocalShard:
    """This rank's piece of a parameter split across ``group`` (``kind``: "ep" experts, "tp" tensor parallel)."""

    param: nn.Parameter
    spec: ParamShard
    rank: int  # position in the sorted group
    group: tuple[int, ...]
    stream: str  # the process group's stream (gathers run there)
    kind: str

    @property
    def rows(self) -> slice | None:
        """The slice of dim 0 of the full parameter this piece is, when it is one (experts)."""
        n = self.param.shape[0]
        return slice(self.rank * n, (self.rank + 1) * n) if self.spec.dim == 0 and self.spec.parts == 1 else None

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the whole parameter this is a piece of."""
        shape = list(self.param.shape)
        shape[self.spec.dim] *= self.spec.size
        return tuple(shape)

    def boxes(self, t: torch.Tensor) -> list[tuple[torch.Size, torch.Tensor]]:
        """``t`` (the piece or a tensor of its shape, e.g. its optimizer state) as boxes of the full
        tensor: (offsets in it, a view of ``t``); one per fused block (``colwise:N``: N)."""
        return self.place((0,) * t.dim(), t)

    def place(self, offsets: tuple[int, ...], view: torch.Tensor) -> list[tuple[torch.Size, torch.Tensor]]:
        """A box of the piece (``offsets`` in the piece, ``view`` its contents) as boxes of the full
        tensor, cut where it crosses from one fused block into the next (ZeRO-1 shards the flat piece)."""
        d = self.spec.dim
        lo, hi = offsets[d], offsets[d] + view.shape[d]
        out = []
        for off, start, n in self.spec.boxes(self.full_shape, self.rank):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                at = list(offsets)
                at[d] = off[d] + a - start
                out.append((torch.Size(at), view.narrow(d, a - lo, b - a)))
        return out

    def put(self, full: torch.Tensor) -> None:
        """Write this rank's piece into its place in ``full`` (a tensor of the full shape)."""
        d = self.spec.dim
        for off, view in self.boxes(self.param.detach()):
            full.narrow(d, off[d], view.shape[d]).copy_(view)

    def gather(self, groups: Any) -> torch.Tensor:
        """The full parameter from every rank's piece (collective over ``group``)."""
        local = self.param.detach().contiguous()
        if len(self.group) == 1:
            return local.clone()
        parts = [torch.empty_like(local) for _ in self.group]
        comm.all_gather_list(parts, local, groups.get(self.stream, self.group))
        return self.spec.assemble(parts)
