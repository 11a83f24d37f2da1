"""autoplan's proof by runs: does its ranking hold when the plans actually train?

1. Calibrate the cost model on this machine: ``piper.profile`` (eager forward + backward of the model on one
   rank's share of the batch: achieved FLOP/s) and a gloo ping-pong between two ranks over the current link
   (latency from 4 KiB messages, bandwidth from 4 MiB ones); every traffic class gets that link.
2. ``piper.autoplan`` on ``--world`` ranks (planning only) ranks every strategy that fits ``--memory-mb``.
3. Run autoplan's top ``--top`` plus ``--others`` more picked evenly from the rest of its ranking, each in
   freshly spawned gloo processes (``common.timed_loop``: median of the slowest rank per step after warm-up),
   and read each rank's tensor-level peak from the runtime's own accounting (``piper.memory_report``).
4. Print predicted vs measured step time and peak per plan, the Spearman rank correlation of predicted and
   measured times, and whether autoplan's first pick is within 5% of the fastest measured plan.

    OMP_NUM_THREADS=1 python benchmarks/bench_autoplan.py                          # GPT, 4 ranks, loopback
    OMP_NUM_THREADS=1 python benchmarks/bench_autoplan.py --model moegpt --memory-mb 40
    python benchmarks/emulated_link.py --rate 1gbit --per-rank 4 -- python benchmarks/bench_autoplan.py
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Spec, Summary, add_common_args, global_batches, load_note, local_batch, timed_loop  # noqa: E402

import piper_compile as piper  # noqa: E402
from piper_compile.autoplan import measure_link  # noqa: E402
from piper_compile.sim import FlopCost  # noqa: E402
from piper_compile.testing.launch import run_local  # noqa: E402
from piper_compile.testing.models import GPT, GPTConfig, MoEGPT  # noqa: E402

MiB = 2**20


def build(spec: Spec, kind: str) -> GPT:
    torch.manual_seed(spec.seed)
    cfg = GPTConfig(**spec.model)
    return MoEGPT(cfg, experts=4, top_k=2) if kind == "moegpt" else GPT(cfg)


def run_choice(rank: int, world: int, spec: Spec, kind: str, choice: Any) -> Any:
    model = build(spec, kind)
    choice.annotate(model)
    c = choice.candidate
    batches = global_batches(model, spec, spec.batch * world)
    n = spec.batch * world // c.dp
    step = piper.compile(model, directives=choice.directives, codegen=spec.codegen,
                         optimizer=functools.partial(torch.optim.AdamW, lr=spec.lr))
    res = timed_loop(lambda i: step(*local_batch(batches, i, choice.replica(rank), n)), spec)
    res.extra = {"peak_mib": piper.memory_report(step).measured.peak_total / MiB}
    return res


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out
    return statistics.correlation(ranks(a), ranks(b)) if len(a) > 2 else float("nan")


def pick(ranked: list[Any], top: int, others: int) -> list[int]:
    """Indices into ``ranked``: the first ``top`` and ``others`` spread evenly over the rest."""
    rest = list(range(top, len(ranked)))
    if len(rest) <= others:
        return list(range(min(top, len(ranked)))) + rest
    step = len(rest) / others
    return list(range(top)) + [rest[int(i * step)] for i in range(others)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(dim=64, layers=4, seq=32, vocab=256, batch=4, steps=6, warmup=2, codegen="eager")
    p.add_argument("--model", choices=["gpt", "moegpt"], default="gpt")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--memory-mb", type=float, default=None)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--others", type=int, default=10)
    p.add_argument("--overhead-us", type=float, default=100.0, help="host seconds per instruction in the model")
    a = p.parse_args()
    spec = Spec.from_args(a)
    print(f"# {a.model} {spec.describe()}\n# world {a.world}, global batch {spec.batch * a.world}; {load_note()}")
    model = build(spec, a.model)
    batch = global_batches(model, spec, spec.batch * a.world)[0]
    prof = piper.profile(model, *(t[: spec.batch] for t in batch))
    bw, lat = measure_link(a.world)
    print(f"# {prof}\n# link: {bw / 1e9:.2f} GB/s, {lat * 1e6:.0f} us one-way (gloo ping-pong, ranks 0-1)")
    cost = FlopCost(flops_per_s=prof.flops_per_s, bytes_per_s=bw, latency_s=lat, overhead_s=a.overhead_us * 1e-6)
    res = piper.autoplan(model, *batch, world_size=a.world, memory_mb=a.memory_mb, cost=cost, top=None)
    print(f"# autoplan: {len(res.ranked)} strategies fit, {res.planned} planned in {res.seconds:.1f}s")
    rows = []
    for i in pick(res.ranked, a.top, a.others):
        choice = dataclasses.replace(res.ranked[i], dag_text="")
        try:
            ranks = run_local(run_choice, a.world, spec, a.model, choice, timeout_s=a.timeout)
        except RuntimeError as e:
            print(f"{i + 1:>3}. {choice.candidate.label()}: FAILED {str(e).splitlines()[-1]}")
            continue
        measured = Summary.of(ranks).median_ms
        peak = max(r.extra["peak_mib"] for r in ranks)
        rows.append((i, choice, measured, peak))
        print(f"{i + 1:>3}. {choice.candidate.label():<44} predicted {choice.step_time * 1e3:8.2f} ms "
              f"measured {measured:8.2f} ms | peak predicted {choice.max_peak_mb:7.2f} measured {peak:7.2f} MiB",
              flush=True)
    report(rows)


def report(rows: list[tuple[int, Any, float, float]]) -> None:
    if not rows:
        print("# nothing ran")
        return
    pred = [c.step_time * 1e3 for _, c, _, _ in rows]
    meas = [m for _, _, m, _ in rows]
    mem_err = [abs(pk - c.max_peak_mb) / c.max_peak_mb for _, c, _, pk in rows]
    fastest = min(rows, key=lambda r: r[2])
    first = next((r for r in rows if r[0] == 0), None)
    print(f"\n# Spearman rank correlation, predicted vs measured step time over {len(rows)} plans: "
          f"{spearman(pred, meas):.2f}")
    print(f"# peak memory: predicted vs measured within {max(mem_err):.1%} (worst), {statistics.median(mem_err):.1%} "
          "(median)")
    if first is not None:
        gap = first[2] / fastest[2] - 1
        print(f"# autoplan's first pick ({first[1].candidate.label()}) measured {first[2]:.2f} ms; fastest measured "
              f"#{fastest[0] + 1} ({fastest[1].candidate.label()}) {fastest[2]:.2f} ms: first pick "
              f"{'within' if gap <= 0.05 else 'NOT within'} 5% ({gap:+.1%})")


if __name__ == "__main__":
    main()
