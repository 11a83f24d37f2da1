"""SPMD symmetry: ranks whose programs are the same up to rank ids are planned, verified and simulated once.

A plan for 16,384 ranks is mostly data-parallel replicas of a few pipeline stages: replica k of stage s
runs stage s's program with its own peers. ``rank_classes`` partitions the ranks into classes such that
every rank of a class has

- the same steps (it is in the same device groups, so the same DAG nodes are its program's),
- for each point-to-point step, a peer in the same class, on the same side (the channel direction), and
  the same pattern of which steps share a peer (the runtime's channels and FIFO queues),
- for each collective with subgroups (tensor parallelism), a subgroup with the same classes of members,

by colour refinement: start from the device groups, split classes by the classes of their peers, until
nothing splits (an equitable partition). Each class is represented by its lowest rank.

On such a partition the execution model of the verifier and the simulator is the same for every rank of a
class: what one rank can do at any moment, the others of its class can do too, because their partners are
in the same classes and behave alike. So the *quotient* -- one program per class, each peer replaced by
its class's representative, a collective waiting for one representative per member class -- deadlocks iff
the full world does, and gives every rank of a class its representative's times and memory. The quotient is
used only where it is exact: when no two real queues of a representative fold into one (``quotient``) and
the cost model prices every rank of a class alike (``CostModel.symmetric``); otherwise every rank runs.

``Programs`` builds one program per class (``build_program``), and any other rank's on demand, by giving
the representative's instructions that rank's peers.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from piper_compile.ir.dag import TrainingDAG
from piper_compile.ir.ops import QueueKey
from piper_compile.ir.ops.p2p import PointToPoint

__all__ = ["Programs", "Symmetry", "rank_classes"]


@dataclass(frozen=True)
class Symmetry:
    """A partition of the ranks into classes of identical programs (up to rank ids)."""

    rep_of: tuple[int, ...]  # rank -> its class's representative (the class's lowest rank)
    classes: dict[int, tuple[int, ...]]  # representative -> the ranks of its class, ascending

    @classmethod
    def none(cls, world: int) -> "Symmetry":
        """Every rank its own class."""
        return cls(tuple(range(world)), {r: (r,) for r in range(world)})

    @property
    def trivial(self) -> bool:
        return len(self.classes) == len(self.rep_of)


def _memberships(dag: TrainingDAG, world: int) -> list[tuple[int, ...]]:
    """Per rank, the distinct device groups (by first appearance) it belongs to: its program's nodes."""
    groups: dict[tuple[int, ...], int] = {}
    for n in dag:
        groups.setdefault(n.devices, len(groups))
    member: list[list[int]] = [[] for _ in range(world)]
    for devices, gid in groups.items():
        for r in devices:
            if 0 <= r < world:
                member[r].append(gid)
    return [tuple(m) for m in member]


@dataclass
class _Ties:
    """What ties each rank to ranks outside its device groups: P2P peers and collective subgroups."""

    p2p: list[list[tuple[int, int, bool, int]]]  # rank -> (tie, peer, peer above, local peer id)
    subgroups: list[tuple[int, tuple[int, ...]]]  # (tie, ranks of one subgroup)
    member_of: list[list[int]]  # rank -> indices into ``subgroups``


def _ties(dag: TrainingDAG, world: int) -> _Ties:
    seen: set[Any] = set()
    p2p: list[list[tuple[int, int, bool, int]]] = [[] for _ in range(world)]
    out = _Ties(p2p, [], [[] for _ in range(world)])
    for n in dag:
        op = n.op
        if isinstance(op, PointToPoint):
            key: Any = (n.kind, n.stream, n.devices, op.pairs(n))
            if key not in seen:
                seen.add(key)
                for r, peer in zip(n.devices, op.pairs(n)):
                    p2p[r].append((len(seen), peer, peer > r, 0))
        elif getattr(op, "subgroups", None):
            key = (n.stream, op.subgroups)  # type: ignore[attr-defined]
            if key not in seen:
                seen.add(key)
                for g in op.subgroups:  # type: ignore[attr-defined]
                    for r in g:
                        out.member_of[r].append(len(out.subgroups))
                    out.subgroups.append((len(seen), tuple(g)))
    for r, ties in enumerate(p2p):  # which of a rank's steps share a peer (they share its channels)
        local: dict[int, int] = {}
        p2p[r] = [(t, p, up, local.setdefault(p, len(local))) for t, p, up, _ in ties]
    return out


def rank_classes(dag: TrainingDAG, world: int) -> Symmetry:
    """The coarsest partition of ``range(world)`` into classes of ranks with the same program up to rank
    ids (see the module docstring), by colour refinement from the device groups."""
    first: dict[Any, int] = {}
    color = [first.setdefault(m, len(first)) for m in _memberships(dag, world)]
    ties = _ties(dag, world)
    count = len(first)
    while True:
        sub = [(t, tuple(sorted(Counter(color[m] for m in g).items()))) for t, g in ties.subgroups]
        ids: dict[Any, int] = {}
        new = [ids.setdefault((color[r], tuple((t, color[p], up, k) for t, p, up, k in ties.p2p[r]),
                               tuple(sub[i] for i in ties.member_of[r])), len(ids)) for r in range(world)]
        color = new
        if len(ids) == count:
            break
        count = len(ids)
    reps: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for r, c in enumerate(color):
        rep = reps.setdefault(c, r)
        members.setdefault(rep, []).append(r)
    return Symmetry(tuple(reps[c] for c in color), {rep: tuple(rs) for rep, rs in members.items()})


class Programs(Sequence[Any]):
    """Every rank's program of one plan: built once per symmetry class, other ranks' on demand (the
    representative's instructions with that rank's peers). Indexes and iterates like a list."""

    def __init__(self, dag: TrainingDAG, world: int, reorder_window: int, symmetry: Symmetry) -> None:
        self.dag, self.world, self.reorder_window, self.symmetry = dag, world, reorder_window, symmetry
        self._made: dict[int, Any] = {}
        self._quotient: list[Any] | None | bool = False

    def __len__(self) -> int:
        return self.world

    @overload
    def __getitem__(self, rank: int) -> Any: ...

    @overload
    def __getitem__(self, rank: slice) -> list[Any]: ...

    def __getitem__(self, rank: int | slice) -> Any:
        if isinstance(rank, slice):
            return [self[r] for r in range(self.world)[rank]]
        if rank < 0:
            rank += self.world
        if not 0 <= rank < self.world:
            raise IndexError(f"rank {rank} out of range for {self.world} ranks")
        if rank not in self._made:
            self._made[rank] = self._make(rank)
        return self._made[rank]

    def __iter__(self) -> Iterator[Any]:
        return (self[r] for r in range(self.world))

    def _make(self, rank: int) -> Any:
        from piper_compile.plan.program import Program, build_program

        rep = self.symmetry.rep_of[rank]
        if rep == rank:
            return build_program(self.dag, rank, self.reorder_window)
        return Program(rank, [dataclasses.replace(i, peer=i.node.op.peer(i.node, rank)) if i.peer is not None
                              else i for i in self[rep].instrs])

    def representatives(self) -> list[Any]:
        """One program per class (its lowest rank's)."""
        return [self[rep] for rep in self.symmetry.classes]

    def quotient(self) -> list[Any] | None:
        """The representatives' programs with every peer replaced by its class's representative, or None
        where that is not exact: the partition is trivial, or two of a representative's real P2P queues
        would fold into one."""
        if self._quotient is False:
            self._quotient = None if self.symmetry.trivial else _fold(self.representatives(), self.symmetry.rep_of)
        return self._quotient  # type: ignore[return-value]


def _fold(programs: list[Any], rep_of: Sequence[int]) -> list[Any] | None:
    from piper_compile.plan.program import Program

    out = []
    for p in programs:
        real: dict[QueueKey, QueueKey] = {}
        instrs = []
        for i in p.instrs:
            if i.peer is None:
                instrs.append(i)
                continue
            q, key = dataclasses.replace(i, peer=rep_of[i.peer]), i.queue(p.rank)
            if real.setdefault(q.queue(p.rank), key) != key:
                return None  # two real channels would share one queue in the quotient
            instrs.append(q)
        out.append(Program(p.rank, instrs))
    return out


def member_keys(ins: Any, rank: int, group: str, rep_of: Sequence[int] | None,
                cache: dict[tuple[str, int], list[QueueKey]]) -> list[QueueKey]:
    """The queues whose heads a collective of ``rank`` (on process group ``group``) completes with: every
    member's, or in a quotient (``rep_of``) one representative's per member class."""
    if rep_of is None:
        return [(m, group, -1) for m in ins.members(rank)]
    key = (ins.name, rank)
    if key not in cache:
        reps = sorted({rep_of[m] for m in ins.members(rank)})
        cache[key] = [ins.queue(r) for r in reps]
    return cache[key]
