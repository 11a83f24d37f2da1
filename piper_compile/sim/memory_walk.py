"""One rank's memory over a simulated step (``sim/simulate``'s memory figures): values live after each
step in the order the executor runs them, ZeRO-3 gathered parameters, gradient buffers over the program,
what a segment holds while it runs and storage views share (``sim/segment_memory``)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from piper_compile.codegen.accumulate import fused_values
from piper_compile.ir.dag import Kind
from piper_compile.ir.ops import GradReduce, ParamGather
from piper_compile.ir.ops import Segment as SegmentOp
from piper_compile.plan.program import Instr, Program
from piper_compile.plan.reorder import still_read
from piper_compile.sim.segment_memory import SharedStorage, root_value
from piper_compile.sim.shapes import Sizes
from piper_compile.sim.trace import Span

TEMP = "while written:"  # a live-at-peak entry for a fused gradient held while its step runs
INSIDE = "inside:"  # a live-at-peak entry for what a segment holds only while it runs


@dataclass
class _MemoryWalk:
    """One rank's activation memory over a step: peak, the (time, live bytes) series, the ZeRO-3 gathered
    peak, the position of the step at the activation peak and the values live there, largest first."""

    peak: int = 0
    series: list[tuple[float, int]] = field(default_factory=list)
    peak_gathered: int = 0
    peak_held: int = 0  # activations, gathered parameters and gradient buffers held at once
    peak_pos: int = -1
    at_peak: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class _Sending:
    """Values only an in-flight SEND still holds, with when their transfer starts (``memory_walk``)."""

    items: list[tuple[float, str]] = field(default_factory=list)

    def retire(self, now: float, drop: Callable[[list[str]], None]) -> None:
        """``drop`` what started moving before ``now`` (not at the step starting then: the executor sees
        the send complete only after it)."""
        gone = [it for it in self.items if it[0] < now]
        for it in gone:
            self.items.remove(it)
        drop([v for _, v in gone])


class _Held:
    """What one rank's memory walk holds: live values and gathered parameters with their bytes, the
    running totals, and the walk's peak so far (``memory_walk``)."""

    def __init__(self, sizes: Sizes, fused: frozenset[str], grads_at: Sequence[int] = ()) -> None:
        self.sizes, self.fused = sizes, fused  # fused: gradients segments write into the buffers themselves
        self.grads_at = grads_at  # gradient bytes held at each program position (grad_series)
        self.live: dict[str, int] = {}
        self.gathered: dict[str, int] = {}
        self.total = [0, 0]  # live, gathered
        self.out = _MemoryWalk()
        self.at_peak: dict[str, int] = {}
        self.storage = SharedStorage()

    def alloc(self, ins: Instr, pos: int, early_step: bool = False) -> None:
        """The step's outputs (the op's memory rule), then the peak sample: after each step in program
        order, and where a step ran ahead held a temporary (as the executor samples)."""
        temp = ("", 0)  # the largest gradient it writes into its buffer: held only while it runs
        n = ins.node
        amap = self.sizes.aliases.get(n.op.segment, {}) if isinstance(n.op, SegmentOp) else {}
        for k, (v, b, is_param) in enumerate(n.op.allocates(n, self.sizes)):
            if v in self.fused:
                temp = max(temp, (f"{TEMP}{v}", b), key=lambda t: t[1])
                b = 0
            elif isinstance(n.op, SegmentOp):  # a view of a live value counts none (sim/segment_memory)
                root = root_value(amap, k, n.inputs, n.outputs)
                b = self.storage.add(v, b, root)
            held = self.gathered if is_param else self.live
            self.total[is_param] += b - held.get(v, 0)
            held[v] = b
        inside = n.op.transient(n, self.sizes, self.fused)  # what it holds while it runs (the op's rule)
        if inside > temp[1]:
            temp = (f"{INSIDE}{getattr(n.op, 'segment', n.name)}", inside)
        if temp[1] or not early_step:
            self._sample(pos, temp)

    def _sample(self, pos: int, temp: tuple[str, int]) -> None:
        grads = self.grads_at[pos] if 0 <= pos < len(self.grads_at) else 0
        self.out.peak_held = max(self.out.peak_held, self.total[0] + temp[1] + self.total[1] + grads)
        if self.total[0] + temp[1] > self.out.peak:
            self.out.peak, self.out.peak_pos, self.at_peak = self.total[0] + temp[1], pos, dict(self.live)
            if temp[1]:
                self.at_peak[temp[0]] = temp[1]

    def drop(self, values: Any) -> None:
        """Free ``values``: gathered parameters (``param:``) or live values (a storage a view still holds
        stays counted, under that view's name)."""
        for v in values:
            if v.startswith("param:"):
                self.total[1] -= self.gathered.pop(v, 0)
                continue
            shared = self.storage.remove(v)
            b = self.live.pop(v, 0)
            if shared is None:
                self.total[0] -= b
                continue
            self.total[0] -= shared[0]
            if shared[1] is not None:
                self.live[shared[1]] = self.live.get(shared[1], 0) + b


def memory_walk(program: Program, sizes: Sizes, spans: dict[tuple[int, int], Span],
            early: set[int] | frozenset[int] = frozenset(),
            began: dict[tuple[int, int], float] | None = None, grads_at: Sequence[int] = ()) -> _MemoryWalk:
    """Walk one rank's steps in the order the executor runs them (on the host, as ``Executor._run_early``):
    a step the simulation ran ahead (``early``: an overlap partner or filler, run while an earlier step
    waited) allocates before the step it ran during and frees at once what it frees, except values a step
    it jumped still reads (those at its own position); the peak is sampled after each step in program
    order, before its frees. A value freed at the SEND that sends it stays live until the transfer starts
    (``began``: the peer posted its receive) and through the step the host runs next (the executor counts
    it until it sees the send complete, before an instruction: ``Step.free``); the transfer itself counts
    as instant. ``grads_at``: gradient bytes held at each position, for the peak of everything together."""
    h, sending = _Held(sizes, fused_values(program), grads_at), _Sending()
    out = h.out

    def free(ins: Instr, pos: int) -> None:
        sent = began.get((program.rank, pos)) if began is not None and ins.node.kind is Kind.SEND else None
        for v in ins.frees:
            if sent is not None and v in ins.node.inputs:
                sending.items.append((sent, v))
            else:
                h.drop([v])

    ahead = sorted(early)  # not run yet, in program order
    early_done: set[int] = set()
    for pos, ins in enumerate(program.instrs):
        span = spans.get((program.rank, pos))
        if pos in early:  # allocated when it ran (below, before the step it ran during)
            free(ins, pos)
            continue
        start = span.start if span is not None else float("inf")
        sending.retire(start, h.drop)
        for k in [k for k in ahead if k > pos and (program.rank, k) in spans and spans[(program.rank, k)].start <= start]:
            h.alloc(program.instrs[k], pos, early_step=True)
            ahead.remove(k)
            keep = still_read(program, pos, k, early_done)  # the executor frees the rest at once
            early_done.add(k)
            h.drop(v for v in program.instrs[k].frees if v not in keep)
        h.drop([f"held:{w}" for w in ins.waits])  # a buffer held until waited for
        h.alloc(ins, pos)
        out.peak_gathered = max(out.peak_gathered, h.total[1])
        if span is not None:
            out.series.append((span.start, h.total[0]))
        free(ins, pos)
        if span is not None:
            out.series.append((span.host_end, h.total[0]))
    out.at_peak = sorted(h.at_peak.items(), key=lambda kv: -kv[1])
    return out


def shard_bytes(nbytes: int, fqns: Any, sizes: Sizes, world: int) -> int:
    """Bytes of one rank's shard of a bucket padded to a multiple of ``world`` elements."""
    numel = sum(sizes.params_numel.get(f, 0) for f in fqns)
    elem = nbytes // numel if numel else 0
    return -(-numel // world) * elem


def grad_series(program: Program, sizes: Sizes, persistent: int) -> list[int]:
    """Gradient bytes held at each instruction of ``program`` (the most while it runs): the persistent
    buffers plus each reduce-scattered (ZeRO-2/3) bucket from its first gradient to its reduce-scatter,
    and its shard from then to the update."""
    rs = {f: i.node.op.bucket for i in program.instrs if isinstance(i.node.op, GradReduce) and i.node.op.scatter
          for f in i.node.op.params}
    zero = zero_buckets(program)
    live: set[str] = set()
    shards: set[str] = set()
    total = persistent
    series: list[int] = []
    for ins in program.instrs:
        n = ins.node
        held = None
        if n.kind is Kind.COMPUTE:
            for _, f in n.op.grad_outputs():
                b = rs.get(f)
                if b is not None and b not in live:
                    live.add(b)
                    fqns, w, _ = zero[b]
                    total += shard_bytes(sizes.params_bytes(fqns), fqns, sizes, w) * w
        elif isinstance(n.op, GradReduce) and n.op.scatter and n.op.bucket in live:
            fqns, w, _ = zero[n.op.bucket]
            shard = shard_bytes(sizes.params_bytes(fqns), fqns, sizes, w)
            held = total + shard  # the shard is written while the full bucket is still held
            live.discard(n.op.bucket)
            total += shard - shard * w
            if n.op.bucket in shards:  # per micro-batch: folded into the shard already held
                total -= shard
            shards.add(n.op.bucket)
        series.append(max(total, held or 0))
    return series


def zero_buckets(program: Program) -> dict[str, tuple[tuple[str, ...], int, int]]:
    """bucket -> (fqns, group size, ZeRO level) of the shard buckets in ``program``."""
    return {i.node.op.bucket: (tuple(i.node.op.params), len(i.node.devices), i.node.op.level)
            for i in program.instrs if isinstance(i.node.op, ParamGather) and i.node.op.level}
