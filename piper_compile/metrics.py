"""``piper.stats(step)``: the last step's metrics the way trainers log them.

- **step time**: on CUDA the device time between events recorded at the step's start and end (read at
  the first ``stats`` call after the step; it waits for the step's work to finish); elsewhere the host
  time of the step.
- **samples / tokens per second**: the global batch (every replica's samples, from the call check) and,
  when the first batched input holds integer token ids ``[B, T, ...]``, ``B * T`` tokens.
- **FLOPs**: this rank's executed FLOPs in the step, counted from the captured graph of every compute
  step it ran (matmul family and attention, ``sim/cost.node_flops``, at the step's micro-batch size;
  recomputation included: it is work the device did); expert-parallel expert steps, which run outside
  segment graphs, are counted as they run, on the rows each rank received.
- **MFU**: achieved TFLOP/s over the device's peak for the compute dtype: a table of common GPUs
  (dense tensor-core figures), overridable with ``PIPER_PEAK_TFLOPS``; on CPU a measured matmul peak
  (the best of a few 512x512 matmuls in that dtype, once per process).
- **split**: host time in compute steps, in the optimizer update, blocked on collectives (exposed
  communication), blocked on stage-to-stage messages (waiting: bubbles and skew), and the rest (issue
  and bookkeeping). On CUDA these are host times: compute is issue time, blocking is rare.
- **peak memory**: the CUDA allocator's peak (``torch.cuda.max_memory_allocated``), else the most
  bytes of activations, gathered parameters and gradient buckets the runtime held at once.

``options["log_stats"] = N`` (or ``PIPER_LOG_STATS=N``) logs ``StepMetrics.line()`` at INFO on the
``piper_compile.stats`` logger every N training steps.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from piper_compile.knobs import knob

LOG = logging.getLogger("piper_compile.stats")

# dense peak TFLOP/s by device-name fragment (checked in order) and compute dtype; fp32 is without TF32
_PEAKS: tuple[tuple[str, dict[torch.dtype, float]], ...] = (
    ("B200", {torch.bfloat16: 2250.0, torch.float16: 2250.0, torch.float32: 80.0}),
    ("H200", {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0}),
    ("H100 PCIe", {torch.bfloat16: 756.0, torch.float16: 756.0, torch.float32: 51.0}),
    ("H100", {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0}),
    ("A100", {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5}),
    ("L40S", {torch.bfloat16: 362.0, torch.float16: 362.0, torch.float32: 91.6}),
    ("L4", {torch.bfloat16: 121.0, torch.float16: 121.0, torch.float32: 30.3}),
    ("A10", {torch.bfloat16: 125.0, torch.float16: 125.0, torch.float32: 31.2}),
    ("4090", {torch.bfloat16: 165.0, torch.float16: 165.0, torch.float32: 82.6}),
    ("V100", {torch.float16: 125.0, torch.float32: 15.7}),
)
_CPU_PEAK: dict[torch.dtype, float] = {}


@dataclass(frozen=True)
class StepMetrics:
    """One training step on one rank (see the module docstring for how each figure is measured)."""

    step_time_s: float
    samples: int
    tokens: int  # 0 when the inputs are not token ids
    flops: int  # this rank's
    peak_tflops: float
    peak_source: str  # "table: H100", "PIPER_PEAK_TFLOPS", "measured CPU matmul"
    compute_s: float
    update_s: float
    exposed_comm_s: float
    wait_s: float
    peak_memory_bytes: int
    flops_note: str = ""
    # compilation of this model's steps so far: segments compiled, those that run eagerly (Inductor
    # failed), seconds spent compiling, and Dynamo recompiles of the step (each one warned about)
    compiled_segments: int = 0
    fallbacks: int = 0
    compile_s: float = 0.0
    recompiles: int = 0
    cache_hits: int = 0  # graphs loaded from Inductor's FX graph cache (another rank or run compiled them)
    cache_misses: int = 0  # graphs this rank compiled and wrote to the cache
    reused: int = 0  # graphs that reused code compiled in this process (repeated blocks: codegen/regional.py)
    capture: str = ""  # the joint graph: "captured" (exported here), "loaded" (capture/cache.py), "off", "uncacheable"
    capture_s: float = 0.0  # seconds the joint export (or its load) took
    fast_loads: int = 0  # of cache_hits, graphs loaded straight from their recorded entry (codegen/artifacts.py)
    # the forward's trace: "traced" (piper's whole-graph trace), "loaded" (a previous run's trace, no Dynamo trace
    # at all: capture/forward_cache.py) or "dynamo" (torch.compile's hook traced it), and its seconds
    forward: str = "dynamo"
    forward_s: float = 0.0
    # expert parallelism: the most rows one of this rank's MoE layers received in the step, over balanced
    # routing's (0.0 without expert parallelism); the memory plan sizes them by ``shard``'s load
    expert_load: float = 0.0

    @property
    def tflops_per_s(self) -> float:
        """Achieved TFLOP/s of this rank."""
        return self.flops / self.step_time_s / 1e12 if self.step_time_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        return self.tflops_per_s / self.peak_tflops if self.peak_tflops > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        """Step time not in compute, update or blocking: issue, bookkeeping, Python."""
        return max(self.step_time_s - self.compute_s - self.update_s - self.exposed_comm_s - self.wait_s, 0.0)

    def line(self) -> str:
        """One log line."""
        rate = f"{self.tokens_per_s:,.0f} tok/s" if self.tokens else f"{self.samples_per_s:,.1f} samples/s"
        return (f"step {self.step_time_s * 1e3:.1f} ms | {rate} | {self.tflops_per_s:.3f} TFLOP/s/rank | "
                f"MFU {100 * self.mfu:.1f}% of {self.peak_tflops:.1f} ({self.peak_source}) | compute "
                f"{self.compute_s * 1e3:.1f} ms, update {self.update_s * 1e3:.1f} ms, exposed comm "
                f"{self.exposed_comm_s * 1e3:.1f} ms, waiting {self.wait_s * 1e3:.1f} ms, other "
                f"{self.other_s * 1e3:.1f} ms | peak mem {self.peak_memory_bytes / 2**20:.1f} MiB"
                + (f" | expert load {self.expert_load:.2f}x" if self.expert_load else ""))


def peak_tflops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The device's peak TFLOP/s for ``dtype`` and where the figure comes from."""
    override = knob("PIPER_PEAK_TFLOPS")
    if override:
        return float(override), "PIPER_PEAK_TFLOPS"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, peaks in _PEAKS:
            if frag in name and dtype in peaks:
                return peaks[dtype], f"table: {frag}"
        return 0.0, f"unknown GPU {name!r}: set PIPER_PEAK_TFLOPS"
    if dtype not in _CPU_PEAK:
        _CPU_PEAK[dtype] = _measure_cpu_peak(dtype)
    return _CPU_PEAK[dtype], "measured CPU matmul"


def _measure_cpu_peak(dtype: torch.dtype, n: int = 512, reps: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def step_flops(cs: Any, symbols: dict[str, int]) -> tuple[int, str]:
    """This rank's FLOPs in a training step of ``cs`` at these size symbols, and a note on what is missing."""
    from piper_compile.ir.ops import Segment as SegmentOp
    from piper_compile.sim.cost import node_flops

    program = cs.plans[False].programs[cs.rank]
    key = tuple(sorted(symbols.items()))
    cache = cs.flops
    total = 0
    for ins in program.instrs:
        op = ins.node.op
        if not isinstance(op, SegmentOp):
            continue
        k = (op.segment, key)
        if k not in cache:
            cache[k] = sum(node_flops(n, symbols) for n in cs.segments[op.segment].gm.graph.nodes)
        total += cache[k]
    return total, ""


def tokens_per_sample(cs: Any, symbols: dict[str, int]) -> int:
    """Tokens per sample when the first batched input is integer token ids ``[B, T, ...]`` (else 0), its
    sizes at the step's symbol values."""
    from piper_compile.sim.shapes import concrete

    j = cs.joint
    for spec, ph in zip(j.inputs, j.gm.graph.find_nodes(op="placeholder")):
        val = ph.meta.get("val")
        if spec.kind == "input" and spec.batched and isinstance(val, torch.Tensor):
            if val.dtype.is_floating_point or val.dim() < 2:
                return 0
            return math.prod(concrete(d, symbols) for d in val.shape[1:])
    return 0


def metrics_of(cs: Any) -> StepMetrics:
    """The metrics of ``cs``'s last training step on this rank."""
    stats = cs.plans[False].executor.stats
    device_s = stats.device_seconds()
    seconds = stats.seconds if device_s is None else device_s
    flops, note = step_flops(cs, stats.symbols)
    flops += stats.expert_flops
    dtype = cs.state.precision.param_dtype or next(iter(cs.joint.params.values())).dtype
    peak, source = peak_tflops(cs.state.device, dtype)
    if cs.state.device.type == "cuda":
        mem = torch.cuda.max_memory_allocated(cs.state.device)
    else:
        mem = stats.peak_held_bytes  # what the step held at once (memory.MemoryFigures.peak_held)
    segs = [c for s in cs.state.steps for c in s.compiled.values()]

    def count(*outcomes: str) -> int:
        return sum(c.outcomes.count(o) for c in segs for o in outcomes)

    return StepMetrics(seconds, stats.samples, stats.samples * tokens_per_sample(cs, stats.symbols), flops, peak, source,
                       stats.compute_s, stats.update_s, stats.comm_wait_s, stats.p2p_wait_s, mem, note,
                       len(segs), sum(1 for c in segs if c.fallback), sum(c.compile_seconds for c in segs),
                       sum(1 for s in cs.state.steps if s.recompile_reason) + sum(s.reused_recompiles for s in cs.state.steps),
                       count("hit", "loaded"), count("miss"), count("reused"), cs.joint.how, cs.joint.seconds,
                       count("loaded"), cs.forward_how, cs.forward_seconds, stats.expert_load)
