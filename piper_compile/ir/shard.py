"""How a parameter is split across a group of ranks (expert and tensor parallelism): each rank holds one
piece, an ``nn.Parameter`` of the local shape that its optimizer owns."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamShard:
    """``fqn`` split along ``dim`` over ``size`` ranks; ``parts`` > 1: ``dim`` holds that many fused equal
    blocks (qkv), each split separately. Experts: dim 0 (the expert index), one part."""

    fqn: str
    dim: int
    parts: int
    size: int

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] //= self.size
        return tuple(out)

    def take(self, full: torch.Tensor, r: int) -> torch.Tensor:
        """Rank ``r``'s piece of ``full`` (a copy)."""
        blocks = full.unflatten(self.dim, (self.parts, -1))
        n = blocks.shape[self.dim + 1] // self.size
        return blocks.narrow(self.dim + 1, r * n, n).flatten(self.dim, self.dim + 1).clone()

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece (in group order)."""
        blocks = [p.unflatten(self.dim, (self.parts, -1)) for p in pieces]
        return torch.cat(blocks, dim=self.dim + 1).flatten(self.dim, self.dim + 1)

    def boxes(self, shape: tuple[int, ...], r: int) -> list[tuple[tuple[int, ...], int, int]]:
        """Rank ``r``'s piece of a tensor of full ``shape`` as boxes of it, one per fused block:
        ``(offsets in the full tensor, start in the piece along dim, length along dim)``."""
        block = shape[self.dim] // self.parts
        n = block // self.size
        out = []
        for p in range(self.parts):
            offsets = [0] * len(shape)
            offsets[self.dim] = p * block + r * n
            out.append((tuple(offsets), p * n, n))
        return out

    def rows(self, shape: tuple[int, ...], r: int) -> slice | None:
        """The contiguous slice of dim 0 rank ``r`` holds (None unless split along dim 0 in one part)."""
        if self.dim != 0 or self.parts != 1:
            return None
        n = shape[0] // self.size
        return slice(r * n, (r + 1) * n)
