"""Expert parallelism: piper ``[replicate(all ranks), shard({"EP": "*"}, all ranks)]`` vs a hand-written
expert-parallel training step in plain PyTorch (torchtitan style).

Model: ``piper_compile.testing.models.MoEGPT`` (pre-LN GPT whose MLPs are ``piper_compile.nn.MoE``: softmax
router, top-k SwiGLU experts; tied embedding), same seed and weights everywhere, same synthetic batches, same
local batch per rank, AdamW, gloo on CPU with 1 thread per rank, every variant in freshly spawned processes.
EP size = world size: every rank is a data-parallel replica of the dense weights with its own local batch,
and holds ``experts / world`` experts of every MoE layer (rank r: experts ``[r*E/W, (r+1)*E/W)``).

The reference step (``EPMoE``, swapped in for every ``MoE`` at setup; ``models.py`` is untouched):

1. router computed locally (``MoE.route``: the same math as the single-device layer);
2. the ``N*k`` (token, choice) slots sorted by expert (``experts.route``), per-expert slot counts exchanged
   with ``dist.all_to_all_single`` (so every rank knows how many rows it receives from whom);
3. the slots' tokens sent to their experts' owners by a variable-size ``all_to_all_single`` wrapped in an
   autograd Function whose backward is the inverse all-to-all (``AllToAll``);
4. received rows regrouped expert-major and run through the local experts with
   ``piper_compile.nn.experts.grouped_swiglu`` (backward: ``grouped_swiglu_backward``, the same kernels
   piper's ``moe_experts`` op uses), regrouped back, returned by the inverse all-to-all, weighted, summed.

Gradients: dense parameters (attention, norms, embeddings, routers) go through DDP (average over ranks);
expert parameters are ignored by DDP, since their gradient already sums the contributions of every rank's
tokens. Each rank's loss is the mean over its local batch, so that sum is ``W`` times the gradient of the
global-batch mean: a hook divides expert gradients by ``W``. The result equals single-process training on the
concatenated global batch, which ``--check`` verifies (3 AdamW steps on 2 ranks; also
``tests/dist/test_ep_reference.py``).

Timing and memory as in the other benchmarks (``common.py``: median over the timed steps of the slowest rank's
step, after warm-up; peak RSS per rank; ``zero_common.py``: tensor ``state`` / ``peak`` MiB per rank).
The piper variant runs only when piper accepts the ``shard`` directive; while it does not, the benchmark
prints "piper EP: not available" and reports the reference alone.

    python benchmarks/bench_ep.py --check                 # reference vs single-process, 2 ranks, 3 steps
    python benchmarks/bench_ep.py                          # world 2 and 4: reference (+ piper when available)
    python benchmarks/bench_ep.py --world 2 --only-reference --no-mem
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RankResult, Spec, Summary, add_common_args, best_of, compare_losses, eager_dp_step,  # noqa: E402
                    global_batches, load_note, local_batch, peer_adamw, piper_revision, timed_loop,
                    to_global_mean)
from zero_common import (fmt_ranks, mem_figure, piper_extra, print_report, ratio_line, short_error,  # noqa: E402
                         state_breakdown, tensor_peak)

from piper_compile.nn.experts import grouped_swiglu, grouped_swiglu_backward, route  # noqa: E402
from piper_compile.nn.moe import MoE  # noqa: E402
from piper_compile.testing.launch import run_local  # noqa: E402
from piper_compile.testing.models import MoEGPT, build_model  # noqa: E402

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


# --------------------------------------------------------------------------------------------------------------
# The reference: expert parallelism by hand


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows of ``x`` (``in_splits[r]`` rows to rank r, ``out_splits[r]`` rows from
    rank r); backward sends the gradient rows back with the splits swapped (the inverse all-to-all)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        gx = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(gx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


class LocalExperts(torch.autograd.Function):
    """The local experts on rows sorted by expert (``counts`` rows each): ``grouped_swiglu`` forward,
    ``grouped_swiglu_backward`` backward (hidden activations recomputed, as piper's ``moe_experts`` op does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        ctx.counts = counts
        return grouped_swiglu(x, counts, w_gate, w_up, w_down)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        x, wg, wu, wd = ctx.saved_tensors
        gx, gg, gu, gd = grouped_swiglu_backward(gy.contiguous(), x, ctx.counts, wg, wu, wd)
        return gx, None, gg, gu, gd


def expert_slice(num_experts: int, rank: int, ep: int) -> slice:
    if num_experts % ep:
        raise ValueError(f"bench_ep: {num_experts} experts do not split over {ep} ranks")
    per = num_experts // ep
    return slice(rank * per, (rank + 1) * per)


class EPMoE(nn.Module):
    """An expert-parallel replacement for one :class:`MoE`: the router replicated, only this rank's experts held
    (same parameter names, so state dicts line up with the single-device model)."""

    def __init__(self, moe: MoE, rank: int, ep: int, group: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.rank, self.ep, self.group = rank, ep, group
        self.local = self.num_experts // ep
        self.router = moe.router
        own = expert_slice(self.num_experts, rank, ep)
        for name in EXPERT_WEIGHTS:
            setattr(self, name, nn.Parameter(getattr(moe, name).detach()[own].clone()))

    route = MoE.route  # the single-device layer's router math (softmax, top-k, renormalised weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx, _ = self.route(flat)
        n, k = idx.shape
        order, counts = route(idx, self.num_experts)  # slots sorted by expert; slots per expert [E]
        xs = flat[order // k]
        # how many rows every rank sends me for each of my experts: [ep, local]
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        recv_counts = recv.view(self.ep, self.local).tolist()
        send_splits = counts.view(self.ep, self.local).sum(1).tolist()
        recv_splits = [sum(row) for row in recv_counts]
        xr = AllToAll.apply(xs, recv_splits, send_splits, self.group)  # source-major, expert-major within
        perm, inv = _source_to_expert_major(recv_counts)
        expert_counts = [sum(recv_counts[s][e] for s in range(self.ep)) for e in range(self.local)]
        ye = LocalExperts.apply(xr[perm], expert_counts, self.w_gate, self.w_up, self.w_down)
        ys = AllToAll.apply(ye[inv], send_splits, recv_splits, self.group)  # back in this rank's slot order
        y = ys[torch.argsort(order)].view(n, k, -1)
        return (y * weights.unsqueeze(-1)).sum(dim=1).reshape(shape)


def _source_to_expert_major(counts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows come as (source rank, local expert) blocks; ``perm`` reorders them (local expert, source
    rank) so each expert's rows are contiguous, ``inv`` undoes it."""
    starts, pos = [], 0
    for row in counts:
        starts.append([])
        for c in row:
            starts[-1].append(pos)
            pos += c
    pieces = [torch.arange(starts[s][e], starts[s][e] + counts[s][e])
              for e in range(len(counts[0])) for s in range(len(counts))]
    perm = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return perm, torch.argsort(perm)


def build_moegpt(spec: Spec) -> MoEGPT:
    """The same weights on every rank and in every variant (seeded)."""
    return build_model("moegpt", seed=spec.seed, **spec.model)  # type: ignore[return-value]


def to_expert_parallel(model: MoEGPT, rank: int, world: int, group: Any) -> list[str]:
    """Swap every MoE layer for an :class:`EPMoE` holding this rank's experts; returns the expert parameters'
    names. Their gradients are divided by ``world`` (see the module docstring)."""
    names: list[str] = []
    for i, block in enumerate(model.blocks):
        block.moe = EPMoE(block.moe, rank, world, group)
        for w in EXPERT_WEIGHTS:
            getattr(block.moe, w).register_hook(lambda g, s=1.0 / world: g * s)
            names.append(f"blocks.{i}.moe.{w}")
    return names


def reference_setup(rank: int, world: int, spec: Spec, sgd: bool = False
                    ) -> tuple[nn.Module, MoEGPT, torch.optim.Optimizer, list[str]]:
    """(DDP-wrapped net, the inner model, AdamW (SGD with ``sgd``), expert parameter names) of the reference
    on this rank."""
    model = build_moegpt(spec)
    ep_group = dist.new_group(list(range(world)))  # its own communicator: all-to-alls never queue behind DDP
    experts = to_expert_parallel(model, rank, world, ep_group)
    DDP._set_params_and_buffers_to_ignore_for_model(model, experts)
    net = DDP(model, gradient_as_bucket_view=True)  # dense weights: broadcast from rank 0, gradients averaged
    opt = torch.optim.SGD(net.parameters(), lr=spec.lr) if sgd else peer_adamw(net.parameters(), spec.lr)
    return net, model, opt, experts


# --------------------------------------------------------------------------------------------------------------
# --check: the reference equals single-process training on the global batch


def _full_params(model: nn.Module, experts: list[str], world: int, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of the single-device model: experts all-gathered along the expert dim."""
    out = {}
    for name, p in model.named_parameters():
        t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p.detach()
        t = t.detach().clone()
        if name in experts:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            t = torch.cat(parts)
        out[name] = t
    return out


def check_worker(rank: int, world: int, spec: Spec, sgd: bool = False) -> dict[str, Any]:
    net, model, opt, experts = reference_setup(rank, world, spec, sgd)
    batches = global_batches(model, spec, world * spec.batch)
    losses, grads = [], {}
    for i in range(spec.warmup + spec.steps):
        loss = net(*local_batch(batches, i, rank, spec.batch))
        loss.backward()
        if i == 0:
            grads = _full_params(model, experts, world, grads=True)
        opt.step()
        opt.zero_grad(set_to_none=False)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses, "grads": grads, "params": _full_params(model, experts, world)}


def single_process(spec: Spec, world: int, sgd: bool = False) -> dict[str, Any]:
    """Eager MoEGPT (``piper::moe_experts`` op) on the concatenated global batch, AdamW (or SGD)."""
    model = build_moegpt(spec)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr) if sgd else torch.optim.AdamW(model.parameters(), lr=spec.lr)
    batches = global_batches(model, spec, world * spec.batch)
    losses, grads = [], {}
    for i in range(spec.warmup + spec.steps):
        loss = model(*batches[i])
        loss.backward()
        if i == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def check_reference(spec: Spec, world: int = 2, timeout_s: float = 300, sgd: bool = False) -> dict[str, float]:
    """Max differences between the reference on ``world`` ranks and single-process training: per-step global
    loss, first-step gradients (absolute, and relative to the largest gradient), parameters after the last step.
    ``sgd``: plain SGD instead of AdamW in both (AdamW turns rounding noise on a mathematically zero gradient
    into a step of ~lr, which can flip a near-tie in routing on a later step)."""
    ref = run_local(check_worker, world, spec, sgd, timeout_s=timeout_s)
    for r in ref[1:]:  # every rank returns the same gathered tensors
        assert all(torch.equal(r["params"][n], ref[0]["params"][n]) for n in r["params"])
    ours, truth = ref[0], single_process(spec, world, sgd)
    assert ours["params"].keys() == truth["params"].keys()
    gmax = max(float(g.abs().max()) for g in truth["grads"].values())
    grad_diff = max(float((ours["grads"][n] - g).abs().max()) for n, g in truth["grads"].items())
    return {
        "loss": max(abs(a - b) for a, b in zip(ours["losses"], truth["losses"])),
        "grad": grad_diff,
        "grad_rel": grad_diff / gmax,
        "param": max(float((ours["params"][n] - p).abs().max()) for n, p in truth["params"].items()),
        "expert_param": max(float((ours["params"][n] - p).abs().max()) for n, p in truth["params"].items()
                            if n.rsplit(".", 1)[-1] in EXPERT_WEIGHTS),
        "losses": ours["losses"], "losses_single": truth["losses"],  # type: ignore[dict-item]
    }


def run_check(spec: Spec, world: int, timeout_s: float) -> bool:
    spec = dataclasses.replace(spec, warmup=0, steps=3)
    print(f"bench_ep --check: {describe(spec)}; reference EP on {world} gloo ranks vs single-process eager on the "
          f"global batch ({world} x {spec.batch} sequences), {spec.steps} AdamW steps", flush=True)
    d = check_reference(spec, world, timeout_s)
    print("  losses reference: " + " ".join(f"{x:.6f}" for x in d["losses"]))  # type: ignore[union-attr]
    print("  losses single:    " + " ".join(f"{x:.6f}" for x in d["losses_single"]))  # type: ignore[union-attr]
    print(f"  max |loss diff| {d['loss']:.2e}; step-1 grads max |diff| {d['grad']:.2e} "
          f"({d['grad_rel']:.1e} of the largest grad); params after {spec.steps} steps max |diff| {d['param']:.2e} "
          f"(experts {d['expert_param']:.2e})")
    ok = d["loss"] < 1e-5 and d["grad_rel"] < 1e-5 and d["param"] < 1e-4
    print(f"  -> {'OK' if ok else 'MISMATCH'}")
    return ok


# --------------------------------------------------------------------------------------------------------------
# Benchmark


def _finish(res: RankResult, run: Any, params: list[nn.Parameter], opt: Any, spec: Spec, mem: bool) -> None:
    res.extra["state_breakdown"] = state_breakdown(params, opt)
    if mem:
        res.extra.update(tensor_peak(run, spec.warmup + spec.steps))


def reference_worker(rank: int, world: int, spec: Spec, mem: bool) -> RankResult:
    net, model, opt, _ = reference_setup(rank, world, spec)
    batches = global_batches(model, spec, world * spec.batch)
    run = eager_dp_step(net, opt, batches, rank, spec.batch, set_to_none=False)  # grads stay DDP bucket views
    res = to_global_mean(timed_loop(run, spec), world)
    _finish(res, run, list(model.parameters()), opt, spec, mem)
    return res


def ep_directives(world: int) -> list[dict[str, Any]]:
    import piper_compile as piper

    ranks = list(range(world))
    return [piper.replicate(None, devices=ranks), {"op": "shard", "filter": {"EP": "*"}, "devices": ranks}]


def piper_worker(rank: int, world: int, spec: Spec, mem: bool) -> RankResult:
    import piper_compile as piper

    model = build_moegpt(spec)
    batches = global_batches(model, spec, world * spec.batch)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": ep_directives(world), "codegen": spec.codegen,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)})

    def run(i: int) -> torch.Tensor:
        return step(*local_batch(batches, i, rank, spec.batch))

    res = timed_loop(run, spec)
    res.extra = piper_extra(step)
    try:
        opt = piper.optimizer(step)
    except Exception:  # noqa: BLE001
        opt = None
    _finish(res, run, list(model.parameters()), opt, spec, mem)
    return res


def shard_unsupported(e: BaseException) -> bool:
    """True when ``e`` is piper saying that the ``shard`` directive is not there yet."""
    text = str(e).lower()
    return "shard" in text and any(s in text for s in ("not built", "not supported", "not implemented", "not yet"))


def run_piper(world: int, spec: Spec, mem: bool, rounds: int, timeout_s: float
              ) -> tuple[list[RankResult] | None, str]:
    """piper's EP step on ``world`` ranks, or (None, why not). The directives are parsed here first (no processes,
    no compilation), so while ``shard`` is not built the answer is immediate."""
    try:
        from piper_compile.directives.spec import parse_directives

        parse_directives(ep_directives(world))
        print(f"  running world {world}: piper replicate + shard EP ({spec.codegen}) ...", flush=True)
        return best_of(rounds, functools.partial(run_local, piper_worker, world, spec, mem, timeout_s=timeout_s)), ""
    except Exception as e:  # noqa: BLE001 - report it and keep the reference's numbers
        if shard_unsupported(e):
            print("  piper EP: not available", flush=True)
            return None, "EP: not available"
        print(f"  piper EP world {world} failed:\n{short_error(e)}", flush=True)
        return None, f"FAILED: {type(e).__name__}"


def describe(spec: Spec) -> str:
    m = spec.model
    return (f"MoEGPT dim={m['dim']} layers={m['layers']} heads={m['heads']} seq={m['seq']} vocab={m['vocab']} "
            f"experts={m['experts']} top_k={m['top_k']} (expert hidden {2 * m['dim']}), local batch {spec.batch}, "
            f"AdamW lr={spec.lr}, {spec.warmup} warm-up + {spec.steps} timed steps, piper codegen={spec.codegen}, "
            f"torch {torch.__version__}, piper {piper_revision()}, 1 thread/rank")


def _details(label: str, s: Summary, ranks: list[RankResult]) -> list[str]:
    out = [f"  {label}: median {s.median_ms:.1f} p90 {s.p90_ms:.1f} cpu {s.cpu_ms:.1f} ms, first step "
           f"{s.first_s:.2f} s, RSS/rank {fmt_ranks(s.rss)} ({fmt_ranks(s.growth, '{:+.0f}')}) MiB"]
    for r, rr in enumerate(ranks):
        extra = {k: v for k, v in rr.extra.items() if k not in ("state_breakdown", "peak", "state")}
        out.append(f"    rank {r}: state {rr.extra.get('state_breakdown')} peak {rr.extra.get('peak')} MiB"
                   + (f" {extra}" if extra else ""))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(layers=2, seq=64, batch=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="gloo ranks = EP size = DP size")
    p.add_argument("--check", action="store_true",
                   help="only verify the reference against single-process training (2 ranks, 3 steps) and exit")
    p.add_argument("--only-reference", action="store_true", help="do not try piper")
    p.add_argument("--no-mem", action="store_true", help="skip the two profiled steps (tensor peak)")
    args = p.parse_args()
    base = Spec.from_args(args)
    spec = dataclasses.replace(base, model={**base.model, "experts": args.experts, "top_k": args.top_k})
    if args.check:
        sys.exit(0 if run_check(spec, 2, args.timeout) else 1)
    mem = not args.no_mem
    print(f"bench_ep: {describe(spec)}, {os.cpu_count()} CPU cores", flush=True)
    print(f"before: {load_note()}")
    lines: list[str] = []
    details: list[str] = []
    for world in args.world:
        print(f"  running world {world}: reference EP (DDP dense + all_to_all experts) ...", flush=True)
        theirs = best_of(args.rounds, functools.partial(run_local, reference_worker, world, spec, mem,
                                                        timeout_s=args.timeout))
        rs = Summary.of(theirs)
        details += _details(f"world {world} reference", rs, theirs)
        ours, why = (None, "not run (--only-reference)") if args.only_reference else \
            run_piper(world, spec, mem, args.rounds, args.timeout)
        if ours is not None:
            s = Summary.of(ours)
            line = f"world {world}  {ratio_line(ours, theirs, 'reference')}"
            details += _details(f"world {world} piper", s, ours)
            ok = compare_losses(f"world {world} loss piper vs reference", ours[0].losses, theirs[0].losses)
            details.append(f"    loss check: {'OK' if ok else 'MISMATCH'}")
        else:
            line = (f"world {world}  piper - ms  reference {rs.median_ms:.1f} ms  ratio piper/reference -  peakRSS "
                    f"piper - MiB reference {max(rs.rss):.0f} MiB  | tensor state reference {mem_figure(theirs, 'state')} "
                    f"MiB, tensor peak reference {mem_figure(theirs, 'peak')} MiB; piper {why}")
        lines.append(line)
        print("  " + line, flush=True)
    print_report(details, f"EP: piper vs reference, median step time of the slowest rank ({spec.steps} timed steps)", lines)


if __name__ == "__main__":
    main()
