"""Per-rank gradient storage: flat per reduction bucket, each parameter's gradient a view of it."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from piper_compile.capture.joint import JointGraph
from piper_compile.ir.dag import Kind
from piper_compile.ir.ops import GradReduce, Recv, Send, Update
from piper_compile.plan.program import Program


class GradBuffers:
    """Per-rank gradient storage: one flat tensor per reduction bucket (padded to a multiple of the group
    for ZeRO buckets), one tensor per other gradient. Reduce-scattered buckets (ZeRO-2/3) are allocated at
    their first gradient in a step and released once reduce-scattered.

    Buffers are not cleared between steps: ``zero_()`` only marks every gradient *fresh*, and the first
    write of a step overwrites a fresh gradient (``accumulate`` copies, ``claim`` tells an in-place writer
    to overwrite) instead of adding to zeros. Every read (``view``, ``bucket``) first zeroes the fresh
    gradients it covers (a parameter that got no gradient this step), so readers always see the sum."""

    def __init__(self, params: dict[str, nn.Parameter], buckets: dict[str, tuple[list[str], int, bool]],
                 others: list[str]) -> None:
        self.params = params
        self.flat: dict[str, torch.Tensor] = {}
        self.views: dict[str, torch.Tensor] = {}
        self.members: dict[str, list[str]] = {}  # flat tensor name -> the gradients it holds
        self.fresh: set[str] = set()  # gradients not written yet this step (stale contents)
        self.lazy: dict[str, tuple[list[str], int]] = {}
        self.lazy_of: dict[str, str] = {}
        for name, (fqns, padded, lazy) in buckets.items():
            if lazy:
                self.lazy[name] = (fqns, padded)
                self.lazy_of.update({f: name for f in fqns})
            else:
                self._allocate(name, fqns, padded)
        for f in others:
            if f not in self.views and f not in self.lazy_of:
                self.views[f] = torch.zeros_like(params[f], memory_format=torch.contiguous_format)
                self.flat[f"grad:{f}"] = self.views[f]
                self.members[f"grad:{f}"] = [f]

    def _allocate(self, name: str, fqns: list[str], padded: int) -> torch.Tensor:
        """The flat buffer of bucket ``name``, its gradients fresh (the padding, read by collectives, zero)."""
        p0 = self.params[fqns[0]]
        total = sum(self.params[f].numel() for f in fqns)
        flat = torch.empty(max(total, padded), dtype=p0.dtype, device=p0.device)
        flat[total:].zero_()
        off = 0
        for f in fqns:
            n = self.params[f].numel()
            self.views[f] = flat[off : off + n].view(self.params[f].shape)
            off += n
        self.flat[name] = flat
        self.members[name] = list(fqns)
        self.fresh.update(fqns)
        return flat

    @classmethod
    def for_program(cls, program: Program, joint: JointGraph,
                    local: dict[str, nn.Parameter] | None = None) -> "GradBuffers":
        params = {**joint.params, **(local or {})}  # this rank's pieces of tensor/expert-parallel weights
        buckets: dict[str, tuple[list[str], int, bool]] = {}
        others: list[str] = []
        for ins in program.instrs:
            n = ins.node
            op = n.op
            if isinstance(op, GradReduce):
                fqns = list(op.params)
                total = sum(params[f].numel() for f in fqns)
                # padded like the ZeRO shard bucket: to a multiple of the ranks sharding it (under tensor
                # parallelism this rank's data-parallel subgroup)
                size = len(op.members(n, program.rank))
                padded = -(-total // size) * size if op.level else total
                buckets[op.bucket] = (fqns, padded, op.scatter)
            elif n.kind is Kind.COMPUTE:
                others += [fqn for _, fqn in op.grad_outputs()]
            elif isinstance(op, (Send, Recv)) and op.state:
                others.append(op.state)
            elif isinstance(op, Update):
                others += list(op.params)
        return cls(params, buckets, others)

    def zero_(self) -> None:
        """Start a step: every gradient counts as zero (lazily: see the class docstring)."""
        for name in self.lazy:
            self.release(name)
        self.fresh = set(self.views)

    def release(self, name: str) -> None:
        """Drop a reduce-scattered bucket's full buffer (its shard lives on in the ZeRO state)."""
        if self.flat.pop(name, None) is not None:
            for f in self.members.pop(name):
                self.views.pop(f, None)
                self.fresh.discard(f)

    def _settle(self, fqn: str) -> None:
        if fqn in self.fresh:
            self.fresh.discard(fqn)
            self.views[fqn].zero_()

    def _writable(self, fqn: str) -> torch.Tensor:
        """The gradient tensor of ``fqn`` (allocating a released bucket), not settled."""
        v = self.views.get(fqn)
        if v is None:
            self._allocate(self.lazy_of[fqn], *self.lazy[self.lazy_of[fqn]])
            v = self.views[fqn]
        return v

    def accumulate(self, fqn: str, grad: torch.Tensor) -> None:
        """Add ``grad`` into the gradient of ``fqn`` (the step's first write copies it)."""
        v = self._writable(fqn)
        if fqn in self.fresh:
            self.fresh.discard(fqn)
            v.copy_(grad)
        else:
            v.add_(grad)

    def claim(self, fqns: Iterable[str]) -> tuple[tuple[torch.Tensor, ...], bool]:
        """The gradient tensors of ``fqns`` for a writer that adds into them in place, and whether it must
        overwrite them instead (each was fresh: its first write of the step)."""
        fqns = list(fqns)
        for f in fqns:
            self._writable(f)
        overwrite = all(f in self.fresh for f in fqns)
        for f in fqns:
            if overwrite:
                self.fresh.discard(f)
            else:
                self._settle(f)
        return tuple(self.views[f] for f in fqns), overwrite

    def view(self, fqn: str) -> torch.Tensor:
        """The gradient of ``fqn`` so far this step (zeroed if nothing wrote it yet)."""
        self._settle(fqn)
        return self.views[fqn]

    def bucket(self, name: str) -> torch.Tensor:
        """The flat buffer of bucket ``name`` (allocated if released), every gradient in it settled."""
        flat = self.flat.get(name)
        if flat is None:
            flat = self._allocate(name, *self.lazy[name])
        for f in self.members[name]:
            self._settle(f)
        return flat

    def nbytes(self) -> int:
        """Bytes of gradient buffers held now (between steps: the persistent ones)."""
        return sum(t.numel() * t.element_size() for t in self.flat.values())
