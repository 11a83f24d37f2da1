"""Multi-stage pipeline schedules: piper vs ``torch.distributed.pipelining`` on the same GPT split.

Two stages per rank (``2 * ranks`` stages; blocks divided as ``GPT.annotate_stages`` does, embeddings
on stage 0, ln_f + head + loss on the last stage, LM head untied in both systems). For each schedule
the peer runs its own class (Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) and
piper runs (a) the *same* schedule, loaded from the CSV the peer's class writes (``_dump_csv``), and
(b) piper's own builder where it has one (interleaved_1f1b, zbv, dualpipe_v). Also piper 1F1B on one
stage per rank, the baseline DualPipeV should beat. Same micro-batches, AdamW, gloo, 1 thread/rank.

Read ``piper/this`` as piper's median step time divided by the row's: below 1.00 piper is faster.

    python benchmarks/bench_schedules.py                     # 2 ranks, 8 micro-batches
    python benchmarks/bench_schedules.py --ranks 4 --layers 8
    python benchmarks/bench_schedules.py --interleaved        # all variants in one process tree, in turn

Each variant normally runs in fresh processes (its own peak RSS). A shared machine has slow phases that
last minutes (one core ran 37% slower than the other for a while here), which skews a ratio between
variants measured minutes apart; ``--interleaved`` builds every variant in the same processes and runs
step i of each in turn, so a slow phase slows all alike (peak RSS is then shared and not reported per
variant; piper's own peak of live activations still is).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pp import StageModule, _ce  # noqa: E402
from common import (RankResult, Spec, Summary, add_common_args, best_of, build_gpt, global_batches, load_note,  # noqa: E402
                    peer_adamw, print_ratios, print_table, timed_loop, timed_loops)

from piper_compile.testing.launch import run_local  # noqa: E402

PEERS = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "interleaved_zb": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble", "dualpipe_v": "ScheduleDualPipeV"}
V_SHAPED = {"zbv", "dualpipe_v"}


def local_stages(kind: str, rank: int, ranks: int) -> list[int]:
    """The stages rank ``rank`` holds: V shape (r, 2p-1-r) or round robin (r, r+p)."""
    return [rank, 2 * ranks - 1 - rank] if kind in V_SHAPED else [rank, rank + ranks]


def torch_schedule_csv(kind: str, ranks: int, microbatches: int, path: str) -> None:
    """Write the peer's own per-rank action CSV (planned in this process on the fake process group)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        stages = [PipelineStage(nn.Linear(4, 4), s, 2 * ranks, torch.device("cpu"))
                  for s in local_stages(kind, 0, ranks)]
        getattr(ts, PEERS[kind])(stages, n_microbatches=microbatches, loss_fn=_ce)._dump_csv(path)
    finally:
        dist.destroy_process_group()


def _annotated_gpt(spec: Spec, stages: int) -> nn.Module:
    import piper_compile as piper

    model = build_gpt(spec, untie=True)
    model.annotate_stages(stages)
    piper.annotate(model.wte, PP=0)
    piper.annotate(model.wpe, PP=0)
    piper.annotate(model.ln_f, PP=stages - 1)
    piper.annotate(model.head, PP=stages - 1)
    return model


def piper_step(spec: Spec, directives: list, stages: int, window: int = 8) -> tuple[Callable[[int], Any], Callable]:
    """A piper training step on step ``i``'s batch, and a function giving its counters afterwards."""
    import piper_compile as piper

    model = _annotated_gpt(spec, stages)
    batches = global_batches(model, spec, spec.batch)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": directives, "codegen": spec.codegen, "reorder_window": window,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)})

    def counters() -> dict[str, Any]:
        stats = piper.last_stats(step)
        return {"peak_live_mib": stats.peak_live_bytes / 2**20, "filled": stats.filled}

    return (lambda i: step(*batches[i])), counters


def piper_worker(rank: int, world: int, spec: Spec, directives: list, stages: int, window: int = 8) -> RankResult:
    step, counters = piper_step(spec, directives, stages, window)
    res = timed_loop(step, spec)
    res.extra = counters()
    return res


def pipelining_step(rank: int, world: int, spec: Spec, kind: str, microbatches: int) -> Callable[[int], Any]:
    """The peer's training step (its schedule class, AdamW) on step ``i``'s batch."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    model = build_gpt(spec, untie=True)
    batches = global_batches(model, spec, spec.batch)
    n = 2 * world
    ids = local_stages(kind, rank, world)
    modules = [StageModule(model, s, n) for s in ids]
    stages = [PipelineStage(m, s, n, torch.device("cpu")) for m, s in zip(modules, ids)]
    sched = getattr(ts, PEERS[kind])(stages, n_microbatches=microbatches, loss_fn=_ce)
    params = [p for m in modules for p in m.parameters()]
    opt = peer_adamw(params, spec.lr)
    first, last = 0 in ids, n - 1 in ids

    def step(i: int) -> torch.Tensor | None:
        x, y = batches[i]
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(x, **kwargs) if first else sched.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean() if last else None

    return step


def pipelining_worker(rank: int, world: int, spec: Spec, kind: str, microbatches: int) -> RankResult:
    return timed_loop(pipelining_step(rank, world, spec, kind, microbatches), spec)


def interleaved_worker(rank: int, world: int, spec: Spec, variants: dict[str, tuple]) -> dict[str, RankResult]:
    """Every variant built in these processes and stepped in turn (``timed_loops``). ``variants``: name ->
    ("piper", directives, stages, window) or ("pipelining", kind, microbatches)."""
    import torch._dynamo

    # one compiled model per piper variant: Dynamo counts each as a recompile of the same forward
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(variants))
    steps: dict[str, Callable[[int], Any]] = {}
    counters: dict[str, Callable] = {}
    for name, (system, *a) in variants.items():
        if system == "piper":
            steps[name], counters[name] = piper_step(spec, *a)
        else:
            steps[name] = pipelining_step(rank, world, spec, *a)
    out = timed_loops(steps, spec)
    for name, get in counters.items():
        out[name].extra = get()
    return out


def measure_apart(run: Callable, ranks: int, spec: Spec, plan: dict[str, dict[str, tuple]], base: tuple,
                  rounds: int) -> dict[str, list[RankResult]]:
    """Each variant in fresh processes (its own peak RSS), best of ``rounds`` launches."""
    def launch(how: tuple) -> list[RankResult]:
        system, *a = how
        worker = piper_worker if system == "piper" else pipelining_worker
        return best_of(rounds, functools.partial(run, worker, ranks, spec, *a))

    out = {"piper 1F1B (1 stage/rank)": launch(base)}
    for kind, variants in plan.items():
        print(f"  running {kind} ...", flush=True)
        out.update({name: launch(how) for name, how in variants.items()})
    return out


def measure_interleaved(run: Callable, ranks: int, spec: Spec, plan: dict[str, dict[str, tuple]], base: tuple,
                        rounds: int) -> dict[str, list[RankResult]]:
    """All variants in one process tree, stepped in turn; best of ``rounds`` launches per variant."""
    variants = {"piper 1F1B (1 stage/rank)": base, **{k: v for vs in plan.values() for k, v in vs.items()}}
    launches = [run(interleaved_worker, ranks, spec, variants) for _ in range(max(1, rounds))]
    return {name: min(([per_rank[name] for per_rank in res] for res in launches),
                      key=lambda ranks: Summary.of(ranks).median_ms) for name in variants}


def main() -> None:
    import piper_compile as piper

    S = piper.schedules
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(batch=16)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedules", nargs="+", choices=sorted(PEERS), default=sorted(PEERS))
    p.add_argument("--window-off", action="store_true",
                   help="also run torch's schedule in piper with reorder_window=0 (program order but overlap slots)")
    p.add_argument("--interleaved", action="store_true",
                   help="build every variant in one process tree and step them in turn (A B C A B C ...): ratios "
                        "immune to slow phases of a shared machine; peak RSS is then shared, not per variant")
    args = p.parse_args()
    spec = Spec.from_args(args)
    r, m, n = args.ranks, args.microbatches, 2 * args.ranks
    if spec.model["layers"] < n:
        p.error(f"--layers must be >= {n} (two stages per rank)")
    print(f"bench_schedules: {spec.describe()}, {r} ranks x 2 stages, {m} micro-batches", flush=True)
    print(f"before: {load_note()}")
    run = functools.partial(run_local, timeout_s=args.timeout)
    own = {"interleaved_1f1b": lambda: [*S.round_robin(r, 2), *S.interleaved_1f1b(r, 2, m)],
           "zbv": lambda: S.zbv(r, m), "dualpipe_v": lambda: S.dualpipe_v(r, m)}
    base = ("piper", [*piper.pipeline(r), piper.split(m), *S.one_f_one_b(r, m)], r, 8)
    plan: dict[str, dict[str, tuple]] = {}  # schedule -> variant -> how to build it (see interleaved_worker)
    piper_of: dict[str, str] = {}
    for kind in args.schedules:
        with tempfile.TemporaryDirectory() as tmp:
            torch_schedule_csv(kind, r, m, os.path.join(tmp, "s.csv"))
            same = S.read_csv(os.path.join(tmp, "s.csv"))
        piper_of[kind] = f"piper {kind} (torch's schedule)"
        plan[kind] = {piper_of[kind]: ("piper", [piper.split(m), *same], n, 8)}
        if args.window_off:
            plan[kind][f"piper {kind} (window 0)"] = ("piper", [piper.split(m), *same], n, 0)
        if kind in own:
            plan[kind][f"piper {kind} (piper builder)"] = ("piper", [piper.split(m), *own[kind]()], n, 8)
        plan[kind][f"pipelining {PEERS[kind]}"] = ("pipelining", kind, m)
    measure = measure_interleaved if args.interleaved else measure_apart
    results = measure(run, r, spec, plan, base, args.rounds)
    rows = {kind: {name: Summary.of(results[name]) for name in [*variants, "piper 1F1B (1 stage/rank)"]}
            for kind, variants in plan.items()}
    extras = {name: [x.extra for x in ranks] for name, ranks in results.items() if ranks[0].extra}
    print_table(f"{r} ranks, {m} micro-batches: median step time (slowest rank per step)", rows, piper_of)
    print_ratios(rows, piper_of)
    print("\npiper: peak live activations MiB per rank | steps run early by the reorder window per rank (last step)")
    for name, per_rank in extras.items():
        live = " / ".join(f"{e['peak_live_mib']:.1f}" for e in per_rank)
        filled = " / ".join(str(e["filled"]) for e in per_rank)
        print(f"  {name:<44} {live:<20} | {filled}")
    print(f"after: {load_note()}")


if __name__ == "__main__":
    main()
