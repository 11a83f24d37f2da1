"""Expert-parallel all-to-alls (``shard``): the per-expert counts exchange, and the rows of a dispatch
(to the experts' ranks) or a combine (back); the local steps are ``ir/ops/compute.ExpertStep``."""
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


class _AllToAll(Collective):
    __slots__ = ()
    jumpable = True

    @property
    def kind(self) -> Kind:
        return Kind.ALL_TO_ALL

    def allocates(self, node: "Node", sizes: "Sizes") -> list[tuple[str, int, bool]]:
        """The rows received (balanced routing times the ``shard`` load on the experts' side,
        ``sim/expert_memory``); the counts and the route: none."""
        from piper_compile.sim.expert_memory import slot_bytes

        load = getattr(self, "load", 1.0) if getattr(self, "role", "") == "dispatch" else 1.0
        rows = slot_bytes(getattr(self, "shape", ()), getattr(self, "dtype", ""), sizes, load)
        return [(v, rows if k == 0 and rows else 0, False) for k, v in enumerate(node.outputs)]

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        import torch

        from piper_compile.runtime import expert

        n = ins.node
        with torch.no_grad():
            work, outs, sending = expert.all_to_all(self, [rt.get(v) for v in n.inputs],
                                                    rt.group(n.stream, n.devices), len(n.devices))
        rt.count("ep_counts" if isinstance(self, ExpertCounts) else "ep")
        for v, t in zip(n.outputs, outs):
            rt.put(v, t)
        rt.send_buffer(n.name, sending)  # alive until the all-to-all completes
        rt.issue(ins, pos, work)


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertCounts(_AllToAll):
    """Sort the slots by expert and exchange the per-expert counts (fixed size: latency only)."""

    NAME = "expert_counts"
    experts: int
    mb: int = 0

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        return cost.collective_time(ins, rank, "all_to_all", len(ins.node.devices), 4)


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertA2A(_AllToAll):
    """The rows of a ``dispatch`` (to the experts' ranks, sized by the exchanged counts) or a ``combine``
    (back, the inverse split sizes); ``shape``/``dtype``: the rows (for the cost model)."""

    NAME = "expert_a2a"
    role: str
    experts: int
    shape: tuple[Any, ...] = ()
    dtype: str = ""
    mb: int = 0
    forward: bool = True
    load: float = 1.0  # the busiest rank's rows over balanced routing (``shard``'s load)

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        """The busiest rank's bytes: it receives (dispatch) or sends back (combine) ``load`` times its slots."""
        return cost.collective_time(ins, rank, "all_to_all", len(ins.node.devices),
                                    int(self.load * cost.tensor_bytes(self.shape, self.dtype or "float32")))
