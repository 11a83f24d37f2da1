"""Shared helpers for the piper benchmarks: CLI flags for the GPT and the run, synthetic batches, a timed
step loop, peak RSS per rank, and a table printer that shows piper's time relative to each peer.

Timing: every rank calls ``dist.barrier()`` before each step, then times the step alone. A step's time
is the slowest rank's time for that step; warm-up steps (which include compilation) are excluded from
the median and p90 and the first step's time is reported separately as "first s". Peak RSS is
``getrusage(RUSAGE_SELF).ru_maxrss`` of each rank's process at the end; "+RSS" is how much that peak
grew during the timed steps (after warm-up): a steady state should show ~0. Every variant runs in
freshly spawned processes, so one variant's peak never leaks into another's.

"cpu ms" is the median of the busiest rank's process CPU time per step (all its threads). On a shared
or throttled machine wall time can double from one minute to the next while CPU time barely moves:
trust a wall ratio only when the cpu ratio agrees, and use ``--rounds 3`` (best median of 3 launches
per variant) for wall numbers. The load averages printed before and after include our own ranks.

Ratios are ``piper / peer`` on the median step time: below 1.00 piper is faster, above 1.00 slower.
"""
from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from piper_compile.knobs import knob
from piper_compile.runtime.optimizer import build_optimizer
from piper_compile.testing.models import GPT, GPTConfig


def add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (GPT)")
    g.add_argument("--dim", type=int, default=256)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--seq", type=int, default=128)
    g.add_argument("--vocab", type=int, default=1024)
    r = p.add_argument_group("run")
    r.add_argument("--batch", type=int, default=8, help="local batch per data-parallel replica (sequences)")
    r.add_argument("--steps", type=int, default=10, help="timed steps")
    r.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    r.add_argument("--codegen", choices=["inductor", "eager"], default="inductor", help="piper's segment codegen")
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeout", type=float, default=900, help="seconds before a spawned run is declared hung")
    r.add_argument("--rounds", type=int, default=1,
                   help="launch every variant this many times (fresh processes) and keep its best median")


@dataclass(frozen=True)
class Spec:
    """Everything a worker needs (picklable)."""

    model: dict[str, int]
    batch: int
    steps: int
    warmup: int
    codegen: str
    lr: float
    seed: int

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "Spec":
        return cls({"dim": a.dim, "layers": a.layers, "heads": a.heads, "seq": a.seq, "vocab": a.vocab},
                   a.batch, a.steps, a.warmup, a.codegen, a.lr, a.seed)

    def describe(self) -> str:
        m = self.model
        return (f"GPT dim={m['dim']} layers={m['layers']} heads={m['heads']} seq={m['seq']} vocab={m['vocab']}, "
                f"local batch {self.batch}, AdamW lr={self.lr} ({'fused' if peer_fused_kwargs() else 'default'} in "
                f"piper and peers), {self.warmup} warm-up + {self.steps} timed steps, "
                f"piper codegen={self.codegen}, torch {torch.__version__}, piper {piper_revision()}, 1 thread/rank")


def piper_revision() -> str:
    """The piper imported (``PYTHONPATH`` may point at a snapshot): its commit, "+dirty" when the working tree
    has local changes under piper_compile/, or its path when it is not in a git checkout."""
    import piper_compile

    root = os.path.dirname(os.path.dirname(os.path.abspath(piper_compile.__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "piper_compile"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return f"at {root} (not a git checkout)"


def peer_adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    """The peers' AdamW, in the implementation piper picks for its own optimizer (``build_optimizer``: fused
    unless ``PIPER_FUSED_OPTIMIZER=0``), so a ratio compares the systems and not two AdamW kernels."""
    return build_optimizer(functools.partial(torch.optim.AdamW, lr=lr), list(params))


def peer_fused_kwargs() -> dict[str, bool]:
    """``fused=True`` for an optimizer class the peer constructs itself (``ZeroRedundancyOptimizer``), as
    ``peer_adamw`` chooses."""
    return {} if not knob("PIPER_FUSED_OPTIMIZER") else {"fused": True}


def build_gpt(spec: Spec, untie: bool = False) -> GPT:
    """The same weights on every rank and in every variant (seeded); ``untie`` gives the head its own weight."""
    torch.manual_seed(spec.seed)
    model = GPT(GPTConfig(**spec.model))
    if untie:
        model.head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


def global_batches(model: GPT, spec: Spec, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch of ``n`` sequences per step (warm-up + timed), the same for every variant."""
    out = []
    for s in range(spec.warmup + spec.steps):
        gen = torch.Generator().manual_seed(1000 + 100 * spec.seed + s)
        x, y = model.make_batch(n, gen)
        out.append((x, y))
    return out


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min) {five:.1f} (5 min) on {os.cpu_count()} cores (our own ranks count too)"


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


@dataclass
class RankResult:
    """One rank's measurements of one variant (picklable: goes back through ``run_local``)."""

    times: list[float]  # seconds per timed step
    cpu: list[float]  # CPU seconds (user + system, all threads of the process) per timed step
    first_s: float  # the first (compiling) step
    losses: list[float]  # this rank's loss per step (warm-up included); nan where the rank has none
    peak_rss: float  # MiB
    rss_growth: float  # MiB, peak growth during the timed steps
    extra: dict[str, Any] = field(default_factory=dict)


def local_batch(batches: list[tuple[torch.Tensor, torch.Tensor]], i: int, rank: int, n: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's ``n`` sequences of global batch ``i`` (cycling through ``batches``)."""
    x, y = batches[i % len(batches)]
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def eager_dp_step(net: Callable[..., torch.Tensor], opt: torch.optim.Optimizer,
                  batches: list[tuple[torch.Tensor, torch.Tensor]], rank: int, n: int,
                  set_to_none: bool = True) -> Callable[[int], torch.Tensor]:
    """An eager data-parallel training step (forward, backward, optimizer step) on step ``i``'s batch."""
    def step(i: int) -> torch.Tensor:
        loss = net(*local_batch(batches, i, rank, n))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss
    return step


def to_global_mean(res: "RankResult", world: int) -> "RankResult":
    """After timing: replace this rank's losses by the global mean loss per step, as piper returns it."""
    mean = torch.tensor(res.losses)
    dist.all_reduce(mean)
    res.losses = (mean / world).tolist()
    return res


def timed_loop(step: Callable[[int], torch.Tensor | None], spec: Spec) -> RankResult:
    """Run ``step(i)`` for warm-up + timed steps with a barrier before each; ``step`` returns its loss."""
    return timed_loops({"": step}, spec)[""]


def timed_loops(steps: dict[str, Callable[[int], torch.Tensor | None]], spec: Spec) -> dict[str, RankResult]:
    """Several variants in one process, step ``i`` of each in turn (A B C A B C ...), each behind a
    barrier: a slow phase of the machine then slows every variant alike, so their ratios stay fair.
    RSS figures are the process's (shared by the variants; meaningful with one variant only)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, list[float]] = {k: [] for k in steps}
    first: dict[str, float] = {}
    rss_after_warmup = peak_rss_mib()
    for i in range(spec.warmup + spec.steps):
        if i == spec.warmup:
            rss_after_warmup = peak_rss_mib()
        for name, step in steps.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), cpu_seconds()
            loss = step(i)
            dt, dc = time.perf_counter() - t0, cpu_seconds() - c0
            losses[name].append(float("nan") if loss is None else float(loss.detach()))
            first.setdefault(name, dt)
            if i >= spec.warmup:
                times[name].append(dt)
                cpu[name].append(dc)
    dist.barrier()
    peak = peak_rss_mib()
    return {k: RankResult(times[k], cpu[k], first[k], losses[k], peak, peak - rss_after_warmup) for k in steps}


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Summary:
    median_ms: float
    p90_ms: float
    cpu_ms: float  # median over steps of the busiest rank's CPU time: less sensitive to other load
    first_s: float
    rss: list[float]  # peak MiB per rank
    growth: list[float]  # MiB per rank

    @classmethod
    def of(cls, ranks: list[RankResult]) -> "Summary":
        per_step = [max(r.times[i] for r in ranks) for i in range(len(ranks[0].times))]  # slowest rank
        cpu = [max(r.cpu[i] for r in ranks) for i in range(len(ranks[0].cpu))]
        return cls(1e3 * statistics.median(per_step), 1e3 * percentile(per_step, 0.9),
                   1e3 * statistics.median(cpu),
                   max(r.first_s for r in ranks), [r.peak_rss for r in ranks], [r.rss_growth for r in ranks])


def best_of(rounds: int, launch: Callable[[], list[RankResult]]) -> list[RankResult]:
    """``launch()`` ``rounds`` times; the round with the lowest median step time (least disturbed by other load)."""
    runs = [launch() for _ in range(max(1, rounds))]
    return min(runs, key=lambda ranks: Summary.of(ranks).median_ms)


def print_table(title: str, rows: dict[str, dict[str, Summary]], piper: dict[str, str]) -> None:
    """``rows[config][variant]``; ``piper[config]`` names the piper variant the ratio column divides."""
    print(f"\n== {title}")
    head = (f"{'config':<10} {'variant':<28} {'median ms':>10} {'p90 ms':>9} {'cpu ms':>8} {'first s':>8}  "
            f"{'peak RSS MiB per rank':<24} {'+RSS MiB':<14} {'piper/this':>10}")
    print(head)
    print("-" * len(head))
    for config, variants in rows.items():
        ref = variants[piper[config]].median_ms
        for name, s in variants.items():
            rss = " / ".join(f"{x:.0f}" for x in s.rss)
            grow = " / ".join(f"{x:+.0f}" for x in s.growth)
            ratio = "-" if name == piper[config] else f"{ref / s.median_ms:.2f}"
            print(f"{config:<10} {name:<28} {s.median_ms:>10.1f} {s.p90_ms:>9.1f} {s.cpu_ms:>8.1f} {s.first_s:>8.1f}  "
                  f"{rss:<24} {grow:<14} {ratio:>10}")


def print_ratios(rows: dict[str, dict[str, Summary]], piper: dict[str, str]) -> None:
    """One line per configuration: piper / peer on median wall time and on median CPU time."""
    for config, variants in rows.items():
        ours = variants[piper[config]]
        parts = [f"piper / {name} = {ours.median_ms / s.median_ms:.2f} wall, {ours.cpu_ms / s.cpu_ms:.2f} cpu"
                 for name, s in variants.items() if name != piper[config]]
        print(f"{config}: " + "; ".join(parts))


def compare_losses(label: str, a: list[float], b: list[float], rtol: float = 1e-4) -> bool:
    """Print one line comparing two per-step loss curves; True when every step agrees within ``rtol``."""
    diffs = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
    worst = max(diffs) if diffs else float("nan")
    ok = bool(diffs) and worst <= rtol
    print(f"  {label}: final {a[-1]:.6f} vs {b[-1]:.6f}; max rel diff over {len(diffs)} steps {worst:.1e} "
          f"-> {'OK' if ok else 'MISMATCH'} (rtol {rtol:.0e})")
    return ok
