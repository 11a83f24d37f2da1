"""Cost models: how long each instruction takes, for the simulator.

A model answers ``duration(ins, rank)`` -- compute time of a COMPUTE/UPDATE, transfer time of a
SEND/RECV pair or a collective once every side has issued it -- plus host-side overheads (time to
issue an async op, the gap between instructions, per-step prologue/epilogue), 0 unless measured.

- ``UniformCost``: one number per pass kind, for analytic tests.
- ``FlopCost``: FLOPs of each segment's matmuls/attention (from ``node.meta["val"]`` shapes, the
  batch symbol at the micro-batch size) over ``flops_per_s``, bytes over ``bytes_per_s``.
- ``MeasuredCost.from_trace``: per-segment durations and overheads measured in a real run's trace.
"""
from __future__ import annotations

import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import fx

from piper_compile.errors import PiperError
from piper_compile.ir.dag import Kind, TrainingDAG
from piper_compile.plan.program import Instr
from piper_compile.sim.shapes import Sizes, concrete
from piper_compile.sim.trace import STEP_KIND, Span, read_spans


class CostModel:
    """Base cost model. Each op decides which primitive prices it and with what (``Op.duration``):
    ``compute_time`` of a segment, ``p2p_time`` of a message, ``collective_time`` of ``nbytes`` over
    ``members`` ranks, ``update_time`` of ``nbytes`` of parameters; subclasses implement those.
    Overheads default to 0."""

    # SYMMETRIC: every rank of a symmetry class (``plan/symmetry.py``) costs the same, so the simulator may
    # run one representative per class. Each class says so itself: a subclass that does not repeat it (it
    # may price ranks differently) has every rank simulated.
    SYMMETRIC: ClassVar[bool] = False

    @property
    def symmetric(self) -> bool:
        return bool(type(self).__dict__.get("SYMMETRIC", False))

    def bind(self, dag: TrainingDAG | None) -> None:
        """Called by the simulator with the plan's DAG before any query."""

    def duration(self, ins: Instr, rank: int) -> float:
        return ins.node.op.duration(self, ins, rank)

    def compute_time(self, ins: Instr, rank: int, segment: str) -> float:
        raise NotImplementedError

    def p2p_time(self, ins: Instr, rank: int, msg: str) -> float:
        raise NotImplementedError

    def collective_time(self, ins: Instr, rank: int, algo: str, members: int, nbytes: int) -> float:
        raise NotImplementedError

    def update_time(self, ins: Instr, rank: int, nbytes: int) -> float:
        raise NotImplementedError

    def params_bytes(self, fqns: Iterable[str], as_: str = "master") -> int:
        """Bytes of these parameters on one rank (0 for models that do not count bytes); ``as_``: see
        ``Sizes.params_bytes``."""
        return 0

    def tensor_bytes(self, shape: Any, dtype: str) -> int:
        return 0

    def issue(self, ins: Instr, rank: int) -> float:
        """Host time to issue an asynchronous instruction."""
        return 0.0

    def gap(self, rank: int) -> float:
        """Host time between two instructions (loop and bookkeeping overhead)."""
        return 0.0

    def prologue(self, rank: int) -> float:
        """Host time from the start of the step to its first instruction."""
        return 0.0

    def epilogue(self, rank: int) -> float:
        """Host time after the last completion until the step returns."""
        return 0.0


@dataclass
class UniformCost(CostModel):
    """Fixed durations per pass (F, B, BI, BW), per UPDATE and per communication."""

    SYMMETRIC: ClassVar[bool] = True

    f: float = 1.0
    b: float = 2.0
    bi: float = 1.0
    bw: float = 1.0
    comm: float = 0.0
    update: float = 0.0
    collective: float | None = None  # default: ``comm``

    def compute_time(self, ins: Instr, rank: int, segment: str) -> float:
        return {"F": self.f, "B": self.b, "BI": self.bi, "BW": self.bw}.get(ins.node.tag("PASS"), self.f)

    def p2p_time(self, ins: Instr, rank: int, msg: str) -> float:
        return self.comm

    def collective_time(self, ins: Instr, rank: int, algo: str, members: int, nbytes: int) -> float:
        return self.collective if self.collective is not None else self.comm

    def update_time(self, ins: Instr, rank: int, nbytes: int) -> float:
        return self.update


_VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "alias", "detach", "split",
             "split_with_sizes", "unsqueeze", "squeeze", "slice", "select", "reshape", "as_strided", "getitem",
             "sym_size", "lift_fresh_copy"}


def _shape(a: Any, syms: dict[str, int]) -> list[int] | None:
    val = a.meta.get("val") if isinstance(a, fx.Node) else None
    return [concrete(d, syms) for d in val.shape] if isinstance(val, torch.Tensor) else None


def _prod(xs: Iterable[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _mm(s: list[list[int]]) -> int:  # [.., m, k] @ [.., k, n]
    a, b = s[-2], s[-1]
    return 2 * _prod(a) * b[-1]


def _sdpa(q: list[int], k: list[int], v: list[int]) -> int:  # QK^T and PV; causal masking not discounted
    return 2 * _prod(q) * k[-2] + 2 * _prod(q[:-1]) * k[-2] * v[-1]


def node_flops(node: fx.Node, syms: dict[str, int]) -> int:
    """FLOPs of one aten node of a segment graph (matmul family and attention; other ops 0)."""
    if node.op != "call_function":
        return 0
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    shapes = [s for s in (_shape(a, syms) for a in node.args) if s is not None]
    if name in ("mm", "addmm", "bmm", "baddbmm") and len(shapes) >= 2:
        return _mm(shapes)
    if name in ("moe_experts", "moe_experts_backward"):  # the grouped SwiGLU (nn/moe.py) on N x top-k rows
        backward = name.endswith("backward")
        x, idx, wg = shapes[1:4] if backward else shapes[0:3]
        return (16 if backward else 6) * x[0] * idx[-1] * wg[-2] * wg[-1]
    if "scaled_dot_product" in name and len(shapes) >= 3:
        if "backward" in name and len(shapes) >= 4:  # grad_out, q, k, v, ...: twice the forward
            return 2 * _sdpa(shapes[1], shapes[2], shapes[3])
        return _sdpa(shapes[0], shapes[1], shapes[2])
    return 0


def node_bytes(node: fx.Node, syms: dict[str, int]) -> int:
    """Bytes written by a non-view op (the memory-traffic term of ``FlopCost``)."""
    if node.op != "call_function":
        return 0
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    val = node.meta.get("val")
    if name in _VIEW_OPS or not isinstance(val, torch.Tensor):
        return 0
    return _prod(concrete(d, syms) for d in val.shape) * val.dtype.itemsize


def _segment_work(dag: TrainingDAG, syms: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """FLOPs and bytes written of every segment of ``dag`` at the symbol values ``syms``."""
    flops, written = {}, {}
    for name, seg in dag.segments.items():
        nodes = list(seg.gm.graph.nodes)
        flops[name] = sum(node_flops(n, syms) for n in nodes)
        written[name] = sum(node_bytes(n, syms) for n in nodes)
    return flops, written


@dataclass
class FlopCost(CostModel):
    """Roofline-style estimate: compute = FLOPs / ``flops_per_s`` (+ bytes written / ``mem_bytes_per_s``
    when given, + ``overhead_s`` per instruction); communication = ``latency_s`` + bytes / ``bytes_per_s``
    (ring all-reduce moves 2(n-1)/n of the bucket); UPDATE = ``update_passes`` x parameter bytes /
    ``mem_bytes_per_s`` (0 without it). ``symbols`` overrides symbol values (default: capture-time
    values, the batch symbol at the micro-batch size). ``links`` gives a traffic class its own link,
    ``{"pp": (bytes_per_s, latency_s), "dp": ..., "ep": ..., "tp": ...}`` (the class is the stream's
    first letters: ``pp_fwd`` is ``pp``, ``dp_gather`` is ``dp``); other traffic uses the defaults."""

    SYMMETRIC: ClassVar[bool] = True

    flops_per_s: float = 1e12
    bytes_per_s: float = 10e9
    latency_s: float = 0.0
    mem_bytes_per_s: float | None = None
    overhead_s: float = 0.0
    update_passes: int = 4
    symbols: dict[str, int] | None = None
    links: dict[str, tuple[float, float]] | None = None
    sizes: Sizes = field(default_factory=Sizes, init=False)
    flops: dict[str, int] = field(default_factory=dict, init=False)  # segment -> FLOPs
    written: dict[str, int] = field(default_factory=dict, init=False)  # segment -> bytes written

    def bind(self, dag: TrainingDAG | None) -> None:
        if dag is None or not dag.segments:
            raise PiperError("piper: FlopCost needs the plan's DAG with its segments; use "
                             "simulate_plan(piper.plan(...), cost) or simulate(programs, cost, dag=plan.dag)")
        self.sizes = Sizes.from_dag(dag, self.symbols)
        syms = self.sizes.symbols
        key = tuple(sorted(syms.items()))
        self.flops, self.written = dag.cached(f"flops:{key}", (len(dag.segments), key),
                                              lambda: _segment_work(dag, syms))


    def compute_time(self, ins: Instr, rank: int, segment: str) -> float:
        t = self.flops.get(segment, 0) / self.flops_per_s + self.overhead_s
        if self.mem_bytes_per_s:
            t += self.written.get(segment, 0) / self.mem_bytes_per_s
        return t

    def update_time(self, ins: Instr, rank: int, nbytes: int) -> float:
        return self.update_passes * nbytes / self.mem_bytes_per_s if self.mem_bytes_per_s else 0.0

    def link(self, ins: Instr) -> tuple[float, float]:
        """(bytes/s, latency s) of the link ``ins`` travels on."""
        if self.links:
            found = self.links.get(ins.node.stream.split("_")[0])
            if found is not None:
                return found
        return self.bytes_per_s, self.latency_s

    def p2p_time(self, ins: Instr, rank: int, msg: str) -> float:
        bw, lat = self.link(ins)
        return lat + self.sizes.messages.get(msg, 0) / bw

    def collective_time(self, ins: Instr, rank: int, algo: str, members: int, nbytes: int) -> float:
        """Ring algorithms: an all-reduce moves 2(n-1)/n of the bytes, the others (n-1)/n."""
        members = max(members, 1)
        factor = 2.0 if algo == "all_reduce" else 1.0
        bw, lat = self.link(ins)
        return lat + factor * (members - 1) / members * nbytes / bw

    def params_bytes(self, fqns: Iterable[str], as_: str = "master") -> int:
        return self.sizes.params_bytes(fqns, as_)

    def tensor_bytes(self, shape: Any, dtype: str) -> int:
        return self.sizes.tensor_bytes(shape, dtype)


def _median(xs: list[float], default: float = 0.0) -> float:
    return statistics.median(xs) if xs else default


def trimmed_mean(xs: list[float], cut: float = 0.2) -> float:
    """Mean of ``xs`` without its lowest and highest ``cut`` fraction."""
    ys = sorted(xs)
    k = int(len(ys) * cut)
    ys = ys[k:len(ys) - k] or ys
    return sum(ys) / len(ys)


STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median, "mean": statistics.fmean, "trimmed": trimmed_mean}


@dataclass
class MeasuredCost(CostModel):
    """Durations measured in real runs (see ``from_trace``). Each instruction is looked up by its DAG
    node name first (the same instruction recurs every step), then by its segment / queue / kind;
    instructions the trace does not cover fall back to ``fallback`` or raise."""

    instrs: dict[str, float] = field(default_factory=dict)  # node name -> compute or transfer seconds
    segments: dict[str, float] = field(default_factory=dict)  # segment -> compute seconds
    updates: dict[int, float] = field(default_factory=dict)  # rank -> UPDATE seconds
    p2p: dict[str, float] = field(default_factory=dict)  # queue (group name) -> transfer seconds
    issues: dict[str, float] = field(default_factory=dict)  # node name or kind -> host seconds to issue
    gaps: dict[int, float] = field(default_factory=dict)
    prologues: dict[int, float] = field(default_factory=dict)
    epilogues: dict[int, float] = field(default_factory=dict)
    fallback: CostModel | None = None

    @classmethod
    def from_trace(cls, sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
                   fallback: CostModel | None = None, blocked_s: float = 50e-6,
                   statistic: str = "trimmed") -> "MeasuredCost":
        """Costs from one or more traces (each a ``PIPER_TRACE`` directory of ``rank*.json``, or a merged
        file, holding one step), each instruction's samples reduced by ``statistic``: ``"trimmed"``
        (default: the mean without the lowest and highest 20%), ``"median"`` or ``"mean"``. Timings are
        skewed to the right (preemption, wake-up latency), so per-instruction medians add up to less
        than the median step; the trimmed mean keeps that skew but drops rare stalls.

        A P2P transfer takes the RECV's completion minus the later of the two issue ends, measured where
        the RECV's wait blocked longer than ``blocked_s`` (elsewhere the completion time is only an upper
        bound, so the queue's typical transfer is used); a collective takes its first completion minus
        its last member's issue end."""
        if isinstance(sources, (str, os.PathLike)):
            sources = [sources]
        acc: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
        for src in sources:
            _collect(read_spans(src), acc, blocked_s)
        if statistic not in STATISTICS:
            raise PiperError(f"piper: unknown statistic {statistic!r}; use one of {sorted(STATISTICS)}")
        reduce = STATISTICS[statistic]
        med: Callable[[str], dict[Any, float]] = lambda key: {k: reduce(v) for k, v in acc[key].items()}  # noqa: E731
        return cls(med("instr"), med("segment"), med("update"), med("p2p"), med("issue"), med("gap"), med("prologue"),
                   med("epilogue"), fallback)

    def _missing(self, ins: Instr, rank: int, what: str) -> float:
        if self.fallback is not None:
            return self.fallback.duration(ins, rank)
        raise PiperError(f"piper: the trace has no measurement of {what} ({ins.short()} on rank {rank}); "
                         "trace a run of the same plan, or pass MeasuredCost.from_trace(..., fallback=FlopCost(...))")

    def bind(self, dag: TrainingDAG | None) -> None:
        if self.fallback is not None:
            self.fallback.bind(dag)

    def duration(self, ins: Instr, rank: int) -> float:
        if ins.node.name in self.instrs:
            return self.instrs[ins.node.name]
        return ins.node.op.duration(self, ins, rank)

    def compute_time(self, ins: Instr, rank: int, segment: str) -> float:
        return self.segments[segment] if segment in self.segments else self._missing(ins, rank, f"segment {segment}")

    def update_time(self, ins: Instr, rank: int, nbytes: int) -> float:
        if rank in self.updates:
            return self.updates[rank]
        return _median(list(self.updates.values())) if self.updates else self._missing(ins, rank, "UPDATE")

    def p2p_time(self, ins: Instr, rank: int, msg: str) -> float:
        return self.p2p.get(ins.group_name(rank), 0.0)  # never blocked on: not on the critical path

    def collective_time(self, ins: Instr, rank: int, algo: str, members: int, nbytes: int) -> float:
        return self._missing(ins, rank, ins.node.name)

    def issue(self, ins: Instr, rank: int) -> float:
        return self.issues.get(ins.name, self.issues.get(ins.node.kind.value, 0.0))

    def gap(self, rank: int) -> float:
        return self.gaps.get(rank, 0.0)

    def prologue(self, rank: int) -> float:
        return self.prologues.get(rank, 0.0)

    def epilogue(self, rank: int) -> float:
        return self.epilogues.get(rank, 0.0)


def _collect(spans: list[Span], acc: dict[str, dict[Any, list[float]]], blocked_s: float) -> None:
    """Add one step's measurements (all ranks' spans of one traced step) to ``acc``."""
    by_rank: dict[int, list[Span]] = defaultdict(list)
    steps: dict[int, Span] = {}
    for s in spans:
        if s.kind == STEP_KIND:
            steps[s.rank] = s
        else:
            by_rank[s.rank].append(s)
    sends = {s.msg: s for s in spans if s.kind == Kind.SEND.value and s.msg}
    issued: dict[str, list[Span]] = defaultdict(list)
    for rank, ss in by_rank.items():
        ss.sort(key=lambda s: s.pos)
        for prev, s in zip(ss, ss[1:]):
            acc["gap"][rank].append(max(s.start - prev.host_end - s.wait_s, 0.0))
        for s in ss:
            if s.issue_end is None:  # COMPUTE / UPDATE
                acc["instr"][s.name].append(s.duration)
                key, at = ("segment", s.segment) if s.kind == Kind.COMPUTE.value else ("update", rank)
                if at is not None:
                    acc[key][at].append(s.duration)
                continue
            for k in (s.name, s.kind):
                acc["issue"][k].append(s.issue_end - s.start)
            if s.kind == Kind.RECV.value and s.msg in sends and s.blocked_s > blocked_s:
                transfer = max(s.end - max(sends[s.msg].host_end, s.host_end), 0.0)
                for name in (s.name, sends[s.msg].name):
                    acc["instr"][name].append(transfer)
                acc["p2p"][s.stream].append(transfer)
            elif s.kind not in (Kind.SEND.value, Kind.RECV.value):
                issued[s.name].append(s)
        step = steps.get(rank)
        if step is not None and ss:
            acc["prologue"][rank].append(max(ss[0].start - step.start - ss[0].wait_s, 0.0))
            acc["epilogue"][rank].append(max(step.end - max(s.end for s in ss), 0.0))
    for name, members in issued.items():  # a collective runs once its last member issued it
        ready = max(s.host_end for s in members)
        acc["instr"][name].append(max(min(s.end for s in members) - ready, 0.0))
