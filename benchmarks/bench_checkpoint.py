"""Activation checkpointing: piper's ``checkpoint`` directive vs FSDP2 + torch's own activation checkpointing.

For every checkpoint policy P (``none``, ``full``, ``selective``), on the same ZeRO-3 data-parallel setup:

    piper            replicate(zero=3, bucket_mb=<one block's MiB>) + checkpoint(policy=P)   (none: no directive)
    FSDP2 eager      fully_shard per block then root (reshard_after_forward=True), each block wrapped in
                     torch's checkpointing (none: not wrapped)
    FSDP2 compiled   the same, with ``block.compile()`` on each wrapped block (as torchtitan: AC, compile, FSDP)

Torch's checkpointing per block (``checkpoint_wrapper``, ``use_reentrant=False``):

* ``full``: ``torch.utils.checkpoint.checkpoint(block, x)``: keeps each block's input, recomputes the rest;
* ``selective``: SAC, ``create_selective_checkpoint_contexts`` with a policy that saves the outputs of
  aten mm / addmm / bmm and the scaled-dot-product attention ops (MUST_SAVE) and recomputes every other op
  (PREFER_RECOMPUTE) -- the same op set as piper's ``SELECTIVE_SAVE``.

piper checkpoints per region; the peer per block. By default piper's regions are the peer's: each block is
tagged ``annotate(block, AC=i)`` and the directive is ``checkpoint({"AC": "*"}, policy=P)``. With
``--whole-program`` the directive has no filter and matches the whole data-parallel program as one region,
so ``full`` keeps only the batch and recomputes the whole forward at the start of the backward: every
recomputed activation is live at once again and the peak barely moves (piper warns about it).

Same GPT as ``bench_zero.py`` (``common.build_gpt``), AdamW (``common.peer_adamw`` for the peers), same seed,
weights and synthetic batches, gloo on CPU with 1 thread per rank, every variant in freshly spawned processes.
Per variant one line: median step ms (slowest rank, timed steps after warm-up, see ``common.py``), the
tensor-level ``peak`` MiB (``zero_common.py``: tensor state between steps + net CPU-allocator high-water of
one profiled step, max over ranks), and for piper and the compiled peer the ratio to the eager FSDP2 variant
of the same policy (time and peak; below 1.00 is faster / smaller). For piper, ``piper.memory_report(step)``
of rank 0 adds ``peak_activations`` measured / predicted. The loss curve of every variant is checked against
the eager FSDP2 run without checkpointing (checkpointing must not change training).

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py                       # world 2, dim 128, 4 layers
    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py --only full selective --no-compiled-peer
    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py --whole-program     # piper: one region, no tags
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero import _finish  # noqa: E402
from common import (RankResult, Spec, Summary, add_common_args, build_gpt, compare_losses,  # noqa: E402
                    eager_dp_step, global_batches, load_note, local_batch, peer_adamw, timed_loop, to_global_mean)
from zero_common import MiB, block_mib, piper_extra, piper_optimizer, piper_replicate, short_error  # noqa: E402

from piper_compile.testing.launch import run_local  # noqa: E402

POLICIES = ("none", "full", "selective")


def sac_policy() -> Callable[..., Any]:
    """SAC policy: save matmul and attention outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def wrap_block(block: nn.Module, policy: str) -> nn.Module:
    """``block`` under torch's non-reentrant checkpointing for ``policy`` (unchanged for ``none``)."""
    if policy == "none":
        return block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    kw: dict[str, Any] = {}
    if policy == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, sac_policy())
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kw)


def peer_worker(rank: int, world: int, spec: Spec, policy: str, compiled: bool) -> RankResult:
    """FSDP2 ZeRO-3 (per block, then root) with torch's activation checkpointing on each block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_gpt(spec)
    batches = global_batches(model, spec, world * spec.batch)
    mesh = init_device_mesh("cpu", (world,))
    for i, block in enumerate(list(model.blocks)):  # torchtitan's order: AC, compile, FSDP
        wrapped = wrap_block(block, policy)
        if compiled:
            wrapped.compile()
        fully_shard(wrapped, mesh=mesh, reshard_after_forward=True)
        model.blocks[i] = wrapped
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = peer_adamw(model.parameters(), spec.lr)
    run = eager_dp_step(model, opt, batches, rank, spec.batch)
    res = to_global_mean(timed_loop(run, spec), world)
    _finish(res, run, list(model.parameters()), opt, spec, True)
    return res


def piper_worker(rank: int, world: int, spec: Spec, policy: str, bucket_mb: float, per_block: bool) -> RankResult:
    """piper ZeRO-3 data parallel, plus ``checkpoint(policy=...)`` unless ``policy`` is ``none``; with
    ``per_block`` every block is its own region (tag ``AC=i``) and the directive matches ``{"AC": "*"}``."""
    import piper_compile as piper
    from piper_compile.capture.annotate import annotate

    model = build_gpt(spec)
    batches = global_batches(model, spec, world * spec.batch)
    if per_block:
        for i, block in enumerate(model.blocks):
            annotate(block, AC=i)
    directives = [piper_replicate(None, 3, bucket_mb, 1)]
    if policy != "none":
        directives.append(piper.checkpoint({"AC": "*"} if per_block else None, policy=policy))
    step = piper.compile(model, directives=directives, codegen=spec.codegen,
                         optimizer=functools.partial(torch.optim.AdamW, lr=spec.lr))

    def run(i: int) -> torch.Tensor:
        return step(*local_batch(batches, i, rank, spec.batch))

    res = timed_loop(run, spec)
    res.extra = piper_extra(step)
    res.extra["activations"] = activations_report(step)
    _finish(res, run, list(model.parameters()), piper_optimizer(step), spec, True)
    return res


def activations_report(step: Any) -> str:
    """``piper.memory_report(step)``'s peak activations, measured / predicted (MiB), best effort."""
    import piper_compile as piper

    try:
        rep = piper.memory_report(step)
        return (f"peak_activations measured {rep.measured.peak_activations / MiB:.3f} / predicted "
                f"{rep.predicted.peak_activations / MiB:.3f} MiB")
    except Exception as e:  # noqa: BLE001 - informative only
        return f"memory_report failed: {e!r}"


def launch(worker: Callable[..., RankResult], world: int, spec: Spec, timeout: float, *args: Any
           ) -> list[RankResult] | str:
    """One variant in fresh processes; its results, or the failure's message."""
    try:
        return run_local(worker, world, spec, *args, timeout_s=timeout)
    except Exception as e:  # noqa: BLE001 - report and go on with the other variants
        return f"FAILED: {type(e).__name__}\n{short_error(e)}"


def peak(ranks: list[RankResult]) -> float:
    return max(r.extra.get("peak", float("nan")) for r in ranks)


def row(name: str, ranks: list[RankResult] | str, ref: list[RankResult] | str | None) -> str:
    """One table line: median ms, tensor peak MiB, and the ratios to ``ref`` (eager FSDP2, same policy)."""
    if isinstance(ranks, str):
        return f"{name:<30} {ranks.splitlines()[0]}\n" + "\n".join(ranks.splitlines()[1:])
    s, p = Summary.of(ranks), peak(ranks)
    ratios = f"{'-':>10} {'-':>10}"
    if ref is not None and not isinstance(ref, str):
        ratios = f"{s.median_ms / Summary.of(ref).median_ms:>10.2f} {p / peak(ref):>10.2f}"
    return f"{name:<30} {s.median_ms:>10.1f} {p:>10.1f} {ratios}"


def run_policy(policy: str, world: int, spec: Spec, args: argparse.Namespace, bucket_mb: float
               ) -> dict[str, list[RankResult] | str]:
    """piper, eager FSDP2 and (unless ``--no-compiled-peer``) compiled FSDP2 for one policy."""
    out: dict[str, list[RankResult] | str] = {}
    print(f"  running {policy}: FSDP2 eager ...", flush=True)
    out[f"FSDP2 eager {policy}"] = launch(peer_worker, world, spec, args.timeout, policy, False)
    if not args.no_compiled_peer:
        print(f"  running {policy}: FSDP2 compiled ...", flush=True)
        out[f"FSDP2 compiled {policy}"] = launch(peer_worker, world, spec, args.timeout, policy, True)
    print(f"  running {policy}: piper ...", flush=True)
    out[f"piper {policy}"] = launch(piper_worker, world, spec, args.timeout, policy, bucket_mb, args.per_block)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(dim=128, steps=5, warmup=2)
    p.add_argument("--world", type=int, default=2, help="gloo ranks (one process each)")
    p.add_argument("--only", nargs="+", choices=POLICIES, default=list(POLICIES), help="checkpoint policies to run")
    p.add_argument("--no-compiled-peer", action="store_true", help="skip the torch.compile'd FSDP2 peer")
    p.add_argument("--whole-program", action="store_true",
                   help="piper: no block tags, checkpoint() over the whole program as one region (the default tags "
                        "every block as its own region, AC=i, and checkpoints {'AC': '*'}, as the peer)")
    args = p.parse_args()
    args.per_block = not args.whole_program
    spec = Spec.from_args(args)
    bucket_mb = round(block_mib(spec), 2)
    print(f"bench_checkpoint: {spec.describe()}, world {args.world}, piper replicate(zero=3, "
          f"bucket_mb={bucket_mb}), checkpoint regions: {'per block' if args.per_block else 'whole program'}, "
          f"{os.cpu_count()} CPU cores", flush=True)
    print(f"before: {load_note()}")
    results: dict[str, dict[str, list[RankResult] | str]] = {}
    for policy in [q for q in POLICIES if q in args.only]:
        results[policy] = run_policy(policy, args.world, spec, args, bucket_mb)
    report(results, spec, args.world)


def report(results: dict[str, dict[str, list[RankResult] | str]], spec: Spec, world: int) -> None:
    """The table (ratios against eager FSDP2 of the same policy), piper's memory report, the loss checks."""
    print(f"\n== activation checkpointing, world {world} ZeRO-3 ({spec.steps} timed steps; ratios = this / FSDP2 eager "
          f"same policy)")
    head = f"{'variant':<30} {'median ms':>10} {'peak MiB':>10} {'time ratio':>10} {'peak ratio':>10}"
    print(head)
    print("-" * len(head))
    for policy, variants in results.items():
        ref = variants[f"FSDP2 eager {policy}"]
        for name, ranks in variants.items():
            print(row(name, ranks, None if name.startswith("FSDP2 eager") else ref))
    print("\n== piper rank 0 memory_report")
    for policy, variants in results.items():
        ours = variants[f"piper {policy}"]
        if not isinstance(ours, str):
            print(f"  piper {policy}: {ours[0].extra.get('activations')}")
    print("\n== loss check (every variant vs FSDP2 eager none)")
    base = results.get("none", {}).get("FSDP2 eager none")
    for variants in results.values():
        for name, ranks in variants.items():
            if isinstance(ranks, str) or isinstance(base, str) or base is None or ranks is base:
                continue
            compare_losses(name, ranks[0].losses, base[0].losses)
    print(f"after: {load_note()}")


if __name__ == "__main__":
    main()
