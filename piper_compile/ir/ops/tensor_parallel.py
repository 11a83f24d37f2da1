"""Tensor-parallel collectives (``shard_tensor``): the all-reduce of a row-parallel layer's partial sums,
and for sequence parallelism the all-gather / reduce-scatter along the sequence dimension. One node is
SPMD over a region's ranks; each rank runs it within its own tensor-parallel group (``subgroups``)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from piper_compile.ir.kind import Kind
from piper_compile.ir.ops.base import Collective

if TYPE_CHECKING:
    from piper_compile.ir.dag import Node
    from piper_compile.plan.program import Instr
    from piper_compile.sim.cost import CostModel
    from piper_compile.sim.shapes import Sizes

_KINDS = {"all_reduce": Kind.ALL_REDUCE, "all_gather": Kind.ALL_GATHER, "reduce_scatter": Kind.REDUCE_SCATTER}


@dataclasses.dataclass(frozen=True, slots=True)
class TpCollective(Collective):
    """``collective`` ("all_reduce" | "all_gather" | "reduce_scatter") of one activation within each
    tensor-parallel group; ``dim``/``size`` for the sequence-parallel ones; ``shape``/``dtype``: the
    output's (for the cost model)."""

    NAME = "tp_collective"
    collective: str
    subgroups: tuple[tuple[int, ...], ...]
    shape: tuple[Any, ...] = ()
    dtype: str = ""
    dim: int = 0
    size: int = 1
    mb: int = 0

    @property
    def kind(self) -> Kind:
        return _KINDS[self.collective]

    def short(self, node: "Node", peer: int | None) -> str:
        if self.collective == "all_reduce":
            return f"AR.{node.name.split('.')[-1]}@{node.stream}"
        abbr = "AG" if self.collective == "all_gather" else "RS"
        return f"{abbr}.{node.name.rsplit('.', 1)[-1]}@{node.stream}"

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        members = len(self.members(ins.node, rank))
        nbytes = cost.tensor_bytes(self.shape, self.dtype or "float32")
        nbytes *= members if self.collective == "reduce_scatter" else 1  # the shape is the output's (a chunk)
        return cost.collective_time(ins, rank, self.collective, members, nbytes)

    def allocates(self, node: "Node", sizes: "Sizes") -> list[tuple[str, int, bool]]:
        if self.collective == "all_reduce":  # reduced in place of its input (or a copy counted by the runtime)
            return []
        return [(v, sizes.value_bytes(v), False) for v in node.outputs]

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        from piper_compile.runtime import tensor_parallel

        rt.count("tp")
        n = ins.node
        x = rt.get(n.inputs[0])
        group = rt.group(n.stream, self.members(n, rt.rank))
        if self.collective == "all_reduce":  # partial sums, reduced in place at their last use
            t = x if n.inputs[0] in ins.frees else x.clone()
            rt.put(n.outputs[0], t)
            rt.issue(ins, pos, rt.all_reduce(t, n.stream, self.members(n, rt.rank)))
            return
        start = tensor_parallel.gather if self.collective == "all_gather" else tensor_parallel.reduce_scatter_dim
        work, sending, done = start(x, self.dim, self.size, group)
        rt.send_buffer(n.name, sending)
        rt.on_finish(n.name, lambda: rt.put(n.outputs[0], done(), count=False))
        nbytes = sending.numel() * sending.element_size()
        rt.count_live(nbytes * self.size if self.collective == "all_gather" else nbytes // self.size)
        rt.issue(ins, pos, work)
