"""Checkpoints of piper runs, with or without ZeRO, through ``torch.distributed.checkpoint`` (DCP).

    piper.save(step, "ckpt/step100")           # collective: every rank calls it
    piper.load(step, "ckpt/step100")           # also in fresh processes before the first call
    full = piper.full_state_dict(step)         # every parameter, full, on every rank (collective)
    piper.load_full_state_dict(step, eager_model.state_dict())

Layout of ``sharded_state_dict(step)`` (the layout of ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict``, with FQN keys)::

    {"model": {fqn: tensor of the parameter's full shape, ..., persistent buffers},
     "optim": {"state": {fqn: {"step": ..., "exp_avg": ..., ...}},
               "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}}

Each rank contributes only what it trains (the parameters of its UPDATE, so never another pipeline
stage's stale copy). A ZeRO shard is a flat range of its bucket, which covers a flat range of each of
the bucket's parameters; that range is described to DCP as a few boxes of the parameter's own shape
(row-major contiguous blocks: a partial row, whole rows, a partial row), each a view into the live shard
(or its optimizer state). So every rank writes only its shard, nothing is gathered, and a checkpoint
is independent of the layout: it loads into another ZeRO level, bucket size, world size or strategy,
and into an eager model (``dcp.load({"model": model.state_dict()}, checkpoint_id=path)``). Parameters
trained whole by a replicated group are written by every replica under the same key; DCP keeps one.
Under expert parallelism (``shard``) a rank's expert shard of a weight ``[E, ...]`` (experts
``r*E/G .. (r+1)*E/G - 1`` of a group of ``G``) is one box at offset ``r*E/G`` along dim 0, for the
weight and for each optimizer state tensor of the local shard's shape (scalars such as AdamW's ``step``
are written whole by every rank), so expert checkpoints also load into another EP size or an eager model.
Under tensor parallelism (``shard_tensor``) a rank's piece of a layer split along ``dim`` over a group
of ``G`` is one box at ``r*n`` along ``dim`` (``n = size/G``), or for a fused ``colwise:N`` layer one box
per block (at ``j*size/N + r*n/N``), again for the weight and each optimizer state tensor of its shape.
The data-parallel replicas of a tensor-parallel group write the same boxes under the same keys and
offsets; DCP's save planner keeps one of each (``dedup_save_plans``).

``dcp.load(sd)`` writes into the live shards, parameters and optimizer state in place; the two
top-level entries are DCP ``Stateful`` so that loading then re-gathers ZeRO-1/2 full parameters from
the loaded shards and applies the saved ``param_groups`` hyperparameters.

Collectives: ``save``, ``load``, ``dcp.save/load`` of ``sharded_state_dict`` and ``full_state_dict``
involve every rank of the world. Under ZeRO, piper hooks the model's ``state_dict`` and
``load_state_dict`` (installed at the first call that shards the state, or by any function here):
under ZeRO-3 ``model.state_dict()`` all-gathers the shards, so every rank of each ZeRO group must call
it together; ``model.load_state_dict(full)`` is local (each rank copies its pieces from the full
tensors). Under pipeline parallelism ``model.state_dict()`` on a rank is current only for the
parameters that rank trains; ``full_state_dict`` is current for all. Under expert parallelism the
model's expert weights hold no memory (each rank trains its local shard), and so do the split layers
under tensor parallelism: ``model.state_dict()`` and ``full_state_dict`` all-gather them within each
expert / tensor-parallel group (a collective over the world; every parameter is then current on every
rank), and ``model.load_state_dict(full)`` copies each rank's piece into its shard.

Not covered: ``dcp.async_save`` (its staging copies tensors, which the piece views do not support),
modules' non-tensor ``extra_state``; ``load`` reads a local checkpoint directory.
"""
from __future__ import annotations

import functools
import math
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from piper_compile.api import _module_of, _state
from piper_compile.errors import PiperError
from piper_compile.runtime import state as _state_mod
from piper_compile.runtime.state import LocalShard
from piper_compile.runtime.zero import ShardBucket, ensure_storage, free_storage

__all__ = ["full_state_dict", "load", "load_full_state_dict", "materialize_optimizer_state", "save",
           "sharded_state_dict"]


# -- DCP view of a parameter's local pieces ----------------------------------------------------------
class ShardPieces(torch.Tensor):
    """This rank's part of one parameter-shaped tensor: boxes of the full shape, each a view into a ZeRO
    shard (or the optimizer state of one). DCP reads and writes it through the ``_Checkpointable``
    protocol that DTensor uses (``__create_write_items__`` / ``__create_chunk_list__`` /
    ``__get_tensor_shard__``); it supports no tensor operations."""

    _boxes: list[tuple[torch.Size, torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], boxes: list[tuple[torch.Size, torch.Tensor]]) -> "ShardPieces":
        like = boxes[0][1]
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=like.dtype, device=like.device)
        r._boxes = boxes
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise PiperError(f"piper: a sharded checkpoint entry holds only this rank's pieces and supports no tensor "
                         f"operation ({func}); use piper.full_state_dict(step) for full tensors")

    def __repr__(self) -> str:  # type: ignore[override]
        chunks = [(tuple(o), tuple(t.shape)) for o, t in self._boxes]
        return f"ShardPieces(shape={tuple(self.shape)}, dtype={self.dtype}, local chunks (offsets, sizes)={chunks})"

    def local_tensors(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """(offsets in the full tensor, view) of every local box."""
        return list(self._boxes)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.size()))
                for off, t in self._boxes]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self._boxes]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        if index.index is not None and index.index < len(self._boxes) and self._boxes[index.index][0] == index.offset:
            return self._boxes[index.index][1]
        for off, t in self._boxes:
            if off == index.offset:
                return t
        raise ValueError(f"piper: no local piece at offset {index.offset} of {index.fqn}")


Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start)


def flat_range_boxes(shape: Sequence[int], start: int, length: int) -> list[Box]:
    """The flat range ``[start, start + length)`` of a row-major tensor of ``shape`` as boxes
    ``(offsets, sizes, flat start)``, in flat order; each box is contiguous in memory (at most
    ``2 * ndim - 1`` of them)."""
    shape = [int(s) for s in shape]
    out: list[Box] = []

    def rec(d: int, prefix: list[int], s: int, e: int, base: int) -> None:
        if s >= e:
            return
        if d == len(shape):
            out.append((tuple(prefix), (), base))
            return
        inner = math.prod(shape[d + 1:])
        i0, r0 = divmod(s, inner)
        i1, r1 = divmod(e, inner)
        if i0 == i1:
            rec(d + 1, prefix + [i0], r0, r1, base + i0 * inner)
            return
        if r0:
            rec(d + 1, prefix + [i0], r0, inner, base + i0 * inner)
            i0 += 1
        if i1 > i0:
            out.append((tuple(prefix + [i0] + [0] * (len(shape) - d - 1)), (*[1] * d, i1 - i0, *shape[d + 1:]),
                        base + i0 * inner))
        if r1:
            rec(d + 1, prefix + [i1], 0, r1, base + i1 * inner)

    if length > 0:
        rec(0, [], start, start + length, 0)
    return out


def _pieces_of(b: ShardBucket, src: torch.Tensor, split: dict[str, LocalShard]) -> dict[str, ShardPieces]:
    """fqn -> this shard's pieces of it, as views of ``src`` (the shard or a shard-shaped state tensor).
    ``split``: this rank's tensor-parallel pieces (``LocalShard``) by fqn; the bucket holds such a piece,
    so its boxes are placed in the full tensor through it."""
    out = {}
    shapes = dict(zip(b.fqns, b.shapes))
    for fqn, p_start, s_start, n in b.local_pieces():
        boxes = [(torch.Size(off), src[s_start + flat - p_start: s_start + flat - p_start + math.prod(size)].view(size))
                 for off, size, flat in flat_range_boxes(shapes[fqn], p_start, n)]
        sh = split.get(fqn)
        if sh is None:
            out[fqn] = ShardPieces(shapes[fqn], boxes)
        else:
            out[fqn] = ShardPieces(sh.full_shape, [box for off, v in boxes for box in sh.place(tuple(off), v)])
    return out


class _StatefulDict(dict):
    """A dict DCP treats as ``Stateful``: ``dcp.save`` writes it as is, ``dcp.load`` fills its tensors in
    place and then calls ``load_state_dict`` (which finishes the load on the live training state)."""

    def __init__(self, items: dict[str, Any], on_load: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(items)
        self._on_load = on_load

    def state_dict(self) -> dict[str, Any]:
        return self

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._on_load(sd)


# -- what this rank holds and trains ------------------------------------------------------------------
@dataclass
class _Ctx:
    st: Any  # TrainState
    cs: Any  # a CompiledStep of the model
    module: nn.Module | None
    programs: list[Any]  # every rank's training program

    @property
    def rank(self) -> int:
        return self.cs.rank

    @property
    def world(self) -> int:
        return self.cs.world

    @functools.cached_property
    def trained(self) -> list[str]:
        u = self.programs[self.rank].update_node()
        return list(u.attr("params")) if u is not None else []

    @functools.cached_property
    def update_shards(self) -> list[str]:
        """The ZeRO buckets this rank's update steps (by the training program)."""
        u = self.programs[self.rank].update_node()
        return sorted(u.attr("shards") or ()) if u is not None else []

    @property
    def unsharded_yet(self) -> bool:
        """The training layout shards buckets that the state has not sharded yet (only forward-only calls
        so far under ZeRO-1/2, whose forward program has no shard layout)."""
        z = self.st.zero
        done = z is not None and z.sharded and set(self.update_shards) <= set(z.buckets)
        return bool(self.update_shards) and not done

    @property
    def shards(self) -> list[str]:
        return [] if self.unsharded_yet else self.update_shards

    @functools.cached_property
    def owners(self) -> dict[str, list[int]]:
        """fqn -> the ranks that update it."""
        out: dict[str, list[int]] = {}
        for p in self.programs:
            u = p.update_node()
            for f in (u.attr("params") if u is not None else ()):
                out.setdefault(f, []).append(p.rank)
        return out

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return self.cs.joint.params

    @property
    def sharded(self) -> set[str]:
        z = self.st.zero
        return {f for b in z.buckets.values() for f in b.fqns} if z is not None and z.sharded else set()

    @functools.cached_property
    def name_of(self) -> dict[str, str]:
        """Joint fqn -> the module's (first) name of that parameter."""
        if self.module is None:
            return {f: f for f in self.params}
        by_id = {id(p): n for n, p in self.module.named_parameters()}
        return {f: by_id.get(id(p), f) for f, p in self.params.items()}

    @property
    def groups(self) -> Any:
        return _groups_of(self.st)

    @property
    def split(self) -> dict[str, LocalShard]:
        """Expert and tensor parallelism: fqn -> this rank's piece of each split parameter."""
        return self.st.shards

    def local(self, fqn: str) -> torch.Tensor:
        """What this rank trains for an unsharded (by ZeRO) parameter: its expert / tensor-parallel piece
        or the parameter."""
        return self.st.local_param(fqn, self.params[fqn])

    def pieces(self, fqn: str, t: torch.Tensor) -> ShardPieces:
        """``t`` (this rank's piece of split parameter ``fqn`` or a state tensor of its shape) as boxes of
        the full tensor: experts ``[E/G, ...]`` at ``r*E/G`` along dim 0; a tensor-parallel piece at
        ``r*n`` along its split dimension, once per fused block (``colwise:3``: three boxes)."""
        return ShardPieces(self.params[fqn].shape, self.split[fqn].boxes(t))


_PROGRAMS: "weakref.WeakKeyDictionary[Any, list[Any]]" = weakref.WeakKeyDictionary()


def _train_programs(st: Any, cs: Any) -> list[Any]:
    for c in [cs, *st.steps]:
        if False in c.plans:
            return c.plans[False].programs
    if cs not in _PROGRAMS:  # only a forward-only call so far: plan training (no process group needed)
        _PROGRAMS[cs] = cs.build(False)[1]
    return _PROGRAMS[cs]


def _ctx_of(st: Any, cs: Any, module: nn.Module | None) -> _Ctx:
    return _Ctx(st, cs, module, _train_programs(st, cs))


def _context(step: Any) -> _Ctx:
    module = _module_of(step)
    st = _state(step, create=False)
    if st is None or not st.first_call_done or not st.steps:
        raise PiperError("piper: this step has not run yet, so it has no training layout to checkpoint; call it "
                         "once first (piper.load(step, path) before the first call is deferred to that call)")
    cs = next((c for c in st.steps if False in c.plans), None) or next(c for c in st.steps if c.plans)
    ctx = _ctx_of(st, cs, module)
    _install_hooks(st, module)
    return ctx


# -- the sharded state dict ----------------------------------------------------------------------------
def _model_entries(ctx: _Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    z = ctx.st.zero
    for name in ctx.shards:
        b = z.buckets[name]
        out.update(_pieces_of(b, b.shard.detach(), ctx.split))
    for f in ctx.trained:
        if f not in ctx.sharded:
            out[f] = ctx.pieces(f, ctx.local(f).detach()) if f in ctx.split else ctx.params[f].detach()
    for f, p in ctx.params.items():  # trained by no rank (frozen): every rank holds rank 0's copy
        if f not in ctx.owners:
            out[f] = ctx.pieces(f, ctx.local(f).detach()) if f in ctx.split else p.detach()
    named = {ctx.name_of[f]: v for f, v in out.items()}
    if ctx.module is not None:  # tied aliases under every name, and persistent buffers
        fqn_by_id = {id(p): f for f, p in ctx.params.items()}
        for key, v in _raw_state_dict(ctx.module).items():
            if key in named or not isinstance(v, torch.Tensor):
                continue
            f = fqn_by_id.get(id(v))
            if f is None and not isinstance(v, nn.Parameter):
                named[key] = v.detach()
            elif f is not None and f in out:
                named[key] = out[f]
    return named


def _optimizer_entries(ctx: _Ctx, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[tuple[Any, str, str]]]:
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
        s = opt.state.get(b.shard) or {}
        fqns = [f for f, *_ in b.local_pieces()]
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == b.shard_len:
                for f, pieces in _pieces_of(b, v.detach(), ctx.split).items():
                    add(f, b.shard, k, pieces)
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                raise PiperError(f"piper: optimizer state {k!r} of ZeRO bucket {name} has shape {tuple(v.shape)}, "
                                 f"neither a scalar nor the shard's ({b.shard_len},); it cannot be checkpointed by "
                                 "parameter")
            else:
                for f in fqns:
                    add(f, b.shard, k, v)
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
    else:  # several groups (no ZeRO: the groups hold the model's parameters)
        by_id = {id(p): ctx.name_of[f] for f, p in ctx.params.items() if f in ctx.owners}
        names = [[by_id[id(p)] for p in g["params"] if id(p) in by_id] for g in opt.param_groups]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": n} for g, n in zip(opt.param_groups, names)]
    return {"state": state, "param_groups": groups}, writeback


def _build(ctx: _Ctx, model_only: bool = False) -> dict[str, Any]:
    sd: dict[str, Any] = {"model": _StatefulDict(_model_entries(ctx), lambda _: _after_model_load(ctx))}
    if model_only:
        return sd
    if ctx.unsharded_yet:
        raise PiperError("piper: the step has only run forward-only (torch.no_grad) calls, and its training layout "
                         "shards parameters that are not sharded yet; run one training call first")
    opt = ctx.st.get_optimizer()
    if opt is not None:
        _materialize(ctx, opt)
        entries, writeback = _optimizer_entries(ctx, opt)
        sd["optim"] = _StatefulDict(entries, lambda loaded: _after_optim_load(opt, loaded, writeback))
    return sd


def _after_model_load(ctx: _Ctx) -> None:
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


def _materialize(ctx: _Ctx, opt: torch.optim.Optimizer) -> None:
    """Create the optimizer state of what this rank trains, as its first step would: one step on zero
    gradients (at the real learning rate, so lr-derived initial state is right), after which the
    parameters are restored bitwise and every ``step`` count is reset to 0."""
    z = ctx.st.zero
    mine = [z.buckets[b].shard for b in ctx.shards] + [ctx.local(f) for f in ctx.trained if f not in ctx.sharded]
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


# -- public API -------------------------------------------------------------------------------------
def sharded_state_dict(step: Any) -> dict[str, Any]:
    """This rank's part of the model and optimizer state as a ``torch.distributed.checkpoint`` state
    dict (see the module docstring for the layout), without gathering: ZeRO shards as per-parameter
    pieces, whole parameters under their FQN. The optimizer state is created first if no step made it
    yet (see ``materialize_optimizer_state``). ``dcp.save(sd, checkpoint_id=...)`` /
    ``dcp.load(sd, checkpoint_id=...)`` are collective over the world; ``dcp.load`` writes in place
    into the live training state. Needs the step to have run once."""
    return _build(_context(step))


def save(step: Any, path: str) -> None:
    """``dcp.save(sharded_state_dict(step), checkpoint_id=path)``: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state_dict(step), checkpoint_id=path)


def load(step: Any, path: str) -> None:
    """Load a checkpoint directory into the live training state, in place; every rank calls it. Any
    checkpoint in this layout loads, whatever wrote it: ``save`` under another strategy, ZeRO level or
    world size, or DCP from an eager model (``{"model": model.state_dict()}``; without ``optim`` entries
    only the parameters are loaded). Before the step's first call (fresh processes) the shard layout
    does not exist yet: the load is registered and runs inside the first call, right after sharding and
    before that step computes."""
    module = _module_of(step)
    st = _state(step, create=True)

    def run(cs: Any) -> None:
        ctx = _ctx_of(st, cs, module)
        if ctx.unsharded_yet:  # a forward-only call before ZeRO-1/2 sharding: whole parameters now,
            _load_now(ctx, path, model_only=True)
            st.pending.append(run)  # shards and optimizer state at the next call
        else:
            _load_now(ctx, path)

    if st.first_call_done and st.steps:
        run(_context(step).cs)
    else:
        st.pending.append(run)


def _load_now(ctx: _Ctx, path: str, model_only: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    if ctx.module is not None:
        _install_hooks(ctx.st, ctx.module)
    keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    sd = _build(ctx, model_only or not any(k.startswith("optim.") for k in keys))
    if "optim" in sd:  # hyperparameters the checkpoint lacks (e.g. a scheduler's initial_lr) stay as they are
        for i, g in enumerate(sd["optim"]["param_groups"]):
            for k in [k for k in g if f"optim.param_groups.{i}.{k}" not in keys and k != "params"]:
                del g[k]
    dcp.load(sd, checkpoint_id=path)


def materialize_optimizer_state(step: Any) -> None:
    """Create the optimizer state (exp_avg, ...) of what this rank trains before any update, so that a
    state dict holds tensors to load into. Parameters are left bitwise unchanged and step counts at 0:
    for Adam/AdamW, SGD without dampening, Adagrad, RMSprop and Rprop the next update is bitwise the
    one a fresh optimizer would make. Before the first call it is deferred into that call."""
    module = _module_of(step)
    st = _state(step, create=True)
    if st.first_call_done and st.steps:
        ctx = _context(step)
        if ctx.unsharded_yet:
            raise PiperError("piper: the step has only run forward-only (torch.no_grad) calls, and its training "
                             "layout shards parameters that are not sharded yet; run one training call first")
        opt = st.get_optimizer()
        if opt is not None:
            _materialize(ctx, opt)
        return

    def run(cs: Any) -> None:
        ctx = _ctx_of(st, cs, module)
        if ctx.unsharded_yet:
            st.pending.append(run)
            return
        opt = st.get_optimizer()
        if opt is not None:
            _materialize(ctx, opt)

    st.pending.append(run)


def full_state_dict(step: Any) -> dict[str, torch.Tensor]:
    """Every parameter (and persistent buffer) of the model as a full tensor on every rank, under the
    keys of ``model.state_dict()`` (tied weights under each name). A collective over the world: ZeRO
    buckets are all-gathered within their groups, and a parameter that not every rank trains (pipeline
    parallelism) is broadcast from the first rank that trains it."""
    ctx = _context(step)
    values = _full_values(ctx)
    fqn_by_id = {id(p): f for f, p in ctx.params.items()}
    out: dict[str, Any] = {}
    raw = _raw_state_dict(ctx.module) if ctx.module is not None else dict(ctx.params)
    for key, v in raw.items():
        f = fqn_by_id.get(id(v))
        if f is not None:
            out[key] = values[f]
        elif isinstance(v, torch.Tensor):
            out[key] = v.detach().clone()
        else:
            out[key] = v
    return out


def _full_values(ctx: _Ctx) -> dict[str, torch.Tensor]:
    vals: dict[str, torch.Tensor] = {}
    z = ctx.st.zero
    if z is not None and z.sharded:
        for name in sorted(z.buckets):
            b = z.buckets[name]
            vals.update({f: v.clone() for f, v in b.views(z.full_flat(b.name, ctx.groups)).items()})
    vals.update(_gather_pieces(ctx))
    for f, p in ctx.params.items():
        if f not in vals:  # a released parameter (another stage's) has no storage: its owner sends it
            vals[f] = p.detach().clone() if p.untyped_storage().nbytes() else torch.empty(p.shape, dtype=p.dtype,
                                                                                          device=p.device)
    if ctx.world > 1:
        for f in ctx.params:  # the same order on every rank
            own = ctx.owners.get(f)
            if own and len(own) < ctx.world:
                dist.broadcast(vals[f], src=min(own))
    return vals


def _gather_pieces(ctx: _Ctx) -> dict[str, torch.Tensor]:
    """Full values of the expert and tensor-parallel weights this rank holds a piece of, all-gathered
    within each piece's group (the same order on every rank: sorted by fqn, each group's collectives on
    its own group)."""
    return {f: ctx.split[f].gather(ctx.groups) for f in sorted(ctx.split)}


def load_full_state_dict(step: Any, sd: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """Load full tensors (e.g. an eager model's ``state_dict()``) into the run: ``model.load_state_dict``
    with piper's hooks, which also update ZeRO shards (ZeRO-3 parameters get their storage back for the
    copy and lose it again; a low-precision ZeRO-1/2 model's fp32 master shards are refreshed). The
    optimizer state is kept, as in eager. Before the first call it just copies into the module's
    parameters (rank 0's copy is broadcast at that call). Every rank passes the same ``sd``."""
    module = _module_of(step)
    st = _state(step, create=False)
    if st is not None and ((st.zero is not None and st.zero.sharded) or st.released):
        _install_hooks(st, module)
    return module.load_state_dict(sd, strict=strict)


# -- nn.Module state_dict / load_state_dict hooks (installed once the state is sharded) -----------------
_HOOKS_OFF = [0]


def _raw_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict(keep_vars=True)`` without piper's gathering hook."""
    _HOOKS_OFF[0] += 1
    try:
        return module.state_dict(keep_vars=True)
    finally:
        _HOOKS_OFF[0] -= 1


def _groups_of(st: Any) -> Any:
    for cs in st.steps:
        for plan in cs.plans.values():
            if plan.executor.groups is not None:
                return plan.executor.groups
    return None


def _names(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in module.named_parameters(remove_duplicate=False):
        yield prefix + name, p


def _state_dict_hook(st: Any, module: nn.Module, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """ZeRO-3: the module's parameters have no storage; put full tensors, all-gathered from the shards,
    in their place (a collective over each ZeRO-3 bucket's group)."""
    z = st.zero
    if _HOOKS_OFF[0]:
        return
    if st.released:  # other stages' parameters were released: fetch every value from its owners
        cs = next(c for c in st.steps if c.plans)
        vals = _full_values(_ctx_of(st, cs, module))  # a collective over the world
        by_id = {id(p): f for f, p in st.named.items()}
        for key, p in _names(module, prefix):
            if id(p) in by_id and key in sd:
                sd[key] = vals[by_id[id(p)]]
        return
    if z is None or not z.sharded:
        return
    z3 = [z.buckets[n] for n in sorted(z.buckets) if z.buckets[n].level >= 3]
    if not z3:
        return
    groups = _groups_of(st)
    full: dict[int, torch.Tensor] = {}
    for b in z3:
        for f, v in b.views(z.full_flat(b.name, groups)).items():
            full[id(st.named[f])] = v.clone()
    for key, p in _names(module, prefix):
        if id(p) in full and key in sd:
            sd[key] = full[id(p)]


def _load_pre_hook(st: Any, module: nn.Module, *args: Any) -> None:
    """ZeRO-3: give the parameters storage (holding this rank's pieces) so load_state_dict can copy;
    released parameters (other stages', and expert / tensor-parallel weights, of which a rank holds a
    piece) get storage for the copy too (a split weight holding this rank's piece in its place, so that a
    key the state dict lacks keeps it)."""
    for f in sorted(st.released):
        ensure_storage(st.named[f])
    with torch.no_grad():
        for f, sh in sorted(st.shards.items()):
            if f in st.released:
                st.named[f].zero_()
                sh.put(st.named[f])
    z = st.zero
    if z is None or not z.sharded:
        return
    with torch.no_grad():
        for b in (z.buckets[n] for n in sorted(z.buckets)):
            if b.level < 3:
                continue
            for f in b.fqns:
                if ensure_storage(st.named[f]):
                    st.named[f].zero_()
            src = b.shard.detach()
            for f, p_start, s_start, n in b.local_pieces():
                st.named[f].view(-1)[p_start:p_start + n].copy_(src[s_start:s_start + n])


def _load_post_hook(st: Any, module: nn.Module, incompatible: Any) -> None:
    """The loaded full parameters into this rank's shards; ZeRO-3 and released parameters lose their
    storage again; expert and tensor-parallel pieces take theirs from the loaded full weights."""
    with torch.no_grad():
        for f, sh in sorted(st.shards.items()):
            if f in st.released and st.named[f].untyped_storage().nbytes():
                sh.param.copy_(sh.spec.take(st.named[f], sh.rank))
    for f in sorted(st.released):
        if st.named[f].untyped_storage().nbytes():
            free_storage(st.named[f])
    z = st.zero
    if z is None or not z.sharded:
        return
    with torch.no_grad():
        for b in (z.buckets[n] for n in sorted(z.buckets)):
            dst = b.shard.detach()
            if b.level >= 3:
                for f, p_start, s_start, n in b.local_pieces():
                    dst[s_start:s_start + n].copy_(st.named[f].view(-1)[p_start:p_start + n])
                for f in b.fqns:
                    if st.named[f].untyped_storage().nbytes():
                        free_storage(st.named[f])
            elif b.flat is not None:
                lo, hi = b.shard_range()
                if dst.data_ptr() != b.flat[lo:hi].data_ptr():
                    dst.copy_(b.flat[lo:hi])


def _install_hooks(st: Any, module: nn.Module) -> None:
    """Once per model, when its state is sharded (ZeRO): ``model.state_dict()`` returns full tensors
    (ZeRO-3: all-gathered on demand, so every rank of a ZeRO group must call it together) and
    ``model.load_state_dict(full)`` also updates the shards."""
    if st.hooks_installed or ((st.zero is None or not st.zero.sharded or not st.zero.buckets) and not st.released):
        return
    st.hooks_installed = True
    module.register_state_dict_post_hook(functools.partial(_state_dict_hook, st))
    module.register_load_state_dict_pre_hook(functools.partial(_load_pre_hook, st))
    module.register_load_state_dict_post_hook(functools.partial(_load_post_hook, st))


def _caller_module(st: Any) -> nn.Module | None:
    """The module whose compiled forward is making this call: the innermost calling frame whose ``self``
    is an nn.Module holding every parameter of the state (Dynamo runs the compiled forward in the
    module's own frame)."""
    ids = {id(p) for p in st.params}
    f = sys._getframe(1)
    for _ in range(24):
        if f is None:
            break
        m = f.f_locals.get("self") if "self" in f.f_code.co_varnames else None
        if isinstance(m, nn.Module) and ids <= {id(p) for p in m.parameters()}:
            return m
        f = f.f_back
    return None


def _on_sharded(st: Any, cs: Any) -> None:
    if ((st.zero is not None and st.zero.buckets) or st.released) and not st.hooks_installed:
        module = _caller_module(st)
        if module is not None:
            _install_hooks(st, module)


_state_mod.ON_SHARDED.append(_on_sharded)
