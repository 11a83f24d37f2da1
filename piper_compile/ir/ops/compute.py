"""Compute steps: a compiled segment of the joint graph, and the local pieces of the expert-parallel and
sequence-parallel chains (``passes/expert.py``, ``passes/tensor_parallel.py``)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from piper_compile.ir.kind import Kind
from piper_compile.ir.ops.base import LOSS, Op

if TYPE_CHECKING:
    from piper_compile.ir.dag import Node
    from piper_compile.plan.program import Instr
    from piper_compile.sim.cost import CostModel
    from piper_compile.sim.shapes import Sizes


class Local(Op):
    """Ops that compute on this rank's host/stream (kind COMPUTE) from a segment's inputs; subclasses have
    ``segment`` and ``label`` fields and a ``compute(rt, ins, inputs) -> outputs``."""

    __slots__ = ()
    jumpable = True

    @property
    def kind(self) -> Kind:
        return Kind.COMPUTE

    def short(self, node: "Node", peer: int | None) -> str:
        mb = node.tag("MB")
        return f"{node.tag('PASS', '?')}{getattr(self, 'label')}" + ("" if mb is None else f".mb{mb}")

    def grad_outputs(self) -> tuple[tuple[str, str], ...]:
        return getattr(self, "grads", ())

    def accumulates(self) -> frozenset[str]:
        return frozenset(f for _, f in self.grad_outputs())

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        return cost.compute_time(ins, rank, getattr(self, "segment"))

    def allocates(self, node: "Node", sizes: "Sizes") -> list[tuple[str, int, bool]]:
        return [(v, sizes.value_bytes(v), False) for v in node.outputs]


@dataclasses.dataclass(frozen=True, slots=True)
class Segment(Local):
    """Run compiled segment ``segment`` (one region's F, B, BI or BW, or a chunk of it). ``loss``: the
    value it computes the loss into; ``grads``: (value, parameter) of the gradients it produces, which the
    runtime accumulates into the rank's gradient buffers; ``boundary``: the marker op a directive will
    replace (expert or tensor-parallel steps)."""

    NAME = "segment"
    segment: str
    label: str = ""
    loss: str | None = None
    grads: tuple[tuple[str, str], ...] = ()
    boundary: str | None = None

    def accumulates(self) -> frozenset[str]:
        return frozenset({f for _, f in self.grads} | ({LOSS} if self.loss else set()))

    def transient(self, node: "Node", sizes: "Sizes", fused: frozenset[str] = frozenset()) -> int:
        """Its intermediates (``sim/segment_memory``), the gradients it writes into their buffers included."""
        return sizes.transient(self.segment, tuple(i for i, v in enumerate(node.outputs) if v in fused))

    def compute(self, rt: Any, ins: "Instr", inputs: list[Any]) -> list[Any]:
        seg = rt.segments[self.segment]
        fused = bool(seg.fused) and rt.grads is not None
        # what it holds while it runs: intermediates, and each gradient until it is written
        rt.transient = seg.transient(rt.syms, fused, rt.key) if hasattr(seg, "transient") else 0
        if not fused:
            return seg(inputs, rt.key)
        bufs, overwrite = rt.grads.claim(seg.fused)  # the segment accumulates into them (codegen/accumulate)
        return seg(inputs, rt.key, bufs, not overwrite)


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertStep(Local):
    """A local step of an expert-parallel chain: ``experts`` (this rank's experts on the rows it received,
    forward or backward) or ``unpermute`` (rows back to token order). ``accumulate``: the backward adds the
    expert weight gradients straight into their buffers (``grads`` names them)."""

    NAME = "expert_step"
    role: str
    segment: str
    label: str = ""
    experts: int = 0
    grads: tuple[tuple[str, str], ...] = ()
    accumulate: bool = False
    shape: tuple[Any, ...] = ()
    dtype: str = ""
    forward: bool = True
    load: float = 1.0  # the busiest rank's rows over balanced routing (``shard``'s load)

    def _weights(self, node: "Node") -> tuple[str, ...]:
        return node.inputs[2:5] if self.forward else node.inputs[3:6]

    def allocates(self, node: "Node", sizes: "Sizes") -> list[tuple[str, int, bool]]:
        """The experts' rows out (balanced routing, ``sim/expert_memory``) and, unless they are added into
        the buffers, the local experts' weight gradients; the unpermuted outputs as the graph sizes them."""
        if self.role != "experts":
            return Local.allocates(self, node, sizes)
        from piper_compile.sim.expert_memory import slot_bytes

        out = [(node.outputs[0], slot_bytes(self.shape, self.dtype, sizes, self.load), False)]
        weights = self._weights(node)
        for k, v in enumerate(node.outputs[1:]):
            grad = 0 if self.accumulate or k >= len(weights) else sizes.params_bytes([weights[k].removeprefix("param:")])
            out.append((v, grad, False))
        return out

    def transient(self, node: "Node", sizes: "Sizes", fused: frozenset[str] = frozenset()) -> int:
        """The experts step's copies and its busiest expert's intermediates (``sim/expert_memory``)."""
        if self.role != "experts":
            return 0
        from piper_compile.sim.expert_memory import planned_transient

        return planned_transient(self.shape, self.dtype, self.experts, len(node.devices), self._weights(node)[0],
                                 self.forward, sizes, self.load)

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        """The experts compute on ``load`` times the balanced rows (the busiest rank's step)."""
        return Local.duration(self, cost, ins, rank) * (self.load if self.role == "experts" else 1.0)

    def compute(self, rt: Any, ins: "Instr", inputs: list[Any]) -> list[Any]:
        import torch

        from piper_compile.runtime import expert

        if self.role == "experts":  # what it holds while it runs, at the rows it received
            rt.transient = expert.step_transient(inputs, self.forward, rt.ex.codegen)
            if self.forward:  # how skewed the routing was, against the plan's load
                rt.stats.expert_load = max(rt.stats.expert_load, expert.check_load(inputs[1], self.load, self.label))
        acc, overwrite = None, False
        if self.accumulate and rt.grads is not None:  # w_gate, w_up, w_down, in their buffers' dtype
            acc, overwrite = rt.grads.claim(f for _, f in self.grads)
        if self.role == "experts":  # piper.stats: the grouped SwiGLU's matmuls on the rows this rank received
            rt.stats.expert_flops += expert.swiglu_flops(inputs, self.forward)
        with torch.no_grad():  # the runtime computes gradients itself: build no autograd graph
            return expert.compute(self.role, self.forward, inputs, acc, overwrite, rt.ex.codegen)


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceChunk(Local):
    """Sequence parallelism: this rank's chunk (of ``size``, along ``dim``) of a whole activation."""

    NAME = "sequence_chunk"
    segment: str
    dim: int
    size: int
    subgroups: tuple[tuple[int, ...], ...]
    label: str = ""

    def compute(self, rt: Any, ins: "Instr", inputs: list[Any]) -> list[Any]:
        from piper_compile.runtime import tensor_parallel

        group = next(g for g in self.subgroups if rt.rank in g)
        return [tensor_parallel.chunk(inputs[0], self.dim, self.size, tuple(group).index(rt.rank))]
