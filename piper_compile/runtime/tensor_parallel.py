"""Sequence-parallel collectives of the tensor-parallel group (``shard_tensor(sequence_parallel=True)``):
all-gather and reduce-scatter along the sequence dimension, and a rank's own chunk.

``torch.distributed`` gathers and scatters along dimension 0, so for ``dim > 0`` the input is moved to
the front (one copy) and the result moved back once the collective completes (``finish``)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from piper_compile.runtime.comm import all_gather, reduce_scatter


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.contiguous() if dim == 0 else x.movedim(dim, 0).contiguous()


def _back(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t if dim == 0 else t.movedim(0, dim).contiguous()


Started = tuple[Any, torch.Tensor, Callable[[], torch.Tensor]]  # (work, what it reads, the result once done)


def gather(x: torch.Tensor, dim: int, size: int, group: Any) -> Started:
    """Start the all-gather of every rank's ``x`` along ``dim`` (the result: the whole tensor)."""
    src = _front(x, dim)
    out = src.new_empty((src.shape[0] * size, *src.shape[1:]))
    return all_gather(out, src, group), src, lambda: _back(out, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, size: int, group: Any) -> Started:
    """Start the reduce-scatter of ``x`` along ``dim`` (the result: this rank's chunk of the sum)."""
    src = _front(x, dim)
    out = src.new_empty((src.shape[0] // size, *src.shape[1:]))
    return reduce_scatter(out, src, group), src, lambda: _back(out, dim)


def chunk(x: torch.Tensor, dim: int, size: int, index: int) -> torch.Tensor:
    """This rank's (``index``-th of ``size``) chunk of ``x`` along ``dim``, as its own tensor."""
    return x.chunk(size, dim)[index].contiguous()
