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
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pp import StageModule, _ce  # noqa: E402
from common import (RankResult, Spec, Summary, add_common_args, best_of, build_gpt, global_batches, load_note,  # noqa: E402
                    peer_adamw, print_ratios, print_table, timed_loop)

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


def piper_worker(rank: int, world: int, spec: Spec, directives: list, stages: int) -> RankResult:
    import piper_compile as piper

    model = _annotated_gpt(spec, stages)
    batches = global_batches(model, spec, spec.batch)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": directives, "codegen": spec.codegen,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)})
    res = timed_loop(lambda i: step(*batches[i]), spec)
    res.extra = {"peak_live_mib": round(piper.last_stats(step).peak_live_bytes / 2**20, 1)}
    return res


def pipelining_worker(rank: int, world: int, spec: Spec, kind: str, microbatches: int) -> RankResult:
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

    return timed_loop(step, spec)


def main() -> None:
    import piper_compile as piper

    S = piper.schedules
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(batch=16)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedules", nargs="+", choices=sorted(PEERS), default=sorted(PEERS))
    args = p.parse_args()
    spec = Spec.from_args(args)
    r, m, n = args.ranks, args.microbatches, 2 * args.ranks
    if spec.model["layers"] < n:
        p.error(f"--layers must be >= {n} (two stages per rank)")
    print(f"bench_schedules: {spec.describe()}, {r} ranks x 2 stages, {m} micro-batches", flush=True)
    print(f"before: {load_note()}")
    run = functools.partial(run_local, timeout_s=args.timeout)
    rows: dict[str, dict[str, Summary]] = {}
    piper_of: dict[str, str] = {}
    own = {"interleaved_1f1b": lambda: [*S.round_robin(r, 2), *S.interleaved_1f1b(r, 2, m)],
           "zbv": lambda: S.zbv(r, m), "dualpipe_v": lambda: S.dualpipe_v(r, m)}
    base = Summary.of(best_of(args.rounds, functools.partial(
        run, piper_worker, r, spec, [*piper.pipeline(r), piper.split(m), *S.one_f_one_b(r, m)], r)))
    for kind in args.schedules:
        rows[kind] = {}
        with tempfile.TemporaryDirectory() as tmp:
            torch_schedule_csv(kind, r, m, os.path.join(tmp, "s.csv"))
            same = S.read_csv(os.path.join(tmp, "s.csv"))
        print(f"  running {kind} ...", flush=True)
        name = f"piper {kind} (torch's schedule)"
        rows[kind][name] = Summary.of(best_of(args.rounds, functools.partial(
            run, piper_worker, r, spec, [piper.split(m), *same], n)))
        piper_of[kind] = name
        if kind in own:
            rows[kind][f"piper {kind} (piper builder)"] = Summary.of(best_of(args.rounds, functools.partial(
                run, piper_worker, r, spec, [piper.split(m), *own[kind]()], n)))
        rows[kind][f"pipelining {PEERS[kind]}"] = Summary.of(best_of(args.rounds, functools.partial(
            run, pipelining_worker, r, spec, kind, m)))
        rows[kind]["piper 1F1B (1 stage/rank)"] = base
    print_table(f"{r} ranks, {m} micro-batches: median step time (slowest rank per step)", rows, piper_of)
    print_ratios(rows, piper_of)
    print(f"after: {load_note()}")


if __name__ == "__main__":
    main()
