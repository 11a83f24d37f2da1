"""The sharded state dict of a run (``{"model": ..., "optim": ...}``, each rank's part as DCP entries),
what finishes a load on the live training state, the creation of optimizer state before the first
update, and the full values of every parameter (gathered from shards and pieces)."""
from __future__ import annotations


from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from piper_compile.errors import PiperError
from piper_compile.checkpoint.layout import Ctx, raw_state_dict
from piper_compile.checkpoint.pieces import StatefulDict, pieces_of


def _model_entries(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    z = ctx.st.zero
    for name in ctx.shards:
        b = z.buckets[name]
        out.update(pieces_of(b, b.shard.detach(), ctx.split))
    for f in ctx.trained:
        if f not in ctx.sharded:
            out[f] = ctx.pieces(f, ctx.local(f).detach()) if f in ctx.split else ctx.params[f].detach()
    for f, p in ctx.params.items():  # trained by no rank (frozen): every rank holds rank 0's copy
        if f not in ctx.owners:
            out[f] = ctx.pieces(f, ctx.local(f).detach()) if f in ctx.split else p.detach()
    named = {ctx.name_of[f]: v for f, v in out.items()}
    if ctx.module is not None:  # tied aliases under every name, and persistent buffers this rank holds
        fqn_by_id = {id(p): f for f, p in ctx.params.items()}
        released = {id(ctx.buffers[f]) for f in ctx.st.released_buffers}  # another stage's: its holder writes it
        for key, v in raw_state_dict(ctx.module).items():
            if key in named or not isinstance(v, torch.Tensor) or id(v) in released:
                continue
            f = fqn_by_id.get(id(v))
            if f is None and not isinstance(v, nn.Parameter):
                named[key] = v.detach()
            elif f is not None and f in out:
                named[key] = out[f]
    return named


def _optimizer_entries(ctx: Ctx, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[tuple[Any, str, str]]]:
    """{"state", "param_groups"} and the non-tensor state values to write back after a load."""
    state: dict[str, dict[str, Any]] = {}
    writeback: list[tuple[Any, str, str]] = []  # (optimizer param, state key, fqn)
    z = ctx.st.zero

    def add(fqn: str, param: Any, k: str, v: Any) -> None:
        state.setdefault(ctx.name_of[fqn], {})[k] = v
        if not isinstance(v, torch.Tensor):
            writeback.append((param, k, ctx.name_of[fqn]))

    for name in ctx.shards:
        b = z.buckets[name]
        for run in b.opt_runs():
            fqns = [f for f, _, s, _ in b.local_pieces() if run.start <= s < run.start + run.length]
            for k, v in (opt.state.get(run.param) or {}).items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == run.length:
                    for f, pieces in pieces_of(b, v.detach(), ctx.split, run.start).items():
                        add(f, run.param, k, pieces)
                elif isinstance(v, torch.Tensor) and v.dim() > 0:
                    raise PiperError(f"piper: optimizer state {k!r} of ZeRO bucket {name} has shape "
                                     f"{tuple(v.shape)}, neither a scalar nor the shard's ({run.length},); it cannot "
                                     "be checkpointed by parameter")
                else:
                    for f in fqns:
                        add(f, run.param, k, v)
    for f in ctx.trained:
        if f not in ctx.sharded:
            p = ctx.local(f)
            for k, v in (opt.state.get(p) or {}).items():
                if f in ctx.split and isinstance(v, torch.Tensor) and v.dim() > 0:
                    if v.shape != p.shape:
                        raise PiperError(f"piper: optimizer state {k!r} of this rank's piece of {f} has shape "
                                         f"{tuple(v.shape)}, neither a scalar nor the piece's {tuple(p.shape)}; it "
                                         "cannot be checkpointed by parameter")
                    v = ctx.pieces(f, v.detach())
                add(f, p, k, v)
    all_trained = [ctx.name_of[f] for f in ctx.params if f in ctx.owners]
    if len(opt.param_groups) == 1:
        names = [all_trained]
    elif ctx.st.group_of is not None:  # several groups over shards or pieces (runtime/param_groups.py)
        names = [[ctx.name_of[f] for f in ctx.params if f in ctx.owners and ctx.st.group_of.get(f) == i]
                 for i in range(len(opt.param_groups))]
    else:  # several groups holding the model's parameters
        by_id = {id(p): ctx.name_of[f] for f, p in ctx.params.items() if f in ctx.owners}
        names = [[by_id[id(p)] for p in g["params"] if id(p) in by_id] for g in opt.param_groups]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": n} for g, n in zip(opt.param_groups, names)]
    return {"state": state, "param_groups": groups}, writeback


def build(ctx: Ctx, model_only: bool = False) -> dict[str, Any]:
    sd: dict[str, Any] = {"model": StatefulDict(_model_entries(ctx), lambda _: _after_model_load(ctx))}
    if model_only:
        return sd
    if ctx.unsharded_yet:
        raise PiperError("piper: the step has only run forward-only (torch.no_grad) calls, and its training layout "
                         "shards parameters that are not sharded yet; run one training call first")
    opt = ctx.st.get_optimizer()
    if opt is not None:
        materialize(ctx, opt)
        entries, writeback = _optimizer_entries(ctx, opt)
        sd["optim"] = StatefulDict(entries, lambda loaded: _after_optim_load(opt, loaded, writeback))
    scaler = ctx.st.scaler  # fp16 loss scaling: the scale and growth tracker (the same on every rank)
    if scaler is not None:
        sd["loss_scaler"] = StatefulDict(scaler.state_dict(), scaler.load_state_dict)
    return sd


def _after_model_load(ctx: Ctx) -> None:
    """ZeRO-1/2: the model's parameters are views of the full flat buffer: re-gather it from the loaded
    shards (collective over each bucket's group); a low-precision model's master shard was loaded."""
    z = ctx.st.zero
    if z is None:
        return
    for name in sorted(z.buckets):
        b = z.buckets[name]
        if b.level > 2 or b.flat is None:
            continue
        if b.world == 1:
            b.flat[: b.shard_len].copy_(b.shard.detach())
        else:
            z.post_update_gather(name, ctx.groups.get(b.stream, b.devices)).wait()


def _after_optim_load(opt: torch.optim.Optimizer, loaded: dict[str, Any],
                      writeback: list[tuple[Any, str, str]]) -> None:
    for g, saved in zip(opt.param_groups, loaded.get("param_groups", [])):
        for k, v in saved.items():
            if k != "params" and not isinstance(g.get(k), torch.Tensor):
                g[k] = v
    for param, k, name in writeback:
        opt.state[param][k] = loaded["state"][name][k]


def materialize(ctx: Ctx, opt: torch.optim.Optimizer) -> None:
    """Create the optimizer state of what this rank trains, as its first step would: one step on zero
    gradients (at the real learning rate, so lr-derived initial state is right), after which the
    parameters are restored bitwise and every ``step`` count is reset to 0."""
    z = ctx.st.zero
    mine = [p for b in ctx.shards for p in z.buckets[b].opt_params()]
    mine += [ctx.local(f) for f in ctx.trained if f not in ctx.sharded]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    missing = [p for p in mine if id(p) in in_opt and not opt.state.get(p)]
    if not missing:
        return
    everything = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in everything]
    keep = [p.detach().clone() for p in missing]
    ids = {id(p) for p in missing}
    try:
        for p in everything:
            p.grad = torch.zeros_like(p) if id(p) in ids else None
        opt.step()
    finally:
        with torch.no_grad():
            for p, v in zip(missing, keep):
                p.copy_(v)
        for p, g in zip(everything, grads):
            p.grad = g
    for p in missing:
        s = opt.state.get(p) or {}
        if "step" in s:
            v = s["step"]
            if isinstance(v, torch.Tensor):
                v.zero_()
            else:
                s["step"] = type(v)(0)


def full_values(ctx: Ctx, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Full copies of every parameter (``only``: of those FQNs; every rank must pass the same set), on
    every rank: a collective over the world."""
    vals: dict[str, torch.Tensor] = {}
    want = set(ctx.params) if only is None else only
    z = ctx.st.zero
    if z is not None and z.sharded:
        for name in sorted(z.buckets):
            b = z.buckets[name]
            if want & set(b.fqns):
                vals.update({f: v.clone() for f, v in b.views(z.full_flat(b.name, ctx.groups), want).items()})
    vals.update(_gather_pieces(ctx, want))
    for f, p in ctx.params.items():
        if f in want and f not in vals:  # a released parameter (another stage's) has no storage: its owner sends it
            vals[f] = p.detach().clone() if p.untyped_storage().nbytes() else torch.empty(p.shape, dtype=p.dtype,
                                                                                          device=p.device)
    if ctx.world > 1:
        for f in [f for f in ctx.params if f in want]:  # the same order on every rank
            own = ctx.owners.get(f)
            if own and len(own) < ctx.world:
                dist.broadcast(vals[f], src=min(own))
    return vals


def full_buffers(ctx: Ctx) -> dict[int, torch.Tensor]:
    """``id(buffer) -> its value`` for every buffer of the joint graph, on every rank: one this rank
    released (another stage's) is broadcast from the first rank whose program reads it. A collective over
    the world (every rank derives the same broadcasts from the training programs)."""
    vals: dict[str, torch.Tensor] = {}
    for f, b in sorted(ctx.buffers.items()):
        own = ctx.buffer_holders.get(f)
        shared = ctx.world > 1 and own and len(own) < ctx.world
        if not shared:
            vals[f] = b.detach()
            continue
        vals[f] = b.detach() if ctx.rank == min(own) else torch.empty(b.shape, dtype=b.dtype, device=b.device)
        dist.broadcast(vals[f], src=min(own))
    return {id(ctx.buffers[f]): v for f, v in vals.items()}


def _gather_pieces(ctx: Ctx, want: set[str]) -> dict[str, torch.Tensor]:
    """Full values of the expert and tensor-parallel weights (of ``want``) this rank holds a piece of,
    all-gathered within each piece's group (the same order on every rank: sorted by fqn, each group's
    collectives on its own group)."""
    return {f: ctx.split[f].gather(ctx.groups) for f in sorted(ctx.split) if f in want}
