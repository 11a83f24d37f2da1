"""Discrete-event simulation of every rank's program, with the verifier's execution model plus time.

Model (``plan/verifier.py``): each rank's host thread issues its instructions in order, and before
each one waits until the asynchronous instructions in its ``waits`` have completed. COMPUTE and
UPDATE occupy the host (and compute stream) for their cost. Communication is queued FIFO: a
collective on the queue of its stream and member group, a SEND/RECV on the queue of its process
group (``Instr.group_name``) and peer. A SEND and its RECV start together once both are at the head
of their queues (rendezvous) and the previous transfer of each queue has finished; a collective
starts once it heads the queue of every member. Both then take their cost. The events are each
instruction's issue and each queue's completion; every time is the latest of the events it depends
on, so the result does not depend on the order in which ready events are handled.

Where a program records reorderings (``plan/reorder.py``), the host makes them as the executor does where
waits block it (gloo): at a compute step whose input completes after the host is free, its overlap
partner runs first if the communication it needs has completed by then, then its fillers, nearest
first, one at a time, each only if its communication has completed by the time it would start, while
the input is still late; a step run early is skipped at its own position. (On CUDA the partner runs on a
second stream instead; the simulation does not model that.) A filler's need whose completion is not
simulated yet defers the decision until it is, or, if nothing else can move, counts as incomplete for
the rank whose host is earliest (its completion then depends on a rank's later work).

A rank's step ends when its host has issued everything and all its asynchronous work completed
(the executor waits for it), plus the cost model's epilogue; the step time is the latest rank's end.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from piper_compile.errors import PiperPlanError
from piper_compile.ir.dag import Kind, TrainingDAG, param_fqn
from piper_compile.ir.ops import QueueKey
from piper_compile.plan.program import Instr, Program
from piper_compile.plan.reorder import needs
from piper_compile.plan.symmetry import Programs, member_keys
from piper_compile.plan.verifier import verify_folded
from piper_compile.sim.cost import CostModel
from piper_compile.sim.memory_walk import grad_series, memory_walk, shard_bytes, zero_buckets
from piper_compile.sim.shapes import Sizes
from piper_compile.sim.trace import STEP_KIND, STEP_STREAM, Span, span_of




@dataclass
class SimResult:
    """Predicted timing and memory of one training step.

    - ``step_time``: the latest rank's end (all ranks start at 0).
    - ``busy[r]``: time rank r spends in COMPUTE and UPDATE instructions.
    - ``bubble``: ``(step_time * R - sum(busy)) / (step_time * R)`` over the R simulated ranks -- the
      fraction of rank-time the compute stream is idle (waiting for data, communication or the
      pipeline to fill and drain). GPipe and 1F1B with equal per-stage costs and free communication
      give ``(p - 1) / (m + p - 1)``.
    - ``peak_activation_bytes[r]``: the most bytes of values live at once on rank r: compute outputs
      and RECV buffers, allocated when produced and dropped after the instruction that frees them
      (sizes from the segments' output shapes, the batch symbol at the micro-batch size).
    - ``param_bytes[r]`` / ``grad_bytes[r]``: parameters rank r keeps between steps and gradients it
      holds, counted separately. Under ZeRO a sharded bucket counts its shard only (parameters for
      ZeRO-3, gradients for ZeRO-2/3; padded to the group size); ZeRO-1/2 parameters are whole.
    - ``peak_gathered_bytes[r]``: ZeRO-3: the most bytes of all-gathered parameters live at once.
    ``peak_bytes[r]`` is the sum of the four.
    """

    step_time: float
    ranks: list[int]
    busy: dict[int, float]
    rank_end: dict[int, float]
    spans: list[Span]
    peak_activation_bytes: dict[int, int]
    param_bytes: dict[int, int]
    grad_bytes: dict[int, int]
    memory_timeline: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    peak_gathered_bytes: dict[int, int] = field(default_factory=dict)
    peak_grad_bytes: dict[int, int] = field(default_factory=dict)
    peak_activation_pos: dict[int, int] = field(default_factory=dict)  # program position of the activation peak
    live_at_peak: dict[int, list[tuple[str, int]]] = field(default_factory=dict)  # (value, bytes), largest first
    # a quotient simulation: representative -> the ranks it stands for (empty: every rank was simulated)
    classes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # the most bytes of activations, gathered parameters and gradient buffers held at once
    peak_held_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        total = self.step_time * len(self.ranks)
        return (total - sum(self.busy.values())) / total if total > 0 else 0.0

    @property
    def peak_bytes(self) -> dict[int, int]:
        return {r: self.peak_activation_bytes[r] + self.param_bytes[r] + self.grad_bytes[r]
                + self.peak_gathered_bytes.get(r, 0) for r in self.ranks}

    def summary(self) -> str:
        """One line per rank: busy time, idle fraction and peak memory."""
        lines = [f"step {self.step_time:.6g}  bubble {self.bubble:.1%}"]
        for r in self.ranks:
            idle = 1 - self.busy[r] / self.step_time if self.step_time else 0.0
            mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
            lines.append(f"  rank {r}: busy {self.busy[r]:.6g}  idle {idle:.1%}  peak activations "
                         f"{mib(self.peak_activation_bytes[r])}  params {mib(self.param_bytes[r])}  grads "
                         f"{mib(self.grad_bytes[r])}")
        return "\n".join(lines)


@dataclass
class _Issued:
    ins: Instr
    rank: int
    pos: int
    start: float  # host issue start
    ready: float  # host issue end: the op can start from here
    wait_s: float  # host time blocked on waits before issuing


class _Sim:
    def __init__(self, programs: list[Program], cost: CostModel, rep_of: Sequence[int] | None = None) -> None:
        self.programs = programs
        self.cost = cost
        self.rep_of = rep_of  # a quotient (``plan/symmetry.py``): rank -> its class's representative
        self.member_queues: dict[tuple[Any, int], Any] = {}  # ``member_keys``'s cache
        self.ranks = [p.rank for p in programs]
        self.host = {p.rank: cost.prologue(p.rank) for p in programs}
        self.pcs = {p.rank: 0 for p in programs}
        self.done: dict[int, dict[str, float]] = {r: {} for r in self.ranks}
        self.queues: dict[QueueKey, deque[_Issued]] = defaultdict(deque)
        self.free_at: dict[QueueKey, float] = defaultdict(float)
        self.spans: list[Span] = []
        self.busy = {r: 0.0 for r in self.ranks}
        # Worklists: only ranks and queues whose state changed are looked at again (large worlds).
        self.by_rank = {p.rank: p for p in programs}
        self.dirty_ranks: set[int] = set(self.ranks)
        self.dirty_queues: set[QueueKey] = set()
        self.remaining = sum(len(p.instrs) for p in programs)  # host issues + queue completions left
        self.queued = 0
        # recorded reorderings: per rank the steps run early, what each compute step needs, positions
        self.early: dict[int, set[int]] = {r: set() for r in self.ranks}
        self.need = {p.rank: needs(p) for p in programs if any(i.partner or i.fillers for i in p.instrs)}
        self.at = {r: self.by_rank[r].positions() for r in self.need}
        self.began: dict[tuple[int, int], float] = {}  # (rank, position) -> when its communication started
        self.deferred: dict[int, float] = {}  # rank -> host time of a reordering decision it waits to make
        self.force: int | None = None  # the deferred rank that decides with unknown needs as incomplete

    def issue_ready(self) -> bool:
        """Advance every host thread whose state changed as far as its waits allow."""
        moved = False
        ranks, self.dirty_ranks = sorted(self.dirty_ranks), set()
        for r in ranks:
            p = self.by_rank[r]
            while self.pcs[r] < len(p.instrs):
                ins = p.instrs[self.pcs[r]]
                if self.pcs[r] in self.early[r]:  # ran ahead of an earlier step
                    self.pcs[r] += 1
                    continue
                if not all(w in self.done[r] for w in ins.waits):
                    break
                free = self.host[r] + self.cost.gap(r)
                if ins.partner or ins.fillers:
                    late = self._run_early(r, p, free, max([free] + [self.done[r][w] for w in ins.waits]))
                    if late is None:
                        break
                    free = late
                t = max([free] + [self.done[r][w] for w in ins.waits])
                if ins.is_async:
                    end = t + self.cost.issue(ins, r)
                    key = ins.queue(r)  # the verifier's queues (the op's rule)
                    self.queues[key].append(_Issued(ins, r, self.pcs[r], t, end, t - free))
                    self.dirty_queues.add(key)
                    self.queued += 1
                else:
                    end = t + self.cost.duration(ins, r)
                    self.spans.append(span_of(ins, r, self.pcs[r], t, end, wait_s=t - free))
                    self.done[r][ins.name] = end
                    self.busy[r] += end - t
                self.host[r] = end
                self.pcs[r] += 1
                moved = True
        return moved

    def _complete(self, r: int, k: int, t: float) -> bool | None:
        """Whether the communication step ``k`` of rank ``r`` needs has completed by ``t`` (None: unknown)."""
        times = [self.done[r].get(w) for w in self.need[r][k]]
        if any(x is None for x in times):
            return False if self.force == r else None
        return all(x <= t for x in times)  # type: ignore[operator]

    def _first_complete(self, r: int, ks: list[tuple[int, tuple[int, ...]]], taken: set[int],
                        t: float) -> tuple[bool, int | None]:
        """(decided, the first of ``ks`` not taken, whose recorded predecessors have run early and whose
        communication has completed by ``t``)."""
        for k, after in ks:
            if k not in taken and all(a in taken for a in after):
                ok = self._complete(r, k, t)
                if ok is None:
                    return False, None
                if ok:
                    return True, k
        return True, None

    def _pick_early(self, r: int, p: Program, cur: float, ready: float) -> list[int] | None:
        """The steps rank ``r`` runs ahead of its current compute step, whose input completes at ``ready``,
        with its host free at ``cur``: the partner, then fillers nearest first while the input is late
        (the executor's rule); None: undecided (a need's completion is not simulated yet)."""
        ins, at, taken = p.instrs[self.pcs[r]], self.at[r], set(self.early[r])
        out: list[int] = []
        if ins.partner and cur < ready:  # the partner: once, if its communication is complete
            decided, k = self._first_complete(r, [(at[ins.partner], ())], taken, cur)
            if not decided:
                return None
            if k is not None:
                out.append(k)
                taken.add(k)
                cur += self.cost.duration(p.instrs[k], r)
        fillers = [(at[f], tuple(at[a] for a in after)) for f, after in ins.fillers]
        while cur < ready:  # then fillers, nearest first, re-checked at each new time
            decided, k = self._first_complete(r, fillers, taken, cur)
            if not decided:
                return None
            if k is None:
                break
            out.append(k)
            taken.add(k)
            cur += self.cost.duration(p.instrs[k], r)
        return out

    def _run_early(self, r: int, p: Program, cur: float, ready: float) -> float | None:
        """Run the steps ``_pick_early`` chooses (spans, completion times); the host's new free time, or
        None when the decision has to wait (the rank is then deferred)."""
        picks = self._pick_early(r, p, cur, ready)
        if picks is None:
            self.deferred[r] = cur
            return None
        self.deferred.pop(r, None)
        if self.force == r:
            self.force = None
        for k in picks:
            ins = p.instrs[k]
            end = cur + self.cost.duration(ins, r)
            self.spans.append(span_of(ins, r, k, cur, end, wait_s=0.0))
            self.done[r][ins.name] = end
            self.busy[r] += end - cur
            self.early[r].add(k)
            cur = end
        return cur

    def _finish(self, items: list[tuple[QueueKey, _Issued]], duration: float) -> None:
        start = max(max(it.ready, self.free_at[k]) for k, it in items)
        end = start + duration
        for k, it in items:
            self.queues[k].popleft()
            self.queued -= 1
            self.dirty_queues.add(k)  # its next head may now match
            self.dirty_ranks.add(it.rank)  # a host waiting on this may move
            self.free_at[k] = end
            self.done[it.rank][it.ins.name] = end
            self.began[(it.rank, it.pos)] = start
            self.spans.append(span_of(it.ins, it.rank, it.pos, it.start, end, issue_end=it.ready, wait_s=it.wait_s))

    def complete_heads(self) -> bool:
        """Start and finish every queue head whose partners are at the head of theirs."""
        moved = False
        keys, self.dirty_queues = sorted(self.dirty_queues), set()
        for key in keys:
            q = self.queues.get(key)
            if not q:
                continue
            head = q[0]
            rank, group, _ = key
            if head.ins.peer is not None:
                pkey = (head.ins.peer, group, rank)
                pq = self.queues.get(pkey)
                if not pq or pq[0].ins.node.op.msg != head.ins.node.op.msg or \
                        pq[0].ins.node.kind is head.ins.node.kind:
                    continue
                d = max(self.cost.duration(head.ins, rank), self.cost.duration(pq[0].ins, head.ins.peer))
                self._finish([(key, head), (pkey, pq[0])], d)
            else:
                keys = member_keys(head.ins, rank, group, self.rep_of, self.member_queues)
                heads = [self.queues.get(k) for k in keys]
                if not all(h and h[0].ins.name == head.ins.name for h in heads):
                    continue
                items = [(k, h[0]) for k, h in zip(keys, heads) if h]
                self._finish(items, max(self.cost.duration(it.ins, it.rank) for _, it in items))
            moved = True
        return moved

    def finished(self) -> bool:
        return self.queued == 0 and all(self.pcs[p.rank] == len(p.instrs) for p in self.programs)

    def run(self) -> None:
        while not self.finished():
            moved = self.issue_ready()
            moved |= self.complete_heads()
            if not moved and self.deferred and self.force is None:
                # nothing moves: the earliest deferred host decides; what it waits on comes after it
                self.force = min(self.deferred, key=lambda rank: (self.deferred[rank], rank))
                self.dirty_ranks.add(self.force)
                continue
            if not moved:
                verify_folded(self.programs, self.rep_of)  # raises with the rank x step grid
                raise PiperPlanError("piper: internal: the simulation stalled on programs the verifier accepts")


def copy_bytes(program: Program, sizes: Sizes) -> int:
    """Mixed precision: bytes of the compute copies rank ``program.rank`` keeps between steps (of the
    parameters its compute steps read directly; ZeRO-3 parameters are gathered as copies, per use)."""
    if not sizes.as_factor:
        return 0
    gathered = {f for fqns, _, level in zero_buckets(program).values() if level >= 3 for f in fqns}
    return sizes.params_bytes(sorted(read_and_written(program)[0] - gathered), "compute")


def trained_tensors(program: Program, sizes: Sizes) -> list[int]:
    """Bytes of each tensor the rank's optimizer updates: its shard of each ZeRO bucket (one flat tensor),
    each other parameter whole."""
    upd = program.update_node()
    if upd is None:
        return []
    zero = zero_buckets(program)
    sharded = {f for fqns, _, _ in zero.values() for f in fqns}
    out = [sizes.params_bytes([f]) for f in upd.op.params if f not in sharded]  # type: ignore[attr-defined]
    return out + [shard_bytes(sizes.params_bytes(fqns), fqns, sizes, w) for fqns, w, _ in zero.values()]


def trained_bytes(program: Program, sizes: Sizes) -> int:
    """Bytes of what the rank's optimizer updates: its shards of ZeRO buckets, whole other parameters."""
    return sum(trained_tensors(program, sizes))


def read_and_written(program: Program) -> tuple[set[str], set[str]]:
    """Parameters the rank's compute steps read, and those whose gradients it writes or receives."""
    params: set[str] = set()
    grads: set[str] = set()
    for ins in program.instrs:
        n = ins.node
        if n.kind is Kind.COMPUTE:
            params.update(f for f in map(param_fqn, n.inputs) if f is not None)
            grads.update(f for _, f in n.op.grad_outputs())
        elif n.kind in (Kind.SEND, Kind.RECV) and n.op.state:  # type: ignore[attr-defined]
            grads.add(n.op.state)  # type: ignore[attr-defined]
    return params, grads


def state_bytes(program: Program, sizes: Sizes) -> tuple[int, int]:
    """(parameter, gradient) bytes rank ``program.rank`` keeps, ZeRO shards counted as shards."""
    params, grads = read_and_written(program)
    upd = program.update_node()
    grads.update(upd.op.params if upd is not None else ())  # type: ignore[attr-defined]
    zero = zero_buckets(program)
    p_bytes = sizes.params_bytes(params)
    g_bytes = sizes.params_bytes(grads)
    for fqns, world, level in zero.values():
        full = sizes.params_bytes(fqns)
        shard = shard_bytes(full, fqns, sizes, world)
        if level >= 3:
            p_bytes += shard - full
        if level >= 2:
            g_bytes -= full  # reduce-scattered shards live from the reduce-scatter to the update only
        else:
            g_bytes += shard * world - full  # the all-reduced buffer is padded too
    return p_bytes, g_bytes


def simulate(programs: Sequence[Program], cost: CostModel, dag: TrainingDAG | None = None) -> SimResult:
    """Simulate one step of ``programs`` (every rank's, from one plan) under ``cost``. ``dag`` (the
    plan's DAG) supplies tensor sizes for memory and ``FlopCost``; without it memory reads 0.
    A plan's ``Programs`` under a symmetric cost model simulate one representative per class of ranks
    with the same program (``plan/symmetry.py``); every rank gets its class's figures, ``spans`` are
    the representatives' and ``classes`` says who stands for whom.
    Raises ``PiperPlanError`` (with the verifier's grid) if the programs deadlock."""
    cost.bind(dag)
    folded = programs.quotient() if isinstance(programs, Programs) and cost.symmetric else None
    if folded is not None:
        sym = programs.symmetry  # type: ignore[attr-defined]
        return _expand(_simulate(folded, cost, dag, sym.rep_of), sym.classes)
    return _simulate(list(programs), cost, dag, None)


def _expand(res: SimResult, classes: dict[int, tuple[int, ...]]) -> SimResult:
    """Every rank's figures from its class representative's (a quotient simulation)."""
    def spread(d: dict[int, Any]) -> dict[int, Any]:
        return {r: d[rep] for rep, rs in classes.items() if rep in d for r in rs}

    return dataclasses.replace(
        res, ranks=sorted(r for rs in classes.values() for r in rs), busy=spread(res.busy),
        rank_end=spread(res.rank_end), peak_activation_bytes=spread(res.peak_activation_bytes),
        param_bytes=spread(res.param_bytes), grad_bytes=spread(res.grad_bytes),
        memory_timeline=spread(res.memory_timeline), peak_gathered_bytes=spread(res.peak_gathered_bytes),
        peak_grad_bytes=spread(res.peak_grad_bytes), peak_activation_pos=spread(res.peak_activation_pos),
        live_at_peak=spread(res.live_at_peak), peak_held_bytes=spread(res.peak_held_bytes), classes=classes)


def _simulate(programs: list[Program], cost: CostModel, dag: TrainingDAG | None,
              rep_of: Sequence[int] | None) -> SimResult:
    sim = _Sim(programs, cost, rep_of)
    sim.run()
    rank_end = {}
    for r in sim.ranks:
        last = max([sim.host[r]] + list(sim.done[r].values()))
        rank_end[r] = last + cost.epilogue(r)
    sizes = Sizes.from_dag(dag)
    by_pos = {(s.rank, s.pos): s for s in sim.spans}
    peaks, timeline, params, grads, gathered, grad_peak, walks = {}, {}, {}, {}, {}, {}, {}
    for p in programs:
        params[p.rank], grads[p.rank] = state_bytes(p, sizes)
        series = grad_series(p, sizes, grads[p.rank])
        grad_peak[p.rank] = max(series, default=grads[p.rank])
        walks[p.rank] = w = memory_walk(p, sizes, by_pos, sim.early.get(p.rank, set()), sim.began, series)
        peaks[p.rank], timeline[p.rank], gathered[p.rank] = w.peak, w.series, w.peak_gathered
    sim.spans += [Span(r, STEP_STREAM, "step", "step", STEP_KIND, 0.0, rank_end[r]) for r in sim.ranks]
    sim.spans.sort(key=lambda s: (s.rank, s.start, s.pos))
    return SimResult(max(rank_end.values(), default=0.0), sim.ranks, sim.busy, rank_end, sim.spans, peaks, params,
                     grads, timeline, gathered, grad_peak, {r: w.peak_pos for r, w in walks.items()},
                     {r: w.at_peak for r, w in walks.items()}, peak_held_bytes={r: w.peak_held for r, w in walks.items()})


def simulate_plan(plan: Any, cost: CostModel | None = None) -> SimResult:
    """Simulate a plan (``piper.plan(...)``'s ``StaticPlan``, or anything with ``programs`` and
    ``dag``) under ``cost`` (default ``FlopCost()``)."""
    from piper_compile.sim.cost import FlopCost

    return simulate(plan.programs, cost if cost is not None else FlopCost(), getattr(plan, "dag", None))
