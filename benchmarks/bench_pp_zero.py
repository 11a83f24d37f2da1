"""PP2 x DP2 with ZeRO-3 (4 ranks): piper vs ``torch.distributed.pipelining`` + FSDP2 ``fully_shard``.

Layout (both sides): stage 0 on ranks 0 and 2, stage 1 on ranks 1 and 3, so replica r is ranks {2r, 2r+1}:
rank k runs stage ``k % 2`` of replica ``k // 2`` and feeds that replica's local batch.

* piper: ``annotate`` the stages as ``bench_pp.py`` does, then
  ``[*pipeline(2, ranks=[[0, 2], [1, 3]]), replicate({"PP": "*"}, zero=3, bucket_mb=B, prefetch=P), split(M),
  *schedules.one_f_one_b(2, M)]`` with ``options["optimizer"] = AdamW``; one call per step.
* peer: ``bench_pp.StageModule`` (the same hand split: stage 0 = embeddings + its blocks, stage 1 = its blocks
  + ln_f + head) on a 2-D ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))`` (mesh
  [[0, 1], [2, 3]]: the "dp" groups are {0, 2} and {1, 3}, the "pp" groups {0, 1} and {2, 3}, the same
  layout as piper's), ``fully_shard(block, mesh=mesh["dp"])`` per block then on the stage module,
  ``PipelineStage(..., group=mesh.get_group("pp"))`` + ``Schedule1F1B(n_microbatches=M)``, AdamW on the
  stage's (sharded) parameters.

Same GPT as the other benchmarks with the LM head UNTIED (as in ``bench_pp.py``: pipelining cannot share a
weight across stages), same seed, same synthetic batches (global batch = 2 x local batch), gloo on CPU with
1 thread per rank, each variant in freshly spawned processes.

Reported:

1. step time at equal batch (``--batch`` sequences per replica in ``--microbatches`` micro-batches): median of
   the slowest rank's step time after warm-up, ratio piper/peer, peak RSS, tensor ``state``/``peak`` MiB;
2. memory vs micro-batch size: for every size in ``--mb-sizes`` (local batch = size x M), one step at that
   size, then the tensor-level **peak** of one step (``zero_common.tensor_peak``: live tensor bytes at the step
   start + the CPU allocator's net high-water during the step, from ``torch.profiler``'s memory events; max
   over the 4 ranks). That is torch's own allocator accounting, not RSS: RSS also counts Inductor compilation
   and the Python heap, and ``ru_maxrss`` never goes down, so it cannot separate sizes run in one process.
   The largest size whose peak fits ``--budget-mib`` is printed for each side. All sizes run in the same
   processes (piper's ``dynamic=True`` step serves every batch size; the peer builds a new PipelineStage and
   schedule per size because PipelineStage fixes its shapes on the first step).

Does pipelining + fully_shard work on CPU/gloo in torch 2.13? Yes (``benchmarks/check_fsdp_cpu.py`` checks the
replica-mean loss against single-process training). What to know about it:

* ``PipelineStage`` drives FSDP itself (``backward_maybe_with_nosync``): every micro-batch backward runs with
  ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, and one REDUCE_GRAD at the
  end of the step reduce-scatters the accumulated gradients (``perform_reduce_grad``). So during the backward
  phase the peer holds its stage's unsharded parameters and unsharded gradients; it is ZeRO-3 at rest and
  between steps, not within the step.
* ``reshard_after_forward=True`` (ZeRO-3, the default here) re-gathers parameters for every micro-batch forward
  until the first backward; torchtitan defaults to ``False`` under PP for that reason
  (``--peer-reshard-after-forward 0`` runs that).

    python benchmarks/bench_pp_zero.py --only-peers --steps 4 --warmup 2            # peer only
    python benchmarks/bench_pp_zero.py                                              # piper + peer
    python benchmarks/bench_pp_zero.py --mb-sizes 1 2 4 8 16 --budget-mib 96 --codegen eager
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pp import StageModule, _ce, pipelining_step  # noqa: E402
from common import (RankResult, Spec, Summary, add_common_args, best_of, build_gpt, compare_losses,  # noqa: E402
                    global_batches, load_note, peak_rss_mib, peer_adamw, timed_loop)
from zero_common import (block_mib, fmt_ranks, piper_extra, piper_optimizer, piper_replicate, short_error,  # noqa: E402
                         state_breakdown, tensor_peak)

from piper_compile.testing.launch import run_local  # noqa: E402
from piper_compile.testing.models import GPT  # noqa: E402

WORLD, STAGES, DP = 4, 2, 2


class _BatchMaker:
    """``GPT.make_batch`` without the GPT (it only reads ``cfg``)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    make_batch = GPT.make_batch


def _replica(rank: int) -> int:
    return rank // STAGES  # ranks=[[0, 2], [1, 3]]: rank k is stage k % 2 of replica k // 2


def _size_batches(model: Any, spec: Spec, size: int, m: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of DP x (size x M) sequences for the memory sweep (seeded by size)."""
    out = []
    for s in range(n):
        gen = torch.Generator().manual_seed(5000 + 100 * size + s)
        out.append(model.make_batch(DP * size * m, gen))
    return out


def _slice(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    n = x.shape[0] // DP
    r = _replica(rank)
    return x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]


def _sweep(make_run: Any, model: Any, spec: Spec, m: int, sizes: list[int]) -> dict[str, Any]:
    """For each micro-batch size: one step at that size, then the tensor peak of one step (two profiled)."""
    peaks: dict[int, float] = {}
    rss: dict[int, float] = {}
    for size in sizes:
        batches = _size_batches(model, spec, size, m, 3)
        run = make_run(batches, size)
        run(0)
        peaks[size] = tensor_peak(run, 1)["peak"]
        rss[size] = round(peak_rss_mib(), 0)
    return {"sweep_peak": peaks, "sweep_rss": rss}


def piper_worker(rank: int, world: int, spec: Spec, m: int, sizes: list[int], bucket_mb: float, prefetch: int,
                 mem: bool, per_mb: bool = False) -> RankResult:
    import piper_compile as piper

    model = build_gpt(spec, untie=True)
    batches = global_batches(model, spec, DP * spec.batch)
    model.annotate_stages(STAGES)
    piper.annotate(model.wte, PP=0)
    piper.annotate(model.wpe, PP=0)
    piper.annotate(model.ln_f, PP=STAGES - 1)
    piper.annotate(model.head, PP=STAGES - 1)
    directives = [*piper.pipeline(STAGES, ranks=[[0, 2], [1, 3]]),
                  piper_replicate({"PP": "*"}, 3, bucket_mb, prefetch,
                                  **({"reduce_per_microbatch": True} if per_mb else {})),
                  piper.split(m), *piper.schedules.one_f_one_b(STAGES, m)]
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": directives, "codegen": spec.codegen,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)})

    def make_run(bs: list[tuple[torch.Tensor, torch.Tensor]], _size: int = 0) -> Any:
        return lambda i: step(*_slice(bs[i % len(bs)], rank))

    run = make_run(batches)
    res = timed_loop(run, spec)  # piper returns the global mean loss on every rank
    res.extra = piper_extra(step)
    res.extra["state_breakdown"] = state_breakdown(list(model.parameters()), piper_optimizer(step))
    if mem:
        res.extra.update(tensor_peak(run, spec.warmup + spec.steps))
        res.extra.update(_sweep(make_run, model, spec, m, sizes))
    return res


def pipelining_worker(rank: int, world: int, spec: Spec, m: int, sizes: list[int], reshard_after_forward: bool,
                      mem: bool) -> RankResult:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (DP, STAGES), mesh_dim_names=("dp", "pp"))
    stage_idx = mesh.get_local_rank("pp")
    assert stage_idx == rank % STAGES and mesh.get_local_rank("dp") == _replica(rank), "unexpected mesh layout"
    model = build_gpt(spec, untie=True)
    batches = global_batches(model, spec, DP * spec.batch)
    module = StageModule(model, stage_idx, STAGES)
    model = _BatchMaker(model.cfg)  # drop the other stage's modules: only this stage's stay alive (as bench_pp)
    for block in module.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    opt = peer_adamw(module.parameters(), spec.lr)
    first, last = stage_idx == 0, stage_idx == STAGES - 1
    pp_group = mesh.get_group("pp")

    def make_run(bs: list[tuple[torch.Tensor, torch.Tensor]], _size: int = 0) -> Any:
        stage = PipelineStage(module, stage_idx, STAGES, torch.device("cpu"), group=pp_group)
        sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=_ce)

        def run(i: int) -> torch.Tensor | None:
            return pipelining_step(sched, opt, *_slice(bs[i % len(bs)], rank), first, last)
        return run

    run = make_run(batches)
    res = timed_loop(run, spec)
    mean = torch.nan_to_num(torch.tensor(res.losses), nan=0.0)
    dist.all_reduce(mean)  # the last stage's replica means, summed over replicas: the global mean x DP
    res.losses = (mean / DP).tolist()
    res.extra["state_breakdown"] = state_breakdown(list(module.parameters()), opt)
    if mem:
        res.extra.update(tensor_peak(run, spec.warmup + spec.steps))
        res.extra.update(_sweep(make_run, model, spec, m, sizes))
    return res


def _max_over(ranks: list[RankResult], key: str) -> float:
    vals = [r.extra.get(key, float("nan")) for r in ranks]
    return max(vals) if all(v == v for v in vals) else float("nan")


def _sweep_max(ranks: list[RankResult] | None, sizes: list[int]) -> dict[int, float]:
    if ranks is None or "sweep_peak" not in ranks[0].extra:
        return {}
    return {s: max(r.extra["sweep_peak"][s] for r in ranks) for s in sizes}


def _largest(peaks: dict[int, float], budget: float) -> str:
    fits = [s for s, v in peaks.items() if v == v and v <= budget]
    if not peaks:
        return "n/a"
    return str(max(fits)) if fits else f"none (smallest tried {min(peaks)} needs {peaks[min(peaks)]:.1f} MiB)"


def _details(ours: list[RankResult] | None, theirs: list[RankResult]) -> None:
    """Per-rank figures of both sides, and the loss check."""
    print("\n== details (per rank; tensor MiB: see zero_common.py)")
    for name, ranks in (("piper", ours), ("peer", theirs)):
        if ranks is None:
            continue
        s = Summary.of(ranks)
        print(f"  {name}: median {s.median_ms:.1f} p90 {s.p90_ms:.1f} cpu {s.cpu_ms:.1f} ms, first step "
              f"{s.first_s:.1f} s, RSS/rank {fmt_ranks(s.rss)} ({fmt_ranks(s.growth, '{:+.0f}')}) MiB")
        for r, rr in enumerate(ranks):
            print(f"    {name} rank {r} (stage {r % STAGES}): {rr.extra}")
    if ours is not None:
        compare_losses("global mean loss piper vs peer", ours[0].losses, theirs[0].losses)


def _print_sweep(ours: list[RankResult] | None, theirs: list[RankResult], sizes: list[int], m: int,
                 budget_mib: float, err: str) -> None:
    """The tensor peak by micro-batch size, and the largest micro-batch that fits the budget."""
    pk_ours, pk_theirs = _sweep_max(ours, sizes), _sweep_max(theirs, sizes)
    print(f"tensor peak per rank (MiB, max over ranks) by micro-batch size (local batch = size x {m}):")
    print("  size        " + "".join(f"{s:>9}" for s in sizes))
    if pk_ours:
        print("  piper       " + "".join(f"{pk_ours[s]:>9.1f}" for s in sizes))
    print("  peer        " + "".join(f"{pk_theirs[s]:>9.1f}" for s in sizes))
    print(f"budget {budget_mib:.0f} MiB/rank: largest micro-batch that fits: piper "
          f"{_largest(pk_ours, budget_mib) if ours is not None else '- (' + err + ')'}, peer "
          f"{_largest(pk_theirs, budget_mib)} (sizes tried: {' '.join(map(str, sizes))})")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (M)")
    p.add_argument("--mb-sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="micro-batch sizes (sequences) for the memory sweep; local batch = size x M")
    p.add_argument("--budget-mib", type=float, default=64.0,
                   help="per-rank budget on the tensor-level peak (MiB) for the largest-micro-batch figure")
    p.add_argument("--only-peers", action="store_true", help="run only the pipelining + FSDP2 peer")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="piper replicate(bucket_mb=...); default: one transformer block's parameter MiB (the "
                        "peer's FSDP2 unit, fully_shard per block)")
    p.add_argument("--prefetch", type=int, default=1, help="piper replicate(prefetch=...)")
    p.add_argument("--reduce-per-microbatch", action="store_true",
                   help="piper replicate(reduce_per_microbatch=True): reduce-scatter after every micro-batch")
    p.add_argument("--peer-reshard-after-forward", type=int, choices=[0, 1], default=1,
                   help="fully_shard(reshard_after_forward=...) for the peer (1 = ZeRO-3)")
    p.add_argument("--no-mem", action="store_true", help="skip the profiled steps and the micro-batch sweep")
    args = p.parse_args()
    if args.batch % args.microbatches:
        p.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    return args


def main() -> None:
    args = _args()
    spec = Spec.from_args(args)
    m = args.microbatches
    sizes = sorted(set(args.mb_sizes))
    mem = not args.no_mem
    raf = bool(args.peer_reshard_after_forward)
    bucket_mb = args.bucket_mb if args.bucket_mb is not None else round(block_mib(spec), 2)
    peer = f"pipelining Schedule1F1B + FSDP2 (reshard_after_forward={raf})"
    print(f"bench_pp_zero: PP{STAGES} x DP{DP} on {WORLD} ranks, 1F1B, {m} micro-batches, {spec.describe()} "
          f"(local batch per replica; head untied), piper replicate(zero=3, bucket_mb={bucket_mb}, "
          f"prefetch={args.prefetch}), {os.cpu_count()} CPU cores{' (PEERS ONLY)' if args.only_peers else ''}",
          flush=True)
    print(f"before: {load_note()}")
    print(f"  running {peer} ...", flush=True)
    theirs = best_of(args.rounds, functools.partial(run_local, pipelining_worker, WORLD, spec, m, sizes, raf, mem,
                                                    timeout_s=args.timeout))
    ours: list[RankResult] | None = None
    err = "not run (--only-peers)"
    if not args.only_peers:
        print(f"  running piper 1f1b + replicate(zero=3) ({spec.codegen}) ...", flush=True)
        try:
            ours = best_of(args.rounds, functools.partial(run_local, piper_worker, WORLD, spec, m, sizes,
                                                          bucket_mb, args.prefetch, mem,
                                                          args.reduce_per_microbatch, timeout_s=args.timeout))
        except Exception as e:  # noqa: BLE001 - report and keep the peer's numbers
            err = f"FAILED: {type(e).__name__}"
            print(f"  piper failed:\n{short_error(e)}", flush=True)

    ps = Summary.of(theirs)
    _details(ours, theirs)
    mb = spec.batch // m
    print(f"\n== PP{STAGES} x DP{DP} ZeRO-3, 1F1B, M={m}, local batch {spec.batch} (micro-batch {mb}), "
          f"{spec.steps} timed steps; peer = {peer}")
    if ours is not None:
        s = Summary.of(ours)
        print(f"pp2xdp2 zero3  piper {s.median_ms:.1f} ms  peer {ps.median_ms:.1f} ms  ratio piper/peer "
              f"{s.median_ms / ps.median_ms:.2f}  peakRSS piper {max(s.rss):.0f} MiB peer {max(ps.rss):.0f} MiB"
              f"  | cpu ratio {s.cpu_ms / ps.cpu_ms:.2f}, tensor state piper {_max_over(ours, 'state'):.1f} peer "
              f"{_max_over(theirs, 'state'):.1f} MiB, tensor peak piper {_max_over(ours, 'peak'):.1f} peer "
              f"{_max_over(theirs, 'peak'):.1f} MiB")
    else:
        print(f"pp2xdp2 zero3  piper - ms  peer {ps.median_ms:.1f} ms  ratio piper/peer -  peakRSS piper - MiB "
              f"peer {max(ps.rss):.0f} MiB  | tensor state peer {_max_over(theirs, 'state'):.1f} MiB, tensor peak "
              f"peer {_max_over(theirs, 'peak'):.1f} MiB; piper {err}")
    if mem:
        _print_sweep(ours, theirs, sizes, m, args.budget_mib, err)
    print(f"after: {load_note()}")


if __name__ == "__main__":
    main()
