"""The public checkpoint functions (``piper.save``, ``piper.load``, ...); see the package docstring."""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from piper_compile.steps import module_of, training_state
from piper_compile.checkpoint import commit, dcp_io, hf
from piper_compile.checkpoint.hooks import install_hooks
from piper_compile.checkpoint.layout import Ctx, ctx_of, raw_state_dict
from piper_compile.checkpoint.state_dict import build, full_buffers, full_values, materialize
from piper_compile.errors import PiperError
from piper_compile.runtime.registry import plain_tensors


class LoadResult(NamedTuple):
    """What ``piper.load`` read: the model's state-dict keys the checkpoint has no entry for
    (``missing_keys``), the parameters the checkpoint holds that the model lacks (``unexpected_keys``;
    both empty unless ``strict=False``), and the directory it read (``path``, or the previous checkpoint
    an interrupted save set aside)."""
    missing_keys: list[str]
    unexpected_keys: list[str]
    path: str


def _context(step: Any) -> Ctx:
    module = module_of(step)
    st = training_state(step, create=False)
    if st is None or not st.first_call_done or not st.steps:
        raise PiperError("piper: this step has not run yet, so it has no training layout to checkpoint; call it "
                         "once first (piper.load(step, path) before the first call is deferred to that call)")
    cs = next((c for c in st.steps if False in c.plans), None) or next(c for c in st.steps if c.plans)
    ctx = ctx_of(st, cs, module)
    install_hooks(st, module)
    return ctx


@plain_tensors
def sharded_state_dict(step: Any) -> dict[str, Any]:
    """This rank's part of the model and optimizer state as a ``torch.distributed.checkpoint`` state
    dict (see the package docstring for the layout), without gathering: ZeRO shards as per-parameter
    pieces, whole parameters under their FQN. The optimizer state is created first if no step made it
    yet (see ``materialize_optimizer_state``). ``dcp.save(sd, checkpoint_id=...)`` /
    ``dcp.load(sd, checkpoint_id=...)`` are collective over the world; ``dcp.load`` writes in place
    into the live training state. Needs the step to have run once."""
    return build(_context(step))


@plain_tensors
def save(step: Any, path: str | os.PathLike[str], format: str = "dcp", max_shard_mb: float = 2048) -> None:  # noqa: A002
    """Save the run's model and optimizer state as the checkpoint directory ``path``, atomically: every
    rank calls it. ``format="hf"`` instead writes the model's tensors as a Hugging Face ``save_pretrained``
    directory (safetensors files of at most ``max_shard_mb``, their index, the transformers model's
    ``config.json``; no optimizer state), gathered a file at a time (``checkpoint/hf.py``). The ranks write ``sharded_state_dict(step)`` through DCP into a temporary sibling
    ``<path>.tmp-<id>``; once every rank's files and DCP's metadata are written, rank 0 records the files
    (``.piper_commit.json``) and renames the directory to ``path``, replacing the previous checkpoint
    there. A save that fails or is killed on any rank before that leaves the previous checkpoint at
    ``path``; a failure raises a ``piper:`` error on every rank that is still running."""
    if format == "hf":
        hf.save(_context(step), os.fspath(path), max_shard_mb)
        return
    if format != "dcp":
        raise PiperError(f"piper: piper.save(format={format!r}): write 'dcp' (piper's sharded checkpoint, with "
                         "optimizer state) or 'hf' (a Hugging Face safetensors directory of the model)")
    dcp_io.save(sharded_state_dict(step), os.fspath(path))


@plain_tensors
def load(step: Any, path: str | os.PathLike[str], strict: bool = True) -> LoadResult:
    """Load the checkpoint directory ``path`` into the live training state, in place; every rank calls it.
    A Hugging Face ``save_pretrained`` directory (safetensors) loads the model's tensors, each rank reading
    only its own pieces (``checkpoint/hf.py``).
    Any checkpoint in this layout loads, whatever wrote it: ``save`` under another strategy, ZeRO level or
    world size, or DCP from an eager model (``{"model": model.state_dict()}``; without ``optim`` entries
    only the parameters are loaded). Before the step's first call (fresh processes) the shard layout
    does not exist yet: the load is registered and runs inside the first call, right after sharding and
    before that step computes.

    Refused at once (``piper:`` error naming the path and what is wrong): a directory that is not a
    complete committed checkpoint -- files missing or of another size than its commit record says, a
    temporary directory of a save that did not finish, no DCP ``.metadata``, data files shorter than the
    metadata says (see ``commit.verify``). If a save was killed while replacing ``path``, the previous
    checkpoint it had set aside is loaded (with a warning).

    ``strict`` (default): the checkpoint's parameters and the model's must be the same, as in
    ``nn.Module.load_state_dict``; otherwise raises naming the parameters the checkpoint holds that the
    model lacks and those the model has that the checkpoint lacks. ``strict=False`` loads the entries both
    have, warns, and returns the others in the ``LoadResult``. A checkpoint without optimizer state is
    not a mismatch: only the parameters are loaded."""
    module = module_of(step)
    st = training_state(step, create=True)
    if hf.is_hf_checkpoint(os.fspath(path)):
        return _load_hf(step, module, st, os.fspath(path), strict)
    directory, metadata = commit.resolve(os.fspath(path))
    model_keys = [k for k, v in raw_state_dict(module).items() if isinstance(v, torch.Tensor)]
    missing, unexpected = dcp_io.check_keys(model_keys, metadata, directory, strict)

    def run(cs: Any) -> None:
        ctx = ctx_of(st, cs, module)
        if ctx.unsharded_yet:  # a forward-only call before ZeRO-1/2 sharding: whole parameters now,
            _load_now(ctx, directory, metadata, strict, model_only=True)
            st.pending.append(run)  # shards and optimizer state at the next call
        else:
            _load_now(ctx, directory, metadata, strict)

    if st.first_call_done and st.steps:
        run(_context(step).cs)
    else:
        st.pending.append(run)
    return LoadResult(missing, unexpected, directory)


def _load_hf(step: Any, module: Any, st: Any, path: str, strict: bool) -> LoadResult:
    """A Hugging Face safetensors directory (``checkpoint/hf.py``): the model's tensors, each rank reading
    its own pieces; now, or inside the first call when the step has not run yet."""
    missing, unexpected, _, _ = hf.check(module, path, strict)

    def run(cs: Any) -> None:
        ctx = ctx_of(st, cs, module)
        install_hooks(st, module)
        hf.load(ctx, path, strict)

    if st.first_call_done and st.steps:
        run(_context(step).cs)
    else:
        st.pending.append(run)
    return LoadResult(missing, unexpected, path)


def _load_now(ctx: Ctx, directory: str, metadata: Any, strict: bool, model_only: bool = False) -> None:
    if ctx.module is not None:
        install_hooks(ctx.st, ctx.module)
    keys = set(metadata.state_dict_metadata)
    sd = build(ctx, model_only or not any(k.startswith("optim.") for k in keys))
    if not any(k.startswith("loss_scaler.") for k in keys):  # saved without fp16 loss scaling: the scale
        sd.pop("loss_scaler", None)  # starts from init_scale, as in a fresh run
    if "optim" in sd:  # hyperparameters the checkpoint lacks (e.g. a scheduler's initial_lr) stay as they are
        for i, g in enumerate(sd["optim"]["param_groups"]):
            for k in [k for k in g if f"optim.param_groups.{i}.{k}" not in keys and k != "params"]:
                del g[k]
    dcp_io.load(sd, directory, strict)


@plain_tensors
def materialize_optimizer_state(step: Any) -> None:
    """Create the optimizer state (exp_avg, ...) of what this rank trains before any update, so that a
    state dict holds tensors to load into. Parameters are left bitwise unchanged and step counts at 0:
    for Adam/AdamW, SGD without dampening, Adagrad, RMSprop and Rprop the next update is bitwise the
    one a fresh optimizer would make. Before the first call it is deferred into that call."""
    module = module_of(step)
    st = training_state(step, create=True)
    if st.first_call_done and st.steps:
        ctx = _context(step)
        if ctx.unsharded_yet:
            raise PiperError("piper: the step has only run forward-only (torch.no_grad) calls, and its training "
                             "layout shards parameters that are not sharded yet; run one training call first")
        opt = st.get_optimizer()
        if opt is not None:
            materialize(ctx, opt)
        return

    def run(cs: Any) -> None:
        ctx = ctx_of(st, cs, module)
        if ctx.unsharded_yet:
            st.pending.append(run)
            return
        opt = st.get_optimizer()
        if opt is not None:
            materialize(ctx, opt)

    st.pending.append(run)


@plain_tensors
def full_state_dict(step: Any) -> dict[str, torch.Tensor]:
    """Every parameter (and persistent buffer) of the model as a full tensor on every rank, under the
    keys of ``model.state_dict()`` (tied weights under each name). A collective over the world: ZeRO
    buckets are all-gathered within their groups, and a parameter that not every rank trains (pipeline
    parallelism) is broadcast from the first rank that trains it."""
    ctx = _context(step)
    values = full_values(ctx)
    by_id = {id(p): values[f] for f, p in ctx.params.items()}
    by_id.update({i: v.clone() for i, v in full_buffers(ctx).items()})  # another stage's: from its holder
    out: dict[str, Any] = {}
    raw = raw_state_dict(ctx.module) if ctx.module is not None else dict(ctx.params)
    for key, v in raw.items():
        if id(v) in by_id:
            out[key] = by_id[id(v)]
        elif isinstance(v, torch.Tensor):
            out[key] = v.detach().clone()
        else:
            out[key] = v
    return out


@plain_tensors
def load_full_state_dict(step: Any, sd: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """Load full tensors (e.g. an eager model's ``state_dict()``) into the run: ``model.load_state_dict``
    with piper's hooks, which also update ZeRO shards (ZeRO-3 parameters get their storage back for the
    copy and lose it again; a low-precision ZeRO-1/2 model's fp32 master shards are refreshed). The
    optimizer state is kept, as in eager. Before the first call it just copies into the module's
    parameters (rank 0's copy is broadcast at that call). Every rank passes the same ``sd``."""
    module = module_of(step)
    st = training_state(step, create=False)
    if st is not None and ((st.zero is not None and st.zero.sharded) or st.released or st.released_buffers):
        install_hooks(st, module)
    return module.load_state_dict(sd, strict=strict)
