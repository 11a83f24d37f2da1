"""Simulate all ranks' programs together before anything runs.

Model (the stricter of NCCL and gloo, so a plan it accepts runs on both): each rank's host thread
issues instructions in order; compute blocks the host until the async instructions it waits on are
complete; communication is queued FIFO: a collective on its stream's queue (one per rank and stream),
a SEND/RECV on the queue of its stream, peer and direction (NCCL runs point-to-point traffic of each
rank pair on its own communicator, gloo on its own pair; piper gives each direction its own process
group per stream, see ``Instr.group_name``); a SEND and its RECV complete together when both
are at the head of their queues (rendezvous); a collective completes when it is at the head of the
stream queue of every member. A state where no rank can move
is a deadlock, reported as a rank x step grid with the stuck instruction marked.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from piper_compile.errors import PiperPlanError
from piper_compile.ir.dag import Kind
from piper_compile.plan.reorder import check_reorders
from piper_compile.plan.program import Instr, Program
from piper_compile.plan.symmetry import Programs, member_keys


@dataclass
class VerifyResult:
    steps: int  # simulation rounds until every rank finished


def _check_matching(programs: list[Program]) -> None:
    sends = Counter()
    recvs = Counter()
    for p in programs:
        for i in p.instrs:
            if i.node.kind is Kind.SEND:
                sends[(p.rank, i.peer, i.node.op.msg)] += 1  # type: ignore[attr-defined]
            elif i.node.kind is Kind.RECV:
                recvs[(i.peer, p.rank, i.node.op.msg)] += 1  # type: ignore[attr-defined]
    for (src, dst, msg), c in (sends - recvs).items():
        raise PiperPlanError(f"piper: unmatched send: rank {src} sends {msg} to rank {dst} ({c}x) but rank {dst} "
                             "never receives it; every SEND needs a RECV on its peer (check place/order directives)")
    for (src, dst, msg), c in (recvs - sends).items():
        raise PiperPlanError(f"piper: unmatched receive: rank {dst} waits for {msg} from rank {src} ({c}x) but rank "
                             f"{src} never sends it")


def format_grid(programs: list[Program], pcs: list[int], stuck: dict[int, str]) -> str:
    """Rank x step grid around the stuck positions; ``>X<`` marks each rank's stuck instruction."""
    lo = max(0, min(pcs) - 3)
    hi = min(max(len(p.instrs) for p in programs), max(pcs) + 4)
    col = max(12, max((len(i.short()) for p in programs for i in p.instrs[lo:hi]), default=12) + 4)
    head = "rank | " + "".join(f"{s:<{col}}" for s in range(lo, hi))
    lines = [head, "-" * len(head)]
    for p, pc in zip(programs, pcs):
        cells = []
        for s in range(lo, hi):
            if s >= len(p.instrs):
                cells.append(f"{'':<{col}}")
                continue
            label = p.instrs[s].short()
            if s == pc and p.rank in stuck:
                label = f">{label}<"
            cells.append(f"{label:<{col}}")
        lines.append(f"{p.rank:>4} | " + "".join(cells))
    lines += [f"rank {r}: {why}" for r, why in sorted(stuck.items())]
    return "\n".join(lines)


def verify_programs(programs: Sequence[Program]) -> VerifyResult:
    """Raise ``PiperPlanError`` on an unmatched P2P, mis-ordered collectives, a deadlock, or a recorded
    reordering (overlap partner, filler) the runtime could not make safely (``plan/reorder.py``). A plan's
    ``Programs`` are verified on their quotient, one representative per class of ranks with the same
    program (``plan/symmetry.py``), where that is exact; a plain list rank by rank."""
    quotient = programs.quotient() if isinstance(programs, Programs) else None
    if quotient is not None:
        return verify_folded(quotient, programs.symmetry.rep_of)  # type: ignore[attr-defined]
    return verify_folded(list(programs), None)


def verify_folded(programs: list[Program], rep_of: Sequence[int] | None) -> VerifyResult:
    """``verify_programs`` on ``programs`` as they are (``rep_of`` None) or on a quotient: the programs of
    the representatives, peers mapped by ``rep_of`` (rank -> representative)."""
    _check_matching(programs)
    for p in programs:
        check_reorders(p)
    ranks = [p.rank for p in programs]
    pcs = [0] * len(programs)
    done: list[set[str]] = [set() for _ in programs]
    queues: dict[tuple[int, str, int], deque[Instr]] = {}  # (rank, group name, peer or -1)
    keys: dict[tuple[Any, int], Any] = {}  # a collective's member queues in a quotient (``member_keys``)
    rounds = 0
    while True:
        rounds += 1
        moved = False
        for k, p in enumerate(programs):
            while pcs[k] < len(p.instrs):
                ins = p.instrs[pcs[k]]
                if not all(w in done[k] for w in ins.waits):
                    break
                if ins.is_async:
                    queues.setdefault(ins.queue(p.rank), deque()).append(ins)
                else:
                    done[k].add(ins.name)
                pcs[k] += 1
                moved = True
        moved |= _complete_heads(programs, ranks, queues, done, (rep_of, keys))
        if all(pc == len(p.instrs) for pc, p in zip(pcs, programs)) and not any(queues.values()):
            return VerifyResult(rounds)
        if not moved:
            _deadlock(programs, pcs, queues, done)


def _complete_heads(programs: list[Program], ranks: list[int], queues: dict[tuple[int, str, int], deque[Instr]],
                    done: list[set[str]], quotient: tuple[Sequence[int] | None, dict]) -> bool:
    idx = {r: k for k, r in enumerate(ranks)}
    moved = False
    for (rank, group, _), q in list(queues.items()):
        if not q:
            continue
        head = q[0]
        kind = head.node.kind
        if kind in (Kind.SEND, Kind.RECV):
            pq = queues.get((head.peer, group, rank))
            want = Kind.RECV if kind is Kind.SEND else Kind.SEND
            if pq and pq[0].node.kind is want and pq[0].node.op.msg == head.node.op.msg:  # type: ignore[attr-defined]
                q.popleft()
                other = pq.popleft()
                done[idx[rank]].add(head.name)
                done[idx[head.peer]].add(other.name)
                moved = True
        else:
            # its own subgroup under tensor parallelism (same stream and members: same group)
            mkeys = member_keys(head, rank, group, *quotient)
            members = [k[0] for k in mkeys]
            heads = [queues.get(k) for k in mkeys]
            if all(h and h[0].name == head.name for h in heads):
                for m, h in zip(members, heads):
                    h.popleft()  # type: ignore[union-attr]
                    done[idx[m]].add(head.name)
                moved = True
            else:
                others = [(m, h[0].name) for m, h in zip(members, heads) if h and h[0].node.kind.is_collective
                          and h[0].name != head.name]
                if others:
                    m, name = others[0]
                    raise PiperPlanError(
                        f"piper: collectives issued in different orders on stream {head.node.stream!r} (group "
                        f"{list(members)}): rank {rank} issues "
                        f"{head.name} while rank {m} issues {name} at the same position; every member of a group "
                        "must issue its collectives in the same order\n"
                        + format_grid(programs, [0] * len(programs), {}))
    return moved


def _deadlock(programs: list[Program], pcs: list[int], queues: dict[tuple[int, str, int], deque[Instr]],
              done: list[set[str]]) -> None:
    stuck: dict[int, str] = {}
    marks = list(pcs)
    for k, p in enumerate(programs):
        if pcs[k] < len(p.instrs):
            ins = p.instrs[pcs[k]]
            missing = [w for w in ins.waits if w not in done[k]]
            stuck[p.rank] = f"{ins.short()} waits for {', '.join(missing)}"
        else:
            pending = [q[0] for (r, _, _), q in queues.items() if r == p.rank and q]
            if pending:
                stuck[p.rank] = f"finished issuing; {pending[0].short()} never matched (stream {pending[0].node.stream})"
                marks[k] = next(i for i, x in enumerate(p.instrs) if x.name == pending[0].name)
                pcs[k] = marks[k]
    raise PiperPlanError("piper: the per-rank programs deadlock (no rank can make progress):\n"
                         + format_grid(programs, marks, stuck)
                         + "\nFix: reorder the schedule (order directives) so that each receive's send comes first "
                         "on the peer, or put the two directions on different streams.")
