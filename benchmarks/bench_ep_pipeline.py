"""PP2 x EP2 on 4 ranks: piper DualPipeV vs piper 1F1B and ``torch.distributed.pipelining`` DualPipeV, one MoE GPT.

Two pipeline ranks, each a group of two ranks that shards the experts of its stages (``shard``) and
replicates the dense weights (``replicate``); ``layers`` MoE blocks. 1F1B: 2 stages of ``layers/2`` blocks,
one per group. DualPipeV: 4 stages of ``layers/4`` blocks on the V (groups hold stages 0+3 and 1+2), with
overlap slots where the F of one micro-batch runs beside the B of another, so one chain's expert
all-to-all is in flight while the other computes. Same micro-batches, AdamW, gloo, 1 thread per rank.

The DeepSeek paper reports DualPipe >= 6% faster than 1F1B where communication is a real share of the
step; ``DualPipeV / 1F1B`` below 0.94 meets that. On loopback a transfer is a memcpy on the cores that
compute, and 4 ranks on 2 cores make the step CPU-bound (sum of the ranks' CPU / 2 ~ wall), so there is
no communication to hide: run it under ``emulated_link.py --per-rank 4`` (one rate-limited link per rank)
to give communication its share, e.g.

    python benchmarks/emulated_link.py --rate 150mbit --per-rank 4 --probe -- python benchmarks/bench_ep_pipeline.py

The peer (``ep_pipelining.py``): ``torch.distributed.pipelining``'s ``ScheduleDualPipeV`` on the same model, split
into the same 4 V-stages on the same ranks (pipelines ``[0, 2]`` and ``[1, 3]``, EP/DP pairs ``[0, 1]`` and
``[2, 3]``), the same micro-batches and AdamW; experts through ``bench_ep.EPMoE`` (``E/2`` per rank,
``all_to_all_single``), dense gradients averaged over the pair. It runs eager (piper: ``--codegen``). Its losses
must match piper's DualPipeV (rtol 1e-4); ``--check`` compares the peer with single-process eager training on
the global batch instead (no piper, a few seconds). ``--peers zbv`` adds ``ScheduleZBVZeroBubble``.

    python benchmarks/bench_ep_pipeline.py                      # 4 layers, 8 micro-batches
    python benchmarks/bench_ep_pipeline.py --layers 8 --microbatches 8
    python benchmarks/bench_ep_pipeline.py --check              # the peer vs single-process eager
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_pipelining  # noqa: E402
from common import (RankResult, Spec, Summary, add_common_args, best_of, compare_losses, global_batches,  # noqa: E402
                    load_note, print_ratios, print_table, timed_loop)
from zero_common import short_error  # noqa: E402

from piper_compile.testing.launch import run_local  # noqa: E402
from piper_compile.testing.models import build_model  # noqa: E402

GROUPS = [[0, 1], [2, 3]]


def directives(kind: str, microbatches: int) -> tuple[list, int]:
    """(directives, stages) for PP2 x EP2 with ``kind`` = 1f1b | dualpipe_v."""
    import piper_compile as piper

    S = piper.schedules
    if kind == "1f1b":
        sched, stages = [*piper.pipeline(2, ranks=GROUPS), *S.one_f_one_b(2, microbatches)], 2
    else:
        sched, stages = S.dualpipe_v(2, microbatches, groups=GROUPS), 4
    return [piper.split(microbatches), *sched, piper.replicate({"PP": "*"}), piper.shard({"EP": "*"})], stages


def worker(rank: int, world: int, spec: Spec, kind: str, microbatches: int, experts: int) -> RankResult:
    import piper_compile as piper

    d, stages = directives(kind, microbatches)
    model = build_model("moegpt", spec.seed, experts=experts, **spec.model)
    model.annotate_stages(stages)  # type: ignore[operator]
    batches = global_batches(model, spec, 2 * spec.batch)  # type: ignore[arg-type]
    _, rep = ep_pipelining.position(rank, GROUPS)  # data/expert replica: which half of the global batch
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": d, "codegen": spec.codegen,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)})

    def run(i: int) -> torch.Tensor:
        x, y = batches[i]
        sl = slice(rep * spec.batch, (rep + 1) * spec.batch)
        return step(x[sl], y[sl])

    res = timed_loop(run, spec)
    stats = piper.last_stats(step)
    res.extra = {"collectives": dict(stats.collectives), "reordered": stats.reordered}
    return res


def run_piper(a: argparse.Namespace, spec: Spec, kind: str) -> list[RankResult]:
    """piper's ``kind`` (1f1b | dualpipe_v), best of ``--rounds`` launches."""
    print(f"  running piper {kind} ...", flush=True)
    ranks = best_of(a.rounds, lambda: run_local(worker, 4, spec, kind, a.microbatches, a.experts, timeout_s=a.timeout))
    print(f"    rank 0 per-step collectives {ranks[0].extra}")
    return ranks


def run_peer(a: argparse.Namespace, spec: Spec, kind: str) -> list[RankResult] | None:
    """The pipelining peer, or None after printing why it failed (the piper rows are still reported)."""
    name = ep_pipelining.SCHEDULES[kind]
    print(f"  running pipelining {name} ...", flush=True)
    try:
        return best_of(a.rounds, lambda: run_local(ep_pipelining.worker, 4, spec, GROUPS, kind, a.microbatches,
                                                   a.experts, timeout_s=a.timeout))
    except Exception as e:  # noqa: BLE001 - a failing peer is a result to report, not a crash
        print(f"  pipelining {name}: FAILED ({type(e).__name__}):\n{short_error(e, 24)}", flush=True)
        return None


def check(a: argparse.Namespace, spec: Spec) -> bool:
    """The pipelining peer vs single-process eager MoEGPT on the global batch (3 AdamW steps)."""
    spec = dataclasses.replace(spec, warmup=0, steps=3)
    print(f"--check: the pipelining peer vs single-process eager on the global batch, {spec.steps} AdamW steps")
    truth = single_process(spec, a.experts, len(GROUPS[0]) * spec.batch)
    ok = True
    for kind in a.peers:
        ranks = run_local(ep_pipelining.worker, 4, spec, GROUPS, kind, a.microbatches, a.experts,
                          timeout_s=a.timeout)
        ok &= compare_losses(f"pipelining {ep_pipelining.SCHEDULES[kind]} vs single-process eager",
                             ranks[0].losses, truth, rtol=1e-5)
    return ok


def single_process(spec: Spec, experts: int, n: int) -> list[float]:
    """Eager MoEGPT (one process, all experts) on the ``n``-sequence global batches, AdamW: loss per step."""
    model = build_model("moegpt", spec.seed, experts=experts, **spec.model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    losses = []
    for x, y in global_batches(model, spec, n):  # type: ignore[arg-type]
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--peers", nargs="*", choices=sorted(ep_pipelining.SCHEDULES), default=["dualpipe_v"],
                   help="torch.distributed.pipelining schedules to run beside piper (none: --peers)")
    p.add_argument("--check", action="store_true",
                   help="only compare the pipelining peer(s) with single-process eager training (3 steps) and exit")
    p.set_defaults(layers=4, seq=64, batch=8, dim=128)
    a = p.parse_args()
    spec = Spec.from_args(a)
    print(f"bench_ep_pipeline: PP2 x EP2 on 4 gloo ranks, MoE {spec.describe()}, experts={a.experts} top-2, "
          f"{a.microbatches} micro-batches; {load_note()}", flush=True)
    if a.check:
        sys.exit(0 if check(a, spec) else 1)
    rows: dict[str, dict[str, Summary]] = {"PP2xEP2": {}}
    losses = {}
    for kind in ("1f1b", "dualpipe_v"):
        ranks = run_piper(a, spec, kind)
        rows["PP2xEP2"][f"piper {kind}"] = Summary.of(ranks)
        losses[kind] = ranks[0].losses
    for kind in a.peers:
        ranks_ = run_peer(a, spec, kind)
        if ranks_ is not None:
            rows["PP2xEP2"][f"pipelining {ep_pipelining.SCHEDULES[kind]}"] = Summary.of(ranks_)
            losses[kind + " (pipelining)"] = ranks_[0].losses  # rank 0 holds the last stage: global mean loss
    print_table("PP2 x EP2 (median step time of the slowest rank)", rows, {"PP2xEP2": "piper dualpipe_v"})
    print_ratios(rows, {"PP2xEP2": "piper dualpipe_v"})
    print("losses (rank 0, global mean per step, warm-up included):")
    for name, curve in losses.items():
        print(f"  {name:<26} " + " ".join(f"{x:.6f}" for x in curve))
    compare_losses("piper 1F1B vs piper DualPipeV", losses["1f1b"], losses["dualpipe_v"])
    for kind in a.peers:
        if kind + " (pipelining)" in losses:
            compare_losses(f"piper DualPipeV vs pipelining {ep_pipelining.SCHEDULES[kind]}", losses["dualpipe_v"],
                           losses[kind + " (pipelining)"])
    print(f"after: {load_note()}")


if __name__ == "__main__":
    main()
