"""DCP's view of what one rank holds of a parameter-shaped tensor: ``ShardPieces`` (boxes of the full
shape, each a view into a ZeRO shard, an expert shard or a tensor-parallel piece) and the flat-range
arithmetic that cuts a ZeRO shard's range of a parameter into such boxes."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from piper_compile.errors import PiperError
from piper_compile.runtime.shards import LocalShard
from piper_compile.runtime.zero import ShardBucket


class ShardPieces(torch.Tensor):
    """This rank's part of one parameter-shaped tensor: boxes of the full shape, each a view into a ZeRO
    shard (or the optimizer state of one). DCP reads and writes it through the ``_Checkpointable``
    protocol that DTensor uses (``__create_write_items__`` / ``__create_chunk_list__`` /
    ``__get_tensor_shard__``); it supports no tensor operations."""

    _boxes: list[tuple[torch.Size, torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], boxes: list[tuple[torch.Size, torch.Tensor]]) -> "ShardPieces":
        like = boxes[0][1]
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=like.dtype, device=like.device)
        r._boxes = boxes
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise PiperError(f"piper: a sharded checkpoint entry holds only this rank's pieces and supports no tensor "
                         f"operation ({func}); use piper.full_state_dict(step) for full tensors")

    def __repr__(self) -> str:  # type: ignore[override]
        chunks = [(tuple(o), tuple(t.shape)) for o, t in self._boxes]
        return f"ShardPieces(shape={tuple(self.shape)}, dtype={self.dtype}, local chunks (offsets, sizes)={chunks})"

    def local_tensors(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """(offsets in the full tensor, view) of every local box."""
        return list(self._boxes)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.size()))
                for off, t in self._boxes]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self._boxes]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        if index.index is not None and index.index < len(self._boxes) and self._boxes[index.index][0] == index.offset:
            return self._boxes[index.index][1]
        for off, t in self._boxes:
            if off == index.offset:
                return t
        raise ValueError(f"piper: no local piece at offset {index.offset} of {index.fqn}")


Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start)


def flat_range_boxes(shape: Sequence[int], start: int, length: int) -> list[Box]:
    """The flat range ``[start, start + length)`` of a row-major tensor of ``shape`` as boxes
    ``(offsets, sizes, flat start)``, in flat order; each box is contiguous in memory (at most
    ``2 * ndim - 1`` of them)."""
    shape = [int(s) for s in shape]
    out: list[Box] = []

    def rec(d: int, prefix: list[int], s: int, e: int, base: int) -> None:
        if s >= e:
            return
        if d == len(shape):
            out.append((tuple(prefix), (), base))
            return
        inner = math.prod(shape[d + 1:])
        i0, r0 = divmod(s, inner)
        i1, r1 = divmod(e, inner)
        if i0 == i1:
            rec(d + 1, prefix + [i0], r0, r1, base + i0 * inner)
            return
        if r0:
            rec(d + 1, prefix + [i0], r0, inner, base + i0 * inner)
            i0 += 1
        if i1 > i0:
            out.append((tuple(prefix + [i0] + [0] * (len(shape) - d - 1)), (*[1] * d, i1 - i0, *shape[d + 1:]),
                        base + i0 * inner))
        if r1:
            rec(d + 1, prefix + [i1], 0, r1, base + i1 * inner)

    if length > 0:
        rec(0, [], start, start + length, 0)
    return out


def pieces_of(b: ShardBucket, src: torch.Tensor, split: dict[str, LocalShard], start: int = 0) -> dict[str, ShardPieces]:
    """fqn -> this shard's pieces of it, as views of ``src`` (the shard or a shard-shaped state tensor;
    or, from ``start`` in the shard on, a run of it: ``ShardBucket.runs``, whose state is its own).
    ``split``: this rank's tensor-parallel pieces (``LocalShard``) by fqn; the bucket holds such a piece,
    so its boxes are placed in the full tensor through it."""
    out = {}
    shapes = dict(zip(b.fqns, b.shapes))
    for fqn, p_start, s_start, n in b.local_pieces():
        if not start <= s_start < start + src.numel():
            continue
        s_start -= start
        boxes = [(torch.Size(off), src[s_start + flat - p_start: s_start + flat - p_start + math.prod(size)].view(size))
                 for off, size, flat in flat_range_boxes(shapes[fqn], p_start, n)]
        sh = split.get(fqn)
        if sh is None:
            out[fqn] = ShardPieces(shapes[fqn], boxes)
        else:
            out[fqn] = ShardPieces(sh.full_shape, [box for off, v in boxes for box in sh.place(tuple(off), v)])
    return out


class StatefulDict(dict):
    """A dict DCP treats as ``Stateful``: ``dcp.save`` writes it as is, ``dcp.load`` fills its tensors in
    place and then calls ``load_state_dict`` (which finishes the load on the live training state)."""

    def __init__(self, items: dict[str, Any], on_load: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(items)
        self._on_load = on_load

    def state_dict(self) -> dict[str, Any]:
        return self

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._on_load(sd)
