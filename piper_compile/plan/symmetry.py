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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

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


def _group_columns(dag: TrainingDAG, world: int) -> torch.Tensor:
    """Per rank (row), one 0/1 column per distinct device group of the DAG: the groups it belongs to, which
    decide its program's nodes."""
    groups: dict[tuple[int, ...], None] = {}
    for n in dag:
        groups.setdefault(n.devices, None)
    cols = torch.zeros((world, len(groups)), dtype=torch.long)
    for g, devices in enumerate(groups):
        idx = torch.tensor(devices, dtype=torch.long)
        cols[idx[(idx >= 0) & (idx < world)], g] = 1
    return cols


def _p2p_peers(dag: TrainingDAG, world: int) -> torch.Tensor:
    """Per rank (row), its peer in each distinct point-to-point tie (column; -1 where it is not in it). A
    tie is the steps of one kind and stream between the same groups in the same pairing."""
    seen: dict[Any, None] = {}
    for n in dag:
        if isinstance(n.op, PointToPoint):
            seen.setdefault((n.kind, n.stream, n.devices, n.op.pairs(n)), None)
    peers = torch.full((world, len(seen)), -1, dtype=torch.long)
    for t, (_, _, devices, pairs) in enumerate(seen):
        peers[torch.tensor(devices, dtype=torch.long), t] = torch.tensor(pairs, dtype=torch.long)
    return peers


def _shared_peers(peers: torch.Tensor) -> torch.Tensor:
    """For each (rank, tie), the first tie of that rank with the same peer (-1 where it has none): which of
    a rank's steps share a peer, and so its channels and FIFO queues."""
    world, ties = peers.shape
    if ties == 0:
        return peers.clone()
    present = peers >= 0
    keys = torch.arange(world).unsqueeze(1) * (world + 1) + peers
    _, inv = torch.unique(keys[present], return_inverse=True)
    tie = torch.arange(ties).expand(world, ties)[present]
    first = torch.full((int(inv.max()) + 1,), ties, dtype=torch.long).scatter_reduce(0, inv, tie, "amin")
    out = torch.full_like(peers, -1)
    out[present] = first[inv]
    return out


@dataclass
class _Subgroups:
    """One collective's subgroups (tensor parallelism): their members, padded with -1, and per rank the
    subgroup it is in (-1 where none)."""

    members: torch.Tensor  # subgroup -> member ranks (-1 padded)
    of_rank: torch.Tensor  # rank -> subgroup index or -1


def _subgroups(dag: TrainingDAG, world: int) -> list[_Subgroups]:
    seen: dict[Any, None] = {}
    for n in dag:
        subs = getattr(n.op, "subgroups", None)
        if subs:
            seen.setdefault((n.stream, subs), None)
    out: list[_Subgroups] = []
    for _, subs in seen:
        width = max(len(g) for g in subs)
        members = torch.tensor([tuple(g) + (-1,) * (width - len(g)) for g in subs], dtype=torch.long)
        for occurrence in _occurrences(subs, world):  # a rank in two subgroups of one collective: a column each
            out.append(_Subgroups(members, occurrence))
    return out


def _occurrences(subs: Any, world: int) -> list[torch.Tensor]:
    """Per k, rank -> the index of its k-th subgroup in ``subs`` (-1 where it has fewer)."""
    cols: list[torch.Tensor] = []
    count = [0] * world
    for i, g in enumerate(subs):
        for r in g:
            if count[r] == len(cols):
                cols.append(torch.full((world,), -1, dtype=torch.long))
            cols[count[r]][r] = i
            count[r] += 1
    return cols


def _classes_of(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Class ids of equal rows, and how many classes: rows grouped by a 64-bit hash (a 1-d unique, much
    faster than sorting whole rows), checked to be equal to their class's first row, else sorted."""
    if rows.numel() == 0:
        return torch.zeros(rows.shape[0], dtype=torch.long), int(rows.shape[0] > 0)
    weights = torch.randint(-(2**62), 2**62, (rows.shape[1],), generator=torch.Generator().manual_seed(0)) | 1
    _, inv = torch.unique((rows * weights).sum(1), return_inverse=True)  # wraps around: a hash
    count = int(inv.max()) + 1
    first = torch.full((count,), rows.shape[0], dtype=torch.long).scatter_reduce(
        0, inv, torch.arange(rows.shape[0]), "amin")
    if not bool((rows == rows[first[inv]]).all()):  # two different rows share a hash
        _, inv = torch.unique(rows, dim=0, return_inverse=True)
        count = int(inv.max()) + 1
    return inv, count


def _subgroup_columns(subs: list[_Subgroups], color: torch.Tensor) -> torch.Tensor:
    """Per rank, for each collective with subgroups, the multiset of classes of its subgroup's members."""
    cols = []
    for s in subs:
        member_colors = torch.where(s.members >= 0, color[s.members.clamp(min=0)], -1).sort(dim=1).values
        kind, _ = _classes_of(member_colors)
        cols.append(torch.where(s.of_rank >= 0, kind[s.of_rank.clamp(min=0)], -1))
    return torch.stack(cols, 1) if cols else color.new_zeros((color.numel(), 0))


def rank_classes(dag: TrainingDAG, world: int) -> Symmetry:
    """The coarsest partition of ``range(world)`` into classes of ranks with the same program up to rank
    ids (see the module docstring), by colour refinement from the device groups (vectorized: a rank's
    colour is the class of its row of features)."""
    peers = _p2p_peers(dag, world)
    ranks = torch.arange(world).unsqueeze(1)
    up = torch.where(peers >= 0, (peers > ranks).long(), -1)
    color, count = _classes_of(torch.cat([_group_columns(dag, world), up, _shared_peers(peers)], 1))
    subs = _subgroups(dag, world)
    while True:
        peer_colors = torch.where(peers >= 0, color[peers.clamp(min=0)], -1)
        color, new = _classes_of(torch.cat([color.unsqueeze(1), peer_colors, _subgroup_columns(subs, color)], 1))
        if new == count:
            break
        count = new
    return _symmetry(color)


def _symmetry(color: torch.Tensor) -> Symmetry:
    """The partition of ranks by ``color``, each class represented by its lowest rank."""
    colors = color.tolist()
    reps: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for r, c in enumerate(colors):
        rep = reps.setdefault(c, r)
        members.setdefault(rep, []).append(r)
    return Symmetry(tuple(reps[c] for c in colors), {rep: tuple(rs) for rep, rs in members.items()})


class Programs(Sequence[Any]):
    """Every rank's program of one plan: built once per symmetry class, other ranks' on demand (the
    representative's instructions with that rank's peers). Indexes and iterates like a list."""

    def __init__(self, dag: TrainingDAG, world: int, reorder_window: int, symmetry: Symmetry) -> None:
        self.dag, self.world, self.reorder_window, self.symmetry = dag, world, reorder_window, symmetry
        self._made: dict[int, Any] = {}
        self._quotient: tuple[list[Any] | None] | None = None  # (the quotient or None), once computed

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
        if self._quotient is None:
            self._quotient = (None if self.symmetry.trivial else _fold(self.representatives(), self.symmetry.rep_of),)
        return self._quotient[0]


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
                cache: dict[tuple[Any, int], Any]) -> list[QueueKey]:
    """The queues whose heads a collective of ``rank`` (on process group ``group``) completes with: every
    member's, or in a quotient (``rep_of``) one representative's per member class. ``cache``: (instruction,
    rank) -> its queues, and (id of a member tuple, -1) -> (that tuple, its members' representatives)."""
    if rep_of is None:
        return [(m, group, -1) for m in ins.members(rank)]
    key = (ins.name, rank)
    if key not in cache:
        members = ins.members(rank)
        by_group = (id(members), -1)  # one group of thousands of ranks is met by many collectives
        if by_group not in cache:
            cache[by_group] = (members, sorted({rep_of[m] for m in members}))  # keeps ``members`` (its id) alive
        cache[key] = [ins.queue(r) for r in cache[by_group][1]]
    return cache[key]
