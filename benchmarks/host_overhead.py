"""Host overhead per step: the runtime's own time (dispatch, waits bookkeeping, accounting, frees) on a
model so small that its kernels take microseconds, so a step's time is almost all the runtime's.

Tiny MLP (dim 8, 4 layers), 8 micro-batches, codegen eager; two plans: one rank (``split(8)``) and two
gloo ranks (2-stage 1F1B). Prints each plan's median step time, instructions per step (the longest
rank program) and microseconds per instruction. Compare two checkouts by running this file from each
(``PYTHONPATH=<checkout> python benchmarks/host_overhead.py``), alternating, on a quiet machine.

    python benchmarks/host_overhead.py --steps 200
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch

from piper_compile.testing.launch import run_local


def _worker(rank: int, world: int, steps: int, warmup: int) -> dict[str, Any]:
    import piper_compile as piper
    from piper_compile.testing.models import build_model

    torch.manual_seed(0)
    model = build_model("mlp", dim=8, depth=4)
    directives: list[Any] = [piper.split(8)]
    if world > 1:
        model.annotate_stages(world)  # type: ignore[operator]
        directives = [*piper.pipeline(world), piper.split(8), *piper.schedules.one_f_one_b(world, 8)]
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": directives, "codegen": "eager",
                                  "optimizer": functools.partial(torch.optim.SGD, lr=0.01)})
    x, y = model.make_batch(16, torch.Generator().manual_seed(1))  # type: ignore[operator]
    times = []
    for i in range(warmup + steps):
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        step(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    instrs = max(len(p.instrs) for p in [piper.compiled_steps(step)[0].blueprint(False).programs[rank]])
    return {"median_ms": statistics.median(times) * 1e3, "instrs": instrs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    print(f"{'plan':<22} {'median ms':>10} {'instrs':>7} {'us/instr':>9}")
    for world, name in ((1, "1 rank, split(8)"), (2, "2 ranks, PP2 1F1B m=8")):
        res = run_local(_worker, world, args.steps, args.warmup)
        ms = max(r["median_ms"] for r in res)
        n = max(r["instrs"] for r in res)
        print(f"{name:<22} {ms:>10.3f} {n:>7} {ms * 1e3 / n:>9.1f}")


if __name__ == "__main__":
    main()
