"""Gradient synchronisation and the update: bucketed gradient reduction, the step's loss, the global
gradient norm, and the optimizer step of a device group (``passes/lower.py`` inserts them)."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from piper_compile.ir.kind import Kind
from piper_compile.ir.ops.base import Collective, Op

if TYPE_CHECKING:
    from piper_compile.ir.dag import Node
    from piper_compile.plan.program import Instr
    from piper_compile.sim.cost import CostModel


@dataclasses.dataclass(frozen=True, slots=True)
class GradReduce(Collective):
    """Reduce the gradients of bucket ``bucket`` (parameters ``params``) over the group: an all-reduce,
    or for ZeRO-2/3 (``scatter``) a reduce-scatter into this rank's gradient shard. ``per_microbatch``:
    one of several reduce-scatters of the step (after micro-batch ``mb``), summed into the shard in
    micro-batch order. ``subgroups``: tensor parallelism, each rank reduces within its data-parallel
    subgroup."""

    NAME = "grad_reduce"
    bucket: str
    params: tuple[str, ...]
    level: int = 0
    scatter: bool = False
    per_microbatch: bool = False
    mb: int = 0
    subgroups: tuple[tuple[int, ...], ...] | None = None

    @property
    def kind(self) -> Kind:
        return Kind.REDUCE_SCATTER if self.scatter else Kind.ALL_REDUCE

    def short(self, node: "Node", peer: int | None) -> str:
        if self.scatter:
            return f"RS.{self.bucket.rsplit('.', 1)[-1]}@{node.stream}"
        return f"AR.{node.name.split('.')[-1]}@{node.stream}"

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        algo = "reduce_scatter" if self.scatter else "all_reduce"
        return cost.collective_time(ins, rank, algo, len(self.members(ins.node, rank)),
                                    cost.params_bytes(self.params, "reduce"))

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        rt.count("grad")
        if self.scatter:
            rt.issue(ins, pos, self._reduce_scatter(rt, ins))
            return
        t = rt.grads.bucket(self.bucket)
        group = self.members(ins.node, rt.rank)
        if len(ins.node.devices) == 1:
            rt.issue(ins, pos, None)
            return
        low = _in_reduce_dtype(rt, t)
        if low is not t:  # options["mixed_precision"]["reduce_dtype"]: back into the fp32 buffer once done
            rt.on_finish(ins.node.name, functools.partial(t.copy_, low))
        rt.issue(ins, pos, rt.all_reduce(low, ins.node.stream, group))

    def _reduce_scatter(self, rt: Any, ins: "Instr") -> Any:
        """ZeRO-2/3: the bucket's summed gradient, this rank's shard only; the full buffer is released.
        The previous reduce-scatters are retired first (as FSDP does), so at most one full bucket is in
        flight: polling cannot do it, gloo's reduce-scatter only reports completion once waited on."""
        from piper_compile.runtime.comm import reduce_scatter_consuming

        rt.retire_kept()
        zero = rt.state.zero
        full = rt.grads.bucket(self.bucket)
        out = zero.partial_shard(self.bucket, self.mb) if self.per_microbatch else zero.shard_grad(self.bucket, None)
        then = [functools.partial(zero.fold, self.bucket, self.mb)] if self.per_microbatch else []
        sent, got = _in_reduce_dtype(rt, full), out
        if sent is not full:  # reduce_dtype: scatter the low-precision copy, then into the fp32 shard
            got = torch.empty(out.shape, dtype=sent.dtype, device=out.device)
            then.insert(0, functools.partial(out.copy_, got))
        if then:  # one of several per step: summed into the shard when it finishes
            rt.on_finish(ins.node.name, lambda: [f() for f in then])
        rt.keep(ins.node.name, sent)  # alive until the reduce-scatter completes
        rt.grads.release(self.bucket)
        work = reduce_scatter_consuming(got, sent, rt.group(ins.node.stream, ins.node.devices))
        rt.note_grad_bytes(extra=sent)
        return work


def _in_reduce_dtype(rt: Any, grad: Any) -> Any:
    """``grad`` as the reduction sends it: itself, or a copy in ``options["mixed_precision"]``'s
    ``reduce_dtype`` (bf16 halves the bytes; the sum comes back into the full-precision buffer)."""
    want = rt.state.precision.reduce(grad.dtype)
    return grad if want == grad.dtype else grad.to(want)


class _ScalarAllReduce(Collective):
    """A one-number world sum: the step's loss or the squared gradient norm. Subclasses say ``LABEL`` (the
    program label and the stats counter) and ``value`` (this rank's share, kept in ``rt.result``)."""

    __slots__ = ()
    LABEL: ClassVar[str] = ""

    @property
    def kind(self) -> Kind:
        return Kind.ALL_REDUCE

    def short(self, node: "Node", peer: int | None) -> str:
        return f"AR.{self.LABEL}@{node.stream}"

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        return cost.collective_time(ins, rank, "all_reduce", len(ins.node.devices), 4)

    def value(self, rt: Any) -> Any:  # pragma: no cover - every subclass says
        raise NotImplementedError

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        rt.count(self.LABEL)
        t = rt.result[self.LABEL] = self.value(rt)
        rt.issue(ins, pos, rt.all_reduce(t, ins.node.stream, ins.node.devices))


@dataclasses.dataclass(frozen=True, slots=True)
class LossReduce(_ScalarAllReduce):
    """The step's loss on every rank: ``holders`` (the ranks computing it) add their share of the global
    mean (``runtime/consistency.Weights``), the others zero."""

    NAME = "loss_reduce"
    LABEL = "loss"
    holders: tuple[int, ...]

    def value(self, rt: Any) -> Any:
        return rt.loss_sum / rt.weights().loss_divisor if rt.rank in self.holders else rt.loss_sum.new_zeros(())


@dataclasses.dataclass(frozen=True, slots=True)
class NormReduce(_ScalarAllReduce):
    """``options["clip_grad_norm"]``: the world sum of every rank's share of the squared gradient norm."""

    NAME = "norm_reduce"
    LABEL = "gradnorm"
    max_norm: float  # 0: no clipping (the sum is fp16 loss scaling's inf/NaN check, runtime/loss_scale.py)

    def value(self, rt: Any) -> Any:
        return rt.state.local_grad_sq(rt.update, rt.grads, rt.rank)


@dataclasses.dataclass(frozen=True, slots=True)
class Update(Op):
    """The optimizer step of a device group: ``params`` it updates (whole unless in one of the ZeRO
    ``shards`` buckets), ``norm_params`` whose gradients the group counts in the global norm, and
    ``ep_params`` (expert shards: each rank updates and counts its own)."""

    NAME = "update"
    params: tuple[str, ...]
    norm_params: tuple[str, ...] = ()
    ep_params: tuple[str, ...] = ()
    zero: int = 0
    shards: tuple[str, ...] = ()

    @property
    def kind(self) -> Kind:
        return Kind.UPDATE

    def short(self, node: "Node", peer: int | None) -> str:
        return "UPD"

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        return cost.update_time(ins, rank, cost.params_bytes(self.params))

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        rt.state.apply_update(self, rt.grads, rt.params, rt.result.get("gradnorm"), rt.max_norm)
        if rt.state.zero is not None:
            rt.state.zero.release_grad_shards()
