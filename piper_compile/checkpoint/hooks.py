"""``nn.Module`` ``state_dict`` / ``load_state_dict`` hooks, installed once a run's state is sharded
(ZeRO, released pipeline stages, expert / tensor-parallel pieces): ``model.state_dict()`` returns full
tensors and ``model.load_state_dict(full)`` updates the shards."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from piper_compile.capture.frame_versions import calling_module
from piper_compile.checkpoint.layout import HOOKS_OFF, ctx_of, groups_of
from piper_compile.checkpoint.state_dict import full_buffers, full_values
from piper_compile.runtime import state as _state_mod
from piper_compile.runtime.zero import ensure_storage, free_storage


def _names(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, p in module.named_parameters(remove_duplicate=False):
        yield prefix + name, p
    for name, b in module.named_buffers(remove_duplicate=False):
        yield prefix + name, b


def _state_dict_hook(st: Any, module: nn.Module, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """ZeRO-3: the module's parameters have no storage; put full tensors, all-gathered from the shards,
    in their place (a collective over each ZeRO-3 bucket's group). Released parameters (other pipeline
    stages' parameters and buffers): every value from its holders (a collective over the world)."""
    z = st.zero
    if HOOKS_OFF[0]:
        return
    if st.released or st.released_buffers:  # other stages' tensors were released: fetch them from their holders
        cs = next(c for c in st.steps if c.plans)
        ctx = ctx_of(st, cs, module)
        vals = full_values(ctx)  # a collective over the world
        by_id = {id(p): vals[f] for f, p in st.named.items()}
        by_id.update(full_buffers(ctx))  # a collective over the world
        for key, p in _names(module, prefix):
            if id(p) in by_id and key in sd:
                sd[key] = by_id[id(p)]
        return
    if z is None or not z.sharded:
        return
    z3 = [z.buckets[n] for n in sorted(z.buckets) if z.buckets[n].level >= 3]
    if not z3:
        return
    groups = groups_of(st)
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
    for f in sorted(st.released_buffers):
        ensure_storage(st.buffers_to_release[f])
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
    for f in sorted(st.released_buffers):
        free_storage(st.buffers_to_release[f])
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


def install_hooks(st: Any, module: nn.Module) -> None:
    """Once per model, when its state is sharded (ZeRO) or released (pipeline stages: other stages'
    weights): ``model.state_dict()`` returns full tensors (ZeRO-3: all-gathered on demand, so every rank
    of a ZeRO group must call it together; released weights: fetched from their owners, so every rank of
    the world must) and ``model.load_state_dict(full)`` also updates the shards."""
    if st.hooks_installed or ((st.zero is None or not st.zero.sharded or not st.zero.buckets) and not st.released
                              and not st.released_buffers):
        return
    st.hooks_installed = True
    # Released tensors are marked between steps (runtime/released.py): plain while the hooks read them.
    module.register_state_dict_pre_hook(_Hook(_unmark, st))
    module.register_state_dict_post_hook(_Hook(_state_dict_hook, st))
    module.register_state_dict_post_hook(_Hook(_mark, st))
    module.register_load_state_dict_pre_hook(_Hook(_unmark, st))
    module.register_load_state_dict_pre_hook(_Hook(_load_pre_hook, st))
    module.register_load_state_dict_post_hook(_Hook(_load_post_hook, st))
    module.register_load_state_dict_post_hook(_Hook(_mark, st))


def _unmark(st: Any, *_: Any) -> None:
    st.hook_unmarked = st.unmark_released()


def _mark(st: Any, *_: Any) -> None:
    """Mark again what this hook's pre-hook unmarked (inside a public function that unmarked them itself,
    ``registry.plain_tensors``, that function marks them when it returns)."""
    if st.hook_unmarked:
        st.hook_unmarked = False
        st.mark_released()


class _Hook:
    """A module hook bound to a run's training state. A pickled or copied module (``torch.save(model)``,
    ``copy.deepcopy(model)`` for an EMA) gets a hook that does nothing: the copy is not compiled, its
    tensors are its own, and the state (optimizer, process groups, compiled code) is not copied with it."""

    def __init__(self, fn: Any, st: Any) -> None:
        self.fn, self.st = fn, st

    def __call__(self, *args: Any) -> Any:
        return self.fn(self.st, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())


def _inert() -> Any:
    return _nothing


def _nothing(*_: Any) -> None:
    return None


def _on_sharded(st: Any, cs: Any) -> None:
    if ((st.zero is not None and st.zero.buckets) or st.released or st.released_buffers) and not st.hooks_installed:
        link = getattr(cs, "link", None)  # piper.compile: the module itself; torch.compile: its frame
        module = link.module() if link is not None and link.module() is not None else calling_module(st.params)
        if module is not None:
            install_hooks(st, module)


_state_mod.ON_SHARDED.append(_on_sharded)
