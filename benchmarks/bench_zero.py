"""ZeRO-1/2/3: piper ``replicate(zero=N)`` vs the PyTorch-native peer of each stage.

    zero1  piper replicate(zero=1)  vs  DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    zero2  piper replicate(zero=2)  vs  FSDP2 fully_shard(..., reshard_after_forward=False)
    zero3  piper replicate(zero=3)  vs  FSDP2 fully_shard(..., reshard_after_forward=True)
   (zero0  piper replicate()        vs  DDP + AdamW, with --baseline)

Same GPT as ``bench_dp.py`` (``piper_compile.testing.models.GPT`` via ``common.build_gpt``: tied embedding,
same seed and weights on every rank), AdamW, same local batch per rank, same synthetic batches, gloo on CPU
with 1 thread per rank (``OMP_NUM_THREADS=1``), every variant in freshly spawned processes. One piper call is
one training step; the peers do ``loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()``.
FSDP2 is applied as torchtitan does: ``fully_shard`` on every transformer block, then on the root (which then
holds the embeddings, the tied head, ln_f).

Per pair one line ``zeroN  piper X ms  peer Y ms  ratio piper/peer Z  peakRSS piper A MiB peer B MiB`` (median
of the slowest rank's step time over the timed steps after warm-up, see ``common.py``; peak RSS is the
largest rank's ``ru_maxrss``), followed by the tensor-level figures per rank (max over ranks):

* ``state``: tensor bytes reachable between two steps (params + persistent grads + optimizer state + buffers);
* ``peak``: that + the CPU allocator's net high-water during one step (``torch.profiler`` memory events).

Both are defined precisely in ``zero_common.py``. Peak RSS also counts Inductor/Dynamo compilation (piper
compiles its segments with Inductor, the peers run eagerly), so compare memory on ``state``/``peak``.

Peer configuration notes (torch 2.13, CPU, gloo; checked by ``benchmarks/check_fsdp_cpu.py``):

* FSDP2 (``torch.distributed.fsdp.fully_shard``) works on CPU over gloo with a 1-D ``init_device_mesh("cpu",
  (world,))``: per-step losses equal single-process training on the global batch. Nothing had to be changed.
* FSDP2 has no exact ZeRO-2. ``reshard_after_forward=False`` keeps each group's parameters unsharded from its
  forward through its backward (no second all-gather) and reduce-scatters gradients, but still reshards them
  after backward, so between steps it holds only parameter shards (true ZeRO-2 keeps full parameters).
  ``set_reshard_after_backward(False)`` is not a substitute: the next forward would skip the all-gather and
  read stale parameters (it exists for gradient accumulation within one step). So ``zero2`` vs FSDP2 differs
  in what is persistent; compare the ``peak`` column, where both hold full parameters during the step.
* The root module is never resharded after forward by FSDP2 (it is needed first in backward) even with
  ``reshard_after_forward=True``.
* DDP uses ``gradient_as_bucket_view=True`` and ``zero_grad(set_to_none=False)`` (its grads stay views of its
  buckets, so the ``state`` figure sees them); the FSDP2 peers use ``zero_grad()`` (set_to_none).

piper's bucket size: ``--bucket-mb`` (default 25 MB for zero1, as DDP's ``bucket_cap_mb``; for zero2/3 the
parameter MiB of one transformer block, 3.02 for dim 256, so piper gathers and reduce-scatters in the same
units as FSDP2 applied per block; with one 25 MB bucket the whole 13 MiB model is a single unit and a ZeRO-3
step gathers all of it at once).

``--precision bf16`` (ZeRO-2/3 only: FSDP2 is the peer with a precision policy) trains with bf16 compute
and fp32 master weights on both sides: piper ``mixed_precision={"param_dtype": "bf16", "reduce_dtype": R}``
vs FSDP2 ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=R))``, for each
``--reduce`` dtype R (fp32 and bf16 by default). Loss curves then differ by bf16 rounding (the two round
at different points), so their check uses a 2% tolerance.

``--only-peers`` runs just the peers; without it, a piper failure (e.g. the directive not implemented yet)
prints the error and the peers' numbers still print.

    python benchmarks/bench_zero.py --only-peers --steps 5 --warmup 2           # peers only, world 2
    python benchmarks/bench_zero.py --world 2 4                                  # piper + peers
    python benchmarks/bench_zero.py --zero 3 --codegen eager --bucket-mb 4 --prefetch 1
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RankResult, Spec, Summary, add_common_args, best_of, build_gpt, compare_losses,  # noqa: E402
                    eager_dp_step, global_batches, load_note, local_batch, peer_adamw, peer_fused_kwargs,
                    timed_loop, to_global_mean)
from zero_common import (block_mib, print_report, fmt_ranks, piper_extra, piper_optimizer, piper_replicate, short_error,  # noqa: E402
                         mem_figure, ratio_line, state_breakdown, tensor_peak)

from piper_compile.testing.launch import run_local  # noqa: E402

PEER_NAMES = {0: "DDP+AdamW", 1: "DDP+ZeroRedundancyOptimizer", 2: "FSDP2 reshard_after_forward=False",
              3: "FSDP2 reshard_after_forward=True"}


def _finish(res: RankResult, run: Any, params: list[torch.nn.Parameter], opt: Any, spec: Spec, mem: bool) -> None:
    """After the timed steps: the between-steps breakdown, then two profiled steps for the tensor peak."""
    res.extra["state_breakdown"] = state_breakdown(params, opt)
    if mem:
        res.extra.update(tensor_peak(run, spec.warmup + spec.steps))


def piper_worker(rank: int, world: int, spec: Spec, zero: int, bucket_mb: float, prefetch: int,
                 mem: bool, reduce: str | None = None) -> RankResult:
    import piper_compile as piper

    model = build_gpt(spec)
    batches = global_batches(model, spec, world * spec.batch)
    directive = piper_replicate(None, zero, bucket_mb, prefetch)
    options: dict[str, Any] = {"codegen": spec.codegen, "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)}
    if reduce is not None:  # --precision bf16
        options["mixed_precision"] = {"param_dtype": "bf16", "reduce_dtype": reduce}
    step = piper.compile(model, directives=[directive], **options)

    def run(i: int) -> torch.Tensor:
        return step(*local_batch(batches, i, rank, spec.batch))

    res = timed_loop(run, spec)
    res.extra = piper_extra(step)
    _finish(res, run, list(model.parameters()), piper_optimizer(step), spec, mem)
    return res


def peer_worker(rank: int, world: int, spec: Spec, zero: int, mem: bool, reduce: str | None = None) -> RankResult:
    model = build_gpt(spec)
    batches = global_batches(model, spec, world * spec.batch)
    adamw = functools.partial(peer_adamw, lr=spec.lr)
    if zero <= 1:
        net: torch.nn.Module = DDP(model, gradient_as_bucket_view=True)  # broadcasts rank 0's weights
        if zero == 0:
            opt: Any = adamw(net.parameters())
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=spec.lr,
                                          **peer_fused_kwargs())
        set_to_none = False
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy() if reduce is None else MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16 if reduce == "bf16" else torch.float32)
        for block in model.blocks:  # torchtitan: every transformer block, then the root
            fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=mp)
        net, opt, set_to_none = model, adamw(model.parameters()), True

    run = eager_dp_step(net, opt, batches, rank, spec.batch, set_to_none)
    res = to_global_mean(timed_loop(run, spec), world)
    _finish(res, run, list(model.parameters()), opt, spec, mem)
    return res


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--world", type=int, nargs="+", default=[2], help="gloo ranks (one process each), e.g. 2 4")
    p.add_argument("--zero", type=int, nargs="+", choices=[1, 2, 3], default=[1, 2, 3], help="ZeRO stages to run")
    p.add_argument("--baseline", action="store_true", help="also zero0: piper replicate() vs DDP+AdamW")
    p.add_argument("--only-peers", action="store_true", help="run only the PyTorch peers (no piper)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="piper replicate(bucket_mb=...); default: 25 (DDP's bucket_cap_mb) for zero0/1, one "
                        "transformer block's parameter MiB for zero2/3 (FSDP2's unit, fully_shard per block)")
    p.add_argument("--prefetch", type=int, default=1, help="piper replicate(prefetch=...) (zero=3)")
    p.add_argument("--no-mem", action="store_true", help="skip the two profiled steps (tensor peak)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: bf16 compute, fp32 master weights on both sides (ZeRO-2/3 vs FSDP2 + MixedPrecisionPolicy)")
    p.add_argument("--reduce", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"],
                   help="with --precision bf16: the reduce_dtype of each variant")
    args = p.parse_args()
    if args.precision == "bf16":
        args.zero = [z for z in args.zero if z >= 2]
        args.baseline = False
    return args


def _run_piper(args: argparse.Namespace, spec: Spec, world: int, zero: int, bucket_mb: float, mem: bool,
               reduce: str | None) -> tuple[list[RankResult] | None, str]:
    """piper's side of one variant: its ranks' results, or None and why not."""
    if args.only_peers:
        return None, "not run (--only-peers)"
    print(f"  running world {world} zero{zero}: piper replicate(zero={zero}) ({spec.codegen}) ...", flush=True)
    try:
        return best_of(args.rounds, functools.partial(run_local, piper_worker, world, spec, zero, bucket_mb,
                                                      args.prefetch, mem, reduce, timeout_s=args.timeout)), ""
    except Exception as e:  # noqa: BLE001 - report and keep the peers' numbers
        print(f"  piper zero={zero} world {world} failed:\n{short_error(e)}", flush=True)
        return None, f"FAILED: {type(e).__name__}"


def _report(tag: str, peer: str, world: int, ours: list[RankResult] | None, theirs: list[RankResult], err: str,
            reduce: str | None, details: list[str]) -> str:
    """The variant's line of the report (``details`` gets its per-rank lines and the loss check)."""
    ps = Summary.of(theirs)
    rss_peer = max(ps.rss)
    if ours is not None:
        s = Summary.of(ours)
        line = f"{tag}  {ratio_line(ours, theirs, 'peer')}; world {world}; peer = {peer}"
        details.append(f"  world {world} {tag} piper: median {s.median_ms:.1f} p90 {s.p90_ms:.1f} "
                       f"cpu {s.cpu_ms:.1f} ms, first step {s.first_s:.1f} s, RSS/rank "
                       f"{fmt_ranks(s.rss)} ({fmt_ranks(s.growth, '{:+.0f}')}) MiB")
        details.extend(f"    piper rank {r}: {rr.extra}" for r, rr in enumerate(ours))
        ok = compare_losses(f"world {world} {tag} loss piper vs {peer}", ours[0].losses,
                            theirs[0].losses, rtol=2e-2 if reduce else 1e-4)
        details.append(f"    loss check: {'OK' if ok else 'MISMATCH'}")
    else:
        line = (f"{tag}  piper - ms  peer {ps.median_ms:.1f} ms  ratio piper/peer -  peakRSS piper - MiB "
                f"peer {rss_peer:.0f} MiB  | world {world}, tensor state peer {mem_figure(theirs, 'state')} MiB, "
                f"tensor peak peer {mem_figure(theirs, 'peak')} MiB; peer = {peer}; piper {err}")
    details.append(f"  world {world} {tag} {peer}: median {ps.median_ms:.1f} p90 {ps.p90_ms:.1f} "
                   f"cpu {ps.cpu_ms:.1f} ms, first step {ps.first_s:.1f} s, RSS/rank {fmt_ranks(ps.rss)} "
                   f"({fmt_ranks(ps.growth, '{:+.0f}')}) MiB")
    details.extend(f"    peer rank {r}: state {rr.extra.get('state_breakdown')} peak {rr.extra.get('peak')} MiB"
                   for r, rr in enumerate(theirs))
    return line


def main() -> None:
    args = _args()
    spec = Spec.from_args(args)
    mem = not args.no_mem
    stages = ([0] if args.baseline else []) + sorted(set(args.zero))
    block_mb = round(block_mib(spec), 2)
    bucket_of = {z: args.bucket_mb if args.bucket_mb is not None else (25.0 if z <= 1 else block_mb) for z in stages}
    print(f"bench_zero: {spec.describe()}, {os.cpu_count()} CPU cores; piper bucket_mb by stage "
          f"{ {f'zero{z}': round(b, 2) for z, b in bucket_of.items()} } "
          f"prefetch={args.prefetch}{' (PEERS ONLY)' if args.only_peers else ''}", flush=True)
    print(f"before: {load_note()}")
    lines: list[str] = []
    details: list[str] = []
    variants = [(z, r) for z in stages for r in args.reduce] if args.precision == "bf16" else [(z, None) for z in stages]
    for world in args.world:
        peer_losses: dict[str, list[float]] = {}
        for zero, reduce in variants:
            peer = PEER_NAMES[zero] + (f" MixedPrecisionPolicy(bf16, reduce {reduce})" if reduce else "")
            tag = f"zero{zero}" + (f" bf16 reduce-{reduce}" if reduce else "")
            print(f"  running world {world} zero{zero}: {peer} ...", flush=True)
            theirs = best_of(args.rounds, functools.partial(run_local, peer_worker, world, spec, zero, mem, reduce,
                                                            timeout_s=args.timeout))
            peer_losses[tag] = theirs[0].losses
            ours, err = _run_piper(args, spec, world, zero, bucket_of[zero], mem, reduce)
            lines.append(_report(tag, peer, world, ours, theirs, err, reduce, details))
            print("  " + lines[-1], flush=True)
        ref = min(peer_losses)  # the peers train the same model on the same batches: they must agree
        for tag, losses in peer_losses.items():
            if tag != ref:
                compare_losses(f"world {world} loss {tag} vs {ref} (peers)", losses, peer_losses[ref],
                               rtol=2e-2 if args.precision == "bf16" else 1e-4)
    print_report(details, f"ZeRO: piper vs peer, median step time of the slowest rank ({spec.steps} timed steps)", lines)


if __name__ == "__main__":
    main()
