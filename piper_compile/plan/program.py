"""Per-rank programs: the instructions of one rank in issue order, with the waits each needs and the
values it frees (reference counts resolved statically: a value is freed right after its last use)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from piper_compile.ir.dag import Kind, Node, TrainingDAG
from piper_compile.ir.ops import QueueKey, p2p_channel
from piper_compile.ir.order import schedule_order
from piper_compile.plan.reorder import record_reorders

if TYPE_CHECKING:
    from piper_compile.plan.symmetry import Programs

__all__ = ["Instr", "Program", "build_program", "build_programs", "p2p_channel", "schedule_order"]


@dataclass(frozen=True, slots=True)
class Instr:
    node: Node
    peer: int | None = None  # SEND/RECV: the other rank
    waits: tuple[str, ...] = ()  # async instructions (node names) this one must wait for
    frees: tuple[str, ...] = ()  # values dropped after this instruction
    partner: str | None = None  # the overlap partner that may run before this one (``plan/reorder.py``)
    # sink steps that may run while this one's input is in flight, nearest first, each with the reordered
    # steps (partner, nearer fillers) that must have run early before it may
    fillers: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def is_async(self) -> bool:
        return self.node.kind.is_comm

    def group_name(self, rank: int) -> str:
        """Process group this instruction runs on when executed by ``rank``: its stream, and for
        point-to-point traffic also the direction, so the two directions of a rank pair never queue
        behind each other (NCCL would otherwise run both on one communicator stream)."""
        if self.peer is None:
            return self.node.stream
        return self.node.op.channel(self.node, rank, self.peer)  # type: ignore[attr-defined]

    def queue(self, rank: int) -> QueueKey:
        """The FIFO of the execution model this (asynchronous) instruction of ``rank`` joins."""
        return self.node.op.queue(self.node, rank, self.peer)

    def members(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` runs this collective with (its subgroup under tensor parallelism)."""
        return self.node.op.members(self.node, rank)

    def short(self) -> str:
        return self.node.short(self.peer)

    def slot(self, partner: "Instr | None") -> str:
        """``F0.mb3|B1.mb2`` for an overlap slot (this step and its ``partner``), else ``short()``."""
        return self.short() if partner is None else f"{self.short()}|{partner.short()}"


@dataclass
class Program:
    rank: int
    instrs: list[Instr] = field(default_factory=list)

    def update_node(self) -> Node | None:
        """This rank's UPDATE (the optimizer step of its device group), if it trains anything."""
        return next((i.node for i in self.instrs if i.node.kind is Kind.UPDATE), None)

    def positions(self) -> dict[str, int]:
        """instruction name -> its position in the program."""
        return {ins.name: k for k, ins in enumerate(self.instrs)}

    def to_text(self) -> str:
        """``F1.mb3  SEND.x->r2  F0.mb3|B1.mb2  AR.b0@dp  UPD`` (``a|b``: an overlap slot, ``b`` may run
        first) -- then one line per instruction with its waits, fillers and frees."""
        at = self.positions()
        slots = [i.slot(self.instrs[at[i.partner]] if i.partner else None) for i in self.instrs]
        lines = [f"rank {self.rank}: " + "  ".join(slots)]
        for k, i in enumerate(self.instrs):
            extra = ""
            if i.waits:
                extra += f"  wait[{', '.join(i.waits)}]"
            if i.fillers:
                fills = [f + (" after " + "+".join(a) if a else "") for f, a in i.fillers]
                extra += f"  fill[{', '.join(fills)}]"
            if i.frees:
                shown = ", ".join(i.frees[:4]) + (f", +{len(i.frees) - 4}" if len(i.frees) > 4 else "")
                extra += f"  free[{shown}]"
            lines.append(f"  {k:3d} {i.short():32s} {i.node.stream:8s}{extra}")
        return "\n".join(lines)


def _peer(node: Node, rank: int) -> int | None:
    peer = getattr(node.op, "peer", None)
    return peer(node, rank) if peer is not None else None


def _predecessors(dag: TrainingDAG) -> dict[str, set[str]]:
    return dag.cached("predecessors", (len(dag.nodes), len(dag.order_edges)), dag.predecessors)


def _device_sets(dag: TrainingDAG) -> dict[str, frozenset[int]]:
    """Each node's device group as a set, by node name (membership tests on groups of thousands of ranks;
    one set per distinct group, found by identity first: hashing a group of thousands of ranks per node
    costs more than the test)."""
    def make() -> dict[str, frozenset[int]]:
        by_id: dict[int, frozenset[int]] = {}
        by_value: dict[tuple[int, ...], frozenset[int]] = {}
        out: dict[str, frozenset[int]] = {}
        for n in dag:
            s = by_id.get(id(n.devices))
            if s is None:
                s = by_id[id(n.devices)] = by_value.setdefault(n.devices, frozenset(n.devices))
            out[n.name] = s
        return out

    return dag.cached("device_sets", (len(dag.nodes), len(dag.order_edges)), make)


def _local_order(dag: TrainingDAG, rank: int) -> list[Node]:
    """This rank's instructions: the global order restricted to the rank, with each RECV posted one
    compute step before its first consumer (never before its own predecessors), and RECVs from one peer
    on one stream posted in the order that peer sends them (point-to-point messages of a rank pair match
    in order on NCCL and gloo)."""
    glob = schedule_order(dag)
    gpos = {n: i for i, n in enumerate(glob)}
    mine = _device_sets(dag)
    order = [dag.nodes[n] for n in glob if rank in mine[n] and dag.nodes[n].kind is not Kind.RECV]
    preds = _predecessors(dag)
    succs: dict[str, list[str]] = defaultdict(list)
    for b, ps in preds.items():
        for a in ps:
            succs[a].append(b)
    pos = {n.name: i for i, n in enumerate(order)}
    send_of = {n.op.msg: n.name for n in dag.of_kind(Kind.SEND)}  # type: ignore[attr-defined]
    channels: dict[tuple[str, int], list[tuple[int, int, Node]]] = defaultdict(list)
    recv_at: dict[str, int] = {}
    depth: dict[str, int] = {}  # RECVs it is ordered after, transitively (a tied gradient's parts)
    for n in sorted((n for n in dag.of_kind(Kind.RECV) if rank in mine[n.name]), key=lambda n: gpos[n.name]):
        first = min((pos[s] for s in succs[n.name] if s in pos), default=len(order))
        at = 0
        for j in range(first - 1, -1, -1):
            if order[j].kind is Kind.COMPUTE:
                at = j
                break
        # never before its own predecessors (a gradient receive ordered after the writers of that gradient,
        # a tied gradient's part after the parts added in before it)
        at = recv_at[n.name] = max([at] + [pos[p] + 1 for p in preds[n.name] if p in pos]
                                   + [recv_at[p] for p in preds[n.name] if p in recv_at])
        depth[n.name] = max([0] + [depth[p] + 1 for p in preds[n.name] if p in depth])
        channels[(n.stream, _peer(n, rank))].append((gpos[send_of[n.op.msg]], at, n))  # type: ignore[attr-defined]
    inserts: list[tuple[int, int, int, Node]] = []
    for chan in channels.values():
        chan.sort(key=lambda t: t[0])  # the peer's send order
        latest = len(order)
        for send_pos, at, n in reversed(chan):  # never post a RECV after a later message of the channel
            latest = min(latest, at)
            inserts.append((latest, depth[n.name], send_pos, n))
    # at one position: a RECV after the RECVs it is ordered after, then in send order
    for at, _, _, n in sorted(inserts, key=lambda t: (t[0], t[1], t[2]), reverse=True):
        order.insert(at, n)
    return order


def build_program(dag: TrainingDAG, rank: int, reorder_window: int = 8) -> Program:
    """Instructions of ``rank`` in issue order, with waits on async predecessors, frees, and the
    reorderings the runtime may make (``plan/reorder.py``; fillers up to ``reorder_window`` ahead)."""
    order = _local_order(dag, rank)
    preds = _predecessors(dag)
    async_names = {n.name for n in order if n.kind.is_comm}
    last_use: dict[str, int] = {}
    produced_at: dict[str, int] = {}
    for i, n in enumerate(order):
        for v in n.inputs:
            last_use[v] = i
        for v in n.outputs:
            produced_at[v] = i
    frees: dict[int, list[str]] = defaultdict(list)
    for v, i in produced_at.items():
        frees[last_use.get(v, i)].append(v)
    instrs = []
    for i, n in enumerate(order):
        waits = tuple(sorted(p for p in preds[n.name] if p in async_names))
        instrs.append(Instr(n, _peer(n, rank), waits, tuple(sorted(frees.get(i, ())))))
    return record_reorders(Program(rank, instrs), reorder_window)


def build_programs(dag: TrainingDAG, world_size: int, reorder_window: int = 8) -> "Programs":
    """Every rank's program (``build_program``), built once per class of ranks with the same program up
    to rank ids (``plan/symmetry.py``) and for other ranks on demand."""
    from piper_compile.plan.symmetry import Programs, rank_classes

    return Programs(dag, world_size, reorder_window, rank_classes(dag, world_size))
