"""Per-rank programs: the instructions of one rank in issue order, with the waits each needs and the
values it frees (reference counts resolved statically: a value is freed right after its last use)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from piper_compile.ir.dag import Kind, Node, TrainingDAG

_PASS_RANK = {"F": 0, "BI": 1, "B": 1, "BW": 2}


@dataclass(frozen=True, slots=True)
class Instr:
    node: Node
    peer: int | None = None  # SEND/RECV: the other rank
    waits: tuple[str, ...] = ()  # async instructions (node names) this one must wait for
    frees: tuple[str, ...] = ()  # values dropped after this instruction

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def is_async(self) -> bool:
        return self.node.kind.is_comm

    def short(self) -> str:
        n = self.node
        if n.kind is Kind.SEND:
            return f"SEND.{n.attr('msg').split('>')[0]}->r{self.peer}"
        if n.kind is Kind.RECV:
            return f"RECV.{n.attr('msg').split('>')[0]}<-r{self.peer}"
        if n.kind is Kind.ALL_REDUCE:
            return f"AR.{n.name.split('.')[-1]}@{n.stream}"
        if n.kind is Kind.UPDATE:
            return "UPD"
        return n.short()


@dataclass
class Program:
    rank: int
    instrs: list[Instr] = field(default_factory=list)

    def to_text(self) -> str:
        """``F1.mb3  SEND.x->r2  B1.mb2  AR.b0@dp  UPD`` -- one line per instruction with waits/frees."""
        lines = [f"rank {self.rank}: " + "  ".join(i.short() for i in self.instrs)]
        for k, i in enumerate(self.instrs):
            extra = ""
            if i.waits:
                extra += f"  wait[{', '.join(i.waits)}]"
            if i.frees:
                shown = ", ".join(i.frees[:4]) + (f", +{len(i.frees) - 4}" if len(i.frees) > 4 else "")
                extra += f"  free[{shown}]"
            lines.append(f"  {k:3d} {i.short():32s} {i.node.stream:8s}{extra}")
        return "\n".join(lines)


def _peer(node: Node, rank: int) -> int | None:
    if node.kind is Kind.SEND:
        return node.attr("dst")[node.devices.index(rank)]
    if node.kind is Kind.RECV:
        return node.attr("src")[node.devices.index(rank)]
    return None


def _priority(node: Node) -> tuple:
    # Communication is issued as soon as it is ready; compute F before B (GPipe when nothing orders it).
    if node.kind.is_comm and node.attr("purpose") != "loss":
        return (0, 0, 0)
    if node.kind is Kind.COMPUTE:
        return (1, _PASS_RANK.get(node.tag("PASS"), 0), node.attr("mb", 0))
    return (2, 0, 0)


def _local_order(dag: TrainingDAG, rank: int) -> list[Node]:
    local = {n.name for n in dag if rank in n.devices}
    sub = TrainingDAG({k: v for k, v in dag.nodes.items() if k in local and dag.nodes[k].kind is not Kind.RECV})
    preds = dag.predecessors()
    for b in sub.nodes:
        for a in preds[b]:
            if a in sub.nodes:
                sub.order_edges.add((a, b))
    order = [dag.nodes[n] for n in sub.topo_order(key=_priority)]
    # RECVs are posted one compute step before their first consumer: early enough to overlap, late
    # enough not to hold every micro-batch's buffer at once.
    succs: dict[str, list[str]] = defaultdict(list)
    for b, ps in preds.items():
        for a in ps:
            succs[a].append(b)
    pos = {n.name: i for i, n in enumerate(order)}
    inserts: list[tuple[int, int, Node]] = []
    for i, n in enumerate(dag):
        if n.kind is not Kind.RECV or n.name not in local:
            continue
        first = min((pos[s] for s in succs[n.name] if s in pos), default=len(order))
        at = first
        for j in range(first - 1, -1, -1):
            at = j
            if order[j].kind is Kind.COMPUTE:
                break
        else:
            at = 0
        inserts.append((at, i, n))
    for at, _, n in sorted(inserts, key=lambda t: (t[0], t[1]), reverse=True):
        order.insert(at, n)
    # Stable re-sort of inserts at the same position keeps DAG order; reverse insertion above keeps it.
    return order


def build_program(dag: TrainingDAG, rank: int, external: set[str] | None = None) -> Program:
    """Instructions of ``rank`` in issue order, with waits on async predecessors and frees."""
    order = _local_order(dag, rank)
    preds = dag.predecessors()
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
    return Program(rank, instrs)


def build_programs(dag: TrainingDAG, world_size: int) -> list[Program]:
    return [build_program(dag, r) for r in range(world_size)]
