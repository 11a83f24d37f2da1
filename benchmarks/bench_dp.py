"""Data parallel: piper ``[replicate()]`` vs ``DistributedDataParallel`` (eager) vs ``torch.compile(DDP)``.

Same GPT (tied embedding, as in ``piper_compile.testing.models``), same seed and rank-0 weights, same
AdamW, same local batch per rank, same synthetic batches, gloo on CPU with 1 thread per rank. Each
variant runs in freshly spawned processes (``run_local``) for every world size. One piper call is one
whole training step (forward, backward, gradient all-reduce, optimizer update); the peers do
``loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()``.

Read the ``piper/this`` column as piper's median step time divided by that peer's: 0.90 means piper
takes 10% less time per step, 1.20 means 20% more. The correctness lines compare the global mean loss
of every step (piper returns it; the DDP losses are averaged over ranks after the run).

    python benchmarks/bench_dp.py                      # world 2 and 4, piper codegen inductor
    python benchmarks/bench_dp.py --codegen eager --world 2
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RankResult, Spec, Summary, add_common_args, best_of, build_gpt, compare_losses,  # noqa: E402
                    eager_dp_step, global_batches, load_note, local_batch, peer_adamw, print_ratios,
                    print_table, timed_loop, to_global_mean)

from piper_compile.testing.launch import run_local  # noqa: E402


def piper_worker(rank: int, world: int, spec: Spec) -> RankResult:
    import piper_compile as piper

    model = build_gpt(spec)
    batches = global_batches(model, spec, world * spec.batch)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": [piper.replicate()], "codegen": spec.codegen,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)})
    res = timed_loop(lambda i: step(*local_batch(batches, i, rank, spec.batch)), spec)
    stats = piper.last_stats(step)
    cs = piper.compiled_steps(step)[0]
    res.extra = {"collectives": dict(stats.collectives), "compute": stats.compute,
                 "peak_live_mib": round(stats.peak_live_bytes / 2**20, 1), "last_step_s": round(stats.seconds, 3),
                 "compile_s": round(sum(c.compile_seconds for c in cs.compiled.values()), 1),
                 "segments": sorted(cs.compiled)}
    return res


def ddp_worker(rank: int, world: int, spec: Spec, compiled: bool) -> RankResult:
    model = build_gpt(spec)
    batches = global_batches(model, spec, world * spec.batch)
    ddp = DDP(model)  # broadcasts rank 0's weights
    opt = peer_adamw(ddp.parameters(), spec.lr)
    fwd = torch.compile(ddp) if compiled else ddp

    return to_global_mean(timed_loop(eager_dp_step(fwd, opt, batches, rank, spec.batch), spec), world)


VARIANTS = {
    "piper replicate": (piper_worker, ()),
    "DDP eager": (ddp_worker, (False,)),
    "compile(DDP) inductor": (ddp_worker, (True,)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="gloo ranks (one process each)")
    p.add_argument("--profile", action="store_true", help="also cProfile rank 0 of piper (top functions printed)")
    args = p.parse_args()
    spec = Spec.from_args(args)
    print(f"bench_dp: {spec.describe()}, {os.cpu_count()} CPU cores", flush=True)
    print(f"before: {load_note()}")
    rows: dict[str, dict[str, Summary]] = {}
    piper_name = f"piper replicate ({spec.codegen})"
    all_ok = True
    for world in args.world:
        config = f"DP{world}"
        rows[config] = {}
        results: dict[str, list[RankResult]] = {}
        for name, (fn, extra) in VARIANTS.items():
            label = piper_name if fn is piper_worker else name
            print(f"  running {config} {label} ...", flush=True)
            launch = functools.partial(run_local, fn, world, spec, *extra, timeout_s=args.timeout)
            results[label] = best_of(args.rounds, launch)
            rows[config][label] = Summary.of(results[label])
        piper0 = results[piper_name][0]
        print(f"  {config} piper rank-0 counters: {piper0.extra}")
        for peer in ("DDP eager", "compile(DDP) inductor"):
            all_ok &= compare_losses(f"{config} loss piper vs {peer}", piper0.losses, results[peer][0].losses)
    print_table("data parallel: median step time (slowest rank per step)", rows,
                {c: piper_name for c in rows})
    print_ratios(rows, {c: piper_name for c in rows})
    print(f"after: {load_note()}")
    print(f"correctness: {'all losses agree' if all_ok else 'LOSS MISMATCH (see above)'}")
    if args.profile:
        profile_piper(spec)


def _profiled_piper(rank: int, world: int, spec: Spec) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile() if rank == 0 else None
    import piper_compile as piper

    model = build_gpt(spec)
    batches = global_batches(model, spec, world * spec.batch)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": [piper.replicate()], "codegen": spec.codegen,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)})

    def run(i: int) -> torch.Tensor:
        if prof is not None and i == spec.warmup:
            prof.enable()
        return step(*local_batch(batches, i, rank, spec.batch))

    timed_loop(run, spec)
    if prof is None:
        return ""
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def profile_piper(spec: Spec) -> None:
    print("\n== cProfile of piper rank 0 over the timed steps (world 2), by own time")
    print(run_local(_profiled_piper, 2, spec)[0])


if __name__ == "__main__":
    main()
