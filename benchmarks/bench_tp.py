"""Tensor parallel (Megatron TP) and sequence parallel: piper ``shard_tensor`` vs PyTorch's own tensor parallel.

    piper TP          piper.shard_tensor(TP)
    piper TP+SP       piper.shard_tensor(TP, sequence_parallel=True)
    torch TP          torch.distributed.tensor.parallel.parallelize_module: ColwiseParallel / RowwiseParallel
    torch TP+SP       the same + SequenceParallel on the norms and PrepareModuleInput where the sequence-split
                      residual stream meets whole activations (torchtitan's plan, adapted to this GPT)
   (compile(torch TP), compile(torch TP+SP): the peers under torch.compile (Inductor), with --peer-compile)

TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}:
attention heads and MLP hidden units split over the group; embeddings, the tied LM head and (without SP) the
norms are replicated and computed redundantly on every rank of the group, in piper and in the peer alike.

Same GPT (``common.build_gpt``: tied embedding, same seed and weights everywhere), AdamW, same synthetic batches,
gloo on CPU with 1 thread per rank, every variant in freshly spawned processes. ``--world 2`` is TP2 (both ranks
train on the same local batch); ``--world 4`` is DP2 x TP2 (groups [0,1] and [2,3], one local batch per group):
piper ``[replicate(), shard_tensor(TP, devices=[[0, 1], [2, 3]])]``; the peer parallelizes over the ``tp``
dimension of a (dp, tp) device mesh and averages the local gradients over ``dp`` with one flat all-reduce per step
after backward (what DDP does without bucketing/overlap: ``DDP`` over a module with DTensor parameters is not
supported by torch's public API).

The fused qkv: ``ColwiseParallel`` splits a weight into contiguous row chunks, which for the fused ``[3*dim, dim]``
qkv weight would give rank 0 all of q and half of k. The peer therefore gets the qkv weight and bias with rows
permuted (``qkv_rank_major``) so rank r's contiguous chunk is ``[q_r; k_r; v_r]`` (its heads of q, k and v), which
is what piper's ``colwise:3`` holds. The model code is unchanged (``Block.attend`` chunks qkv's output in three
and infers the head count). Under SP the peer's residual stream is a ``DTensor`` sharded on the sequence
(``use_local_output=False``) so ``x.shape`` stays the global shape the attention reshape reads; block 0's input
(the embedding) is turned from Replicate into Shard(1) and ln_f's output gathered back to Replicate for the
tied (replicated) head.

Columns: median step time of the slowest rank and median CPU time of the busiest rank (``common.py``); ratio
``piper / peer`` on both; tensor memory per rank (``zero_common.py``): ``state`` (params + grads + optimizer
state between steps) and ``peak`` (state + the CPU allocator's high-water during one profiled step); for piper
also its own ``memory_report(step)`` peak activations (measured by its executor) and the simulator's prediction.
Losses: piper TP vs torch TP, piper TP+SP vs torch TP+SP, and piper TP vs piper TP+SP, every step.

    python benchmarks/bench_tp.py                                   # TP2, default GPT, eager peers
    python benchmarks/bench_tp.py --world 2 4 --peer-compile        # + DP2xTP2, + compiled peers
    python benchmarks/bench_tp.py --seq 512 --steps 5 --no-mem      # longer sequence (SP saves more)
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RankResult, Spec, Summary, add_common_args, best_of, build_gpt, compare_losses,  # noqa: E402
                    global_batches, load_note, local_batch, peer_adamw, timed_loop, to_global_mean)
from zero_common import fmt_ranks, piper_extra, print_report, short_error, tensor_peak  # noqa: E402

from piper_compile.testing.launch import run_local  # noqa: E402
from piper_compile.testing.models import GPT  # noqa: E402

TP_PLAN = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise",
           "blocks.*.out": "rowwise"}
TP_SIZE = 2
MiB = float(2**20)


def groups_of(world: int) -> list[list[int]]:
    """The tensor-parallel groups: consecutive ranks, TP_SIZE each."""
    if world % TP_SIZE:
        raise SystemExit(f"bench_tp: --world {world} is not a multiple of the TP size {TP_SIZE}")
    return [list(range(g, g + TP_SIZE)) for g in range(0, world, TP_SIZE)]


def replica_of(rank: int) -> int:
    """The data-parallel replica (index of the local batch) of ``rank``: ranks of one TP group share a batch."""
    return rank // TP_SIZE


def _finish(res: RankResult, run: Callable[[int], Any], spec: Spec, mem: bool) -> None:
    if mem:
        res.extra.update(tensor_peak(run, spec.warmup + spec.steps))


# --------------------------------------------------------------------------------------------------------------
# piper


def piper_worker(rank: int, world: int, spec: Spec, sp: bool, mem: bool) -> RankResult:
    import piper_compile as piper

    model = build_gpt(spec)
    dp = world // TP_SIZE
    batches = global_batches(model, spec, dp * spec.batch)
    tp = piper.shard_tensor(TP_PLAN, devices=groups_of(world) if dp > 1 else None, sequence_parallel=sp)
    directives = ([piper.replicate()] if dp > 1 else []) + [tp]
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": directives, "codegen": spec.codegen,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)})

    def run(i: int) -> torch.Tensor:
        return step(*local_batch(batches, i, replica_of(rank), spec.batch))

    res = timed_loop(run, spec)  # piper returns the global mean loss
    res.extra = piper_extra(step)
    rep = piper.memory_report(step)
    res.extra["piper_peak_act_mib"] = round(rep.measured.peak_activations / MiB, 2)
    res.extra["piper_pred_peak_act_mib"] = round(rep.predicted.peak_activations / MiB, 2)
    res.extra["piper_persistent_mib"] = round(rep.measured.persistent / MiB, 2)
    res.extra["piper_grads_mib"] = round(rep.measured.grads / MiB, 2)  # persistent gradient buffers
    res.extra["piper_pred_grads_mib"] = round(rep.predicted.grads / MiB, 2)
    _finish(res, run, spec, mem)
    return res


# --------------------------------------------------------------------------------------------------------------
# the peer: torch.distributed.tensor.parallel


def qkv_rank_major(dim: int, tp: int) -> torch.Tensor:
    """Row order of the fused qkv weight that makes rank r's contiguous 1/tp chunk ``[q_r; k_r; v_r]``."""
    n = dim // tp
    return torch.cat([torch.arange(j * dim + r * n, j * dim + (r + 1) * n) for r in range(tp) for j in range(3)])


def permute_qkv(model: GPT, tp: int) -> None:
    perm = qkv_rank_major(model.cfg.dim, tp)
    with torch.no_grad():
        for block in model.blocks:
            block.qkv.weight.copy_(block.qkv.weight[perm])
            block.qkv.bias.copy_(block.qkv.bias[perm])


def tp_plan(sp: bool, layers: int) -> dict[str, Any]:
    """``parallelize_module`` plan for the GPT: Megatron TP on every block; with ``sp`` torchtitan's sequence
    parallel layouts (norms on Shard(1), reduce-scatter out of rowwise, all-gather into colwise)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan: dict[str, Any] = {}
    for i in range(layers):
        b = f"blocks.{i}"
        if not sp:
            plan.update({f"{b}.qkv": ColwiseParallel(), f"{b}.proj": RowwiseParallel(),
                         f"{b}.fc": ColwiseParallel(), f"{b}.out": RowwiseParallel()})
            continue
        # the residual stream stays a DTensor sharded on the sequence: Block reads x.shape as the global shape
        plan.update({f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel(),
                     f"{b}.qkv": ColwiseParallel(input_layouts=Shard(1)),
                     f"{b}.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                     f"{b}.fc": ColwiseParallel(input_layouts=Shard(1)),
                     f"{b}.out": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    if sp:
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=False)  # the embedding is whole on every rank
        plan["ln_f"] = SequenceParallel()
        plan["head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)  # the tied head is replicated, as in piper
    return plan


def _dp_all_reduce(params: list[nn.Parameter], group: Any, dp: int) -> None:
    """Average the local gradients (DTensor shards or plain) over the data-parallel group: one flat all-reduce."""
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dp
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def peer_worker(rank: int, world: int, spec: Spec, sp: bool, compiled: bool, mem: bool) -> RankResult:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = build_gpt(spec)
    dp = world // TP_SIZE
    batches = global_batches(model, spec, dp * spec.batch)
    mesh = init_device_mesh("cpu", (dp, TP_SIZE), mesh_dim_names=("dp", "tp"))
    permute_qkv(model, TP_SIZE)
    parallelize_module(model, mesh["tp"], tp_plan(sp, spec.model["layers"]))
    assert model.head.weight is model.wte.weight, "the tied LM head must stay tied"
    params = list(model.parameters())
    opt = peer_adamw(params, spec.lr)
    fwd = torch.compile(model) if compiled else model
    dp_group = mesh["dp"].get_group() if dp > 1 else None

    def run(i: int) -> torch.Tensor:
        loss = fwd(*local_batch(batches, i, replica_of(rank), spec.batch))
        loss.backward()
        if dp_group is not None:
            _dp_all_reduce(params, dp_group, dp)
        opt.step()
        opt.zero_grad()
        return loss

    res = to_global_mean(timed_loop(run, spec), world)
    _finish(res, run, spec, mem)
    return res


# --------------------------------------------------------------------------------------------------------------
# driver


def variants(peer_compile: bool, only_peers: bool) -> dict[str, tuple[Callable[..., RankResult], tuple]]:
    out: dict[str, tuple[Callable[..., RankResult], tuple]] = {}
    if not only_peers:
        out["piper TP"] = (piper_worker, (False,))
        out["piper TP+SP"] = (piper_worker, (True,))
    out["torch TP"] = (peer_worker, (False, False))
    out["torch TP+SP"] = (peer_worker, (True, False))
    if peer_compile:
        out["compile(torch TP)"] = (peer_worker, (False, True))
        out["compile(torch TP+SP)"] = (peer_worker, (True, True))
    return out


def _mem(ranks: list[RankResult], key: str) -> str:
    vals = [r.extra.get(key, float("nan")) for r in ranks]
    return fmt_ranks(vals, "{:.1f}") if vals and all(v == v for v in vals) else "n/a"


def _row(config: str, name: str, s: Summary, ref: Summary | None, ranks: list[RankResult]) -> str:
    ratio = "-" if ref is None or ref is s else f"{ref.median_ms / s.median_ms:.2f} / {ref.cpu_ms / s.cpu_ms:.2f}"
    piper_act = _mem(ranks, "piper_peak_act_mib") if name.startswith("piper") else "-"
    return (f"{config:<8} {name:<22} {s.median_ms:>9.1f} {s.p90_ms:>8.1f} {s.cpu_ms:>8.1f} {s.first_s:>7.1f}  "
            f"{ratio:>13}  {_mem(ranks, 'state'):<13} {_mem(ranks, 'peak'):<13} {piper_act:<13}")


def _saving(tp: list[RankResult], sp: list[RankResult]) -> str:
    """How much less memory TP+SP needs than TP (max over ranks): tensor peak, and piper's peak activations."""
    def most(ranks: list[RankResult], key: str) -> float:
        return max(r.extra.get(key, float("nan")) for r in ranks)

    parts = []
    for key, label in (("peak", "tensor peak"), ("piper_peak_act_mib", "peak activations (memory_report)")):
        a, b = most(tp, key), most(sp, key)
        if a == a and b == b:
            parts.append(f"{label} {a:.1f} -> {b:.1f} MiB ({b - a:+.1f}, {100 * (b - a) / a:+.0f}%)")
    return "; ".join(parts) or "n/a (--no-mem)"


HEAD = (f"{'config':<8} {'variant':<22} {'median ms':>9} {'p90 ms':>8} {'cpu ms':>8} {'first s':>7}  "
        f"{'piper/this':>13}  {'state MiB/rk':<13} {'peak MiB/rk':<13} {'piper act/rk':<13}")


def peer_of(name: str, names: list[str]) -> str | None:
    """The piper variant a peer is divided into (TP+SP peers by piper TP+SP, TP peers by piper TP)."""
    ours = "piper TP+SP" if name.endswith("SP)") or name.endswith("TP+SP") else "piper TP"
    return ours if ours in names else None


def run_config(world: int, spec: Spec, args: argparse.Namespace, lines: list[str], details: list[str]) -> bool:
    config = f"TP{TP_SIZE}" if world == TP_SIZE else f"DP{world // TP_SIZE}xTP{TP_SIZE}"
    mem = not args.no_mem
    results: dict[str, list[RankResult]] = {}
    for name, (fn, extra) in variants(args.peer_compile, args.only_peers).items():
        print(f"  running {config} {name} ...", flush=True)
        try:
            results[name] = best_of(args.rounds, functools.partial(run_local, fn, world, spec, *extra, mem,
                                                                   timeout_s=args.timeout))
        except Exception as e:  # noqa: BLE001 - report the failure, keep the other variants' numbers
            print(f"  {config} {name} FAILED ({type(e).__name__}):\n{short_error(e, 20)}", flush=True)
            lines.append(f"{config:<8} {name:<22} FAILED: {type(e).__name__} (see above)")
    summaries = {n: Summary.of(r) for n, r in results.items()}
    names = list(results)
    for name, s in summaries.items():
        ours = name if name.startswith("piper") else peer_of(name, names)
        ref = summaries[ours] if ours is not None else None
        lines.append(_row(config, name, s, ref if not name.startswith("piper") else None, results[name]))
        details.append(f"  {config} {name}: median {s.median_ms:.1f} p90 {s.p90_ms:.1f} cpu {s.cpu_ms:.1f} ms, "
                       f"first step {s.first_s:.1f} s, RSS/rank {fmt_ranks(s.rss)} "
                       f"({fmt_ranks(s.growth, '{:+.0f}')}) MiB")
        for r, rr in enumerate(results[name]):
            details.append(f"    rank {r}: {rr.extra}")
    for kind, tp, sp in (("piper", "piper TP", "piper TP+SP"), ("torch", "torch TP", "torch TP+SP"),
                         ("compiled torch", "compile(torch TP)", "compile(torch TP+SP)")):
        if tp in results and sp in results:
            lines.append(f"{config:<8} SP vs TP, {kind}: {_saving(results[tp], results[sp])}")
    ok = True
    pairs = [(a, b) for a, b in (("piper TP", "torch TP"), ("piper TP+SP", "torch TP+SP"),
                                 ("piper TP", "piper TP+SP"), ("torch TP", "compile(torch TP)"),
                                 ("torch TP+SP", "compile(torch TP+SP)"), ("torch TP", "torch TP+SP"))
             if a in results and b in results]
    for a, b in pairs:
        ok &= compare_losses(f"{config} loss {a} vs {b}", results[a][0].losses, results[b][0].losses, args.rtol)
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(heads=8, batch=4)
    p.add_argument("--world", type=int, nargs="+", default=[2],
                   help="gloo ranks: 2 = TP2, 4 = DP2 x TP2 (one process each)")
    p.add_argument("--peer-compile", action="store_true", help="also the peers under torch.compile (Inductor)")
    p.add_argument("--only-peers", action="store_true", help="run only the PyTorch peers (no piper)")
    p.add_argument("--no-mem", action="store_true", help="skip the two profiled steps (tensor state / peak)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance of the per-step loss comparison")
    args = p.parse_args()
    spec = Spec.from_args(args)
    print(f"bench_tp: {spec.describe()}, TP size {TP_SIZE}, {os.cpu_count()} CPU cores", flush=True)
    print(f"before: {load_note()}")
    lines = [HEAD, "-" * len(HEAD)]
    details: list[str] = []
    ok = True
    for world in args.world:
        ok &= run_config(world, spec, args, lines, details)
    print_report(details, "tensor parallel: median step (slowest rank), cpu (busiest rank); piper/this = wall / cpu; "
                 "state / peak = tensor MiB per rank (zero_common.py); piper act = memory_report peak activations",
                 lines)
    print(f"correctness: {'all losses agree' if ok else 'LOSS MISMATCH (see above)'}")


if __name__ == "__main__":
    main()
