"""ZeRO parameter all-gathers: before a compute step that reads a ZeRO-3 bucket (its parameters become
values of that step, freed after it), or after the update for ZeRO-1/2 (into the full flat parameters
the model's parameters are views of)."""
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


@dataclasses.dataclass(frozen=True, slots=True)
class ParamGather(Collective):
    """All-gather ZeRO bucket ``bucket`` (level ``level``, parameters ``params``); ``for_step``: the compute
    step that reads the gathered parameters (ZeRO-3), None for the post-update gather (ZeRO-1/2).
    ``subgroups``: tensor parallelism (ZeRO-1), each data-parallel subgroup gathers its own copy."""

    NAME = "param_gather"
    bucket: str
    params: tuple[str, ...]
    level: int
    for_step: str | None = None
    subgroups: tuple[tuple[int, ...], ...] | None = None

    @property
    def kind(self) -> Kind:
        return Kind.ALL_GATHER

    @property
    def jumpable(self) -> bool:  # type: ignore[override]
        return self.for_step is not None  # per-use gathers may be passed; the post-update one may not

    def short(self, node: "Node", peer: int | None) -> str:
        where = f">{self.for_step}" if self.for_step else ""
        return f"AG.{self.bucket.rsplit('.', 1)[-1]}{where}@{node.stream}"

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        as_ = "compute" if self.for_step else "master"  # ZeRO-3 gathers the compute copy; ZeRO-1/2 the master
        return cost.collective_time(ins, rank, "all_gather", len(self.members(ins.node, rank)),
                                    cost.params_bytes(self.params, as_))

    def allocates(self, node: "Node", sizes: "Sizes") -> list[tuple[str, int, bool]]:
        from piper_compile.ir.dag import param_fqn

        return [(v, sizes.params_bytes([param_fqn(v)], "compute"), True) for v in node.outputs]

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        from piper_compile.ir.dag import param_fqn

        rt.count("param")
        zero = rt.state.zero
        group = rt.group(ins.node.stream, ins.node.devices)
        if self.for_step is None:
            rt.issue(ins, pos, zero.post_update_gather(self.bucket, group))
            return
        flat, work = zero.gather(self.bucket, group)
        views = zero.buckets[self.bucket].views(flat)
        for v in ins.node.outputs:
            rt.put(v, views[param_fqn(v)], gathered=True)
        rt.issue(ins, pos, work)
