"""The global issue order of a training DAG: which ready step goes first when nothing orders two steps."""
from __future__ import annotations

from piper_compile.ir.dag import Kind, Node, TrainingDAG
from piper_compile.ir.ops import ExpertStep

_PASS_RANK = {"F": 0, "BI": 1, "B": 1, "BW": 2}


def _priority(node: Node) -> tuple:
    # Communication is issued as soon as it is ready; compute F before B (GPipe when nothing orders it).
    # That includes the loss all-reduce (its own stream): issued after the last forward, it completes
    # during the backward instead of adding a round trip after the update.
    if node.kind.is_comm:
        return (0, 0, 0, 0)
    if node.kind is Kind.COMPUTE:
        # Expert steps wait for an all-to-all: any other ready compute goes first (e.g. DualPipeV's B of
        # one micro-batch while the F of another is being dispatched), so the exchange hides behind it.
        waits = 1 if isinstance(node.op, ExpertStep) else 0
        return (1, waits, _PASS_RANK.get(node.tag("PASS"), 0), node.attr("mb", 0))
    return (2, 0, 0, 0)


def schedule_order(dag: TrainingDAG) -> list[str]:
    """The order programs issue the DAG's nodes in: one topological order of the whole DAG (cross-rank
    dependencies included), cached on the DAG. Each rank's program is this order restricted to the rank
    (``plan/program.py``); the ZeRO-3 gather placement reads it too (``passes/zero.py``)."""
    return dag.cached("global_order", (len(dag.nodes), len(dag.order_edges)), lambda: dag.topo_order(key=_priority))
