"""Models built on the meta device: each rank allocates and initializes only what it holds.

``piper.compile(model, ...)`` on a model with meta parameters or buffers: at the first call, before
Dynamo traces, ``defer`` records the model's init programs (``init/record.py``) and swaps every meta
tensor (keeping its Python object, so ties, optimizers and the user's references stay valid) for a
tensor of the same shape on the batch's device with *no storage*, as piper's released parameters are.
Dynamo and piper capture and plan with those. Where the first step would broadcast rank 0's weights,
``materialize_state`` instead gives storage to what this rank's plan holds -- whole parameters and
buffers its program reads, its expert / tensor-parallel pieces, its ZeRO-3 shards (only the shard) --
and fills each from the init programs (``init/replay.py``). Other stages' weights and buffers and ZeRO-3
parameters never get storage.

``options["init"]``: ``"module"`` (default) runs each module's ``reset_parameters()``, or
``options["init_fn"](module)`` applied as ``model.apply(init_fn)`` (``init=init_fn`` is short for both);
``"checkpoint"`` leaves the parameters for ``piper.load`` (buffers are still initialized the same way:
non-persistent ones are in no checkpoint).
``options["init_seed"]`` (default 0) keys the random values; ``piper.materialize(model, seed=...)``
builds the same values on one device.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from piper_compile.errors import PiperError
from piper_compile.init.record import InitPlan, meta_tensors, record, swapped
from piper_compile.init.replay import Replayer, swap_in
from piper_compile.runtime.zero import no_storage

INIT_MODES = ("module", "checkpoint")


@dataclass
class InitChoice:
    """``options["init"]`` and ``options["init_seed"]``, checked."""

    mode: str = "module"
    fn: Callable[[nn.Module], Any] | None = None
    seed: int = 0

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> "InitChoice":
        options = options or {}
        raw, seed, fn = options.get("init", "module"), options.get("init_seed", 0), options.get("init_fn")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise PiperError(f"piper: options['init_seed'] must be an int (it keys every rank's random init values), "
                             f"got {seed!r}")
        if fn is not None and not callable(fn):
            raise PiperError(f"piper: options['init_fn'] must be a function init_fn(module), applied as "
                             f"model.apply(init_fn) instead of each module's reset_parameters(); got {fn!r}")
        if callable(raw):  # init=init_fn: shorthand for init="module", init_fn=init_fn
            return cls("module", raw, seed)
        if raw not in INIT_MODES:
            raise PiperError(f"piper: options['init'] must be 'module' (each module's reset_parameters(), or "
                             f"options['init_fn']), 'checkpoint' (parameters come from piper.load; buffers are still "
                             f"initialized) or a function init_fn(module) applied as model.apply(init_fn); got {raw!r}")
        return cls(raw, fn, seed)


class Deferred:
    """A meta model's init programs and the stand-ins its meta tensors became (see the module docstring)."""

    def __init__(self, model: nn.Module, plan: InitPlan, choice: InitChoice) -> None:
        self.plan, self.choice = plan, choice
        self.replayer = Replayer(plan, model, choice.seed)

    def key(self, t: torch.Tensor) -> str | None:
        """The init key of a stand-in (None for any other tensor)."""
        return self.plan.ids.get(id(t))

    def _left_for_load(self, t: torch.Tensor) -> bool:
        """``init="checkpoint"``: parameters are written by ``piper.load``, not initialized."""
        return self.choice.mode == "checkpoint" and isinstance(t, nn.Parameter)

    def fill_whole(self, t: torch.Tensor) -> None:
        """Give ``t`` (a stand-in) storage and its whole init value."""
        from piper_compile.runtime.zero import ensure_storage

        ensure_storage(t)
        self.fill_flat(t, 0, t.detach().view(-1))

    def fill_flat(self, t: torch.Tensor, start: int, dest: torch.Tensor) -> None:
        """``dest`` (1-D) := elements ``[start, start + len)`` of ``t``'s init value (row-major)."""
        key = self.plan.ids[id(t)]
        if self._left_for_load(t):
            return
        if dest.is_contiguous() and dest.device.type == "cpu":
            self.replayer.fill(key, [(start, dest)])
            return
        tmp = torch.empty(dest.numel(), dtype=dest.dtype)
        self.replayer.fill(key, [(start, tmp)])
        dest.copy_(tmp)

    def fill_box(self, t: torch.Tensor, offsets: tuple[int, ...], view: torch.Tensor) -> None:
        """``view`` := the box of ``t``'s init value at ``offsets`` with ``view``'s sizes."""
        shape = tuple(t.shape)
        tmp = torch.empty(tuple(view.shape), dtype=view.dtype)
        k = max((d for d in range(len(shape)) if offsets[d] != 0 or view.shape[d] != shape[d]), default=0)
        stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        runs = []
        for index in itertools.product(*map(range, view.shape[:k])):
            start = sum((offsets[d] + index[d]) * stride[d] for d in range(k)) + offsets[k] * stride[k]
            runs.append((start, tmp[index].reshape(-1)))
        if self._left_for_load(t):
            return
        self.replayer.fill(self.plan.ids[id(t)], runs)
        view.copy_(tmp)


def defer(model: nn.Module, device: Any, options: dict[str, Any] | None) -> Deferred | None:
    """Record ``model``'s init and swap its meta tensors for storage-less stand-ins on ``device``; None
    when nothing of it is on the meta device."""
    metas = list(meta_tensors(model))
    if not metas:
        return None
    choice = InitChoice.parse(options)
    plan = record(model, choice.fn, params_required=choice.mode != "checkpoint")
    for _, t in metas:
        swap_in(t, no_storage(tuple(t.shape), t.dtype, device))
    return Deferred(model, plan, choice)


def planning(model: nn.Module, args: tuple[Any, ...]) -> contextlib.AbstractContextManager[None]:
    """``stand_ins`` on the device of the first tensor of ``args`` for a model with meta tensors; else
    nothing."""
    if next(meta_tensors(model), None) is None:
        return contextlib.nullcontext()
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    return stand_ins(model, device)


@contextlib.contextmanager
def stand_ins(model: nn.Module, device: Any) -> Iterator[None]:
    """Planning a meta model (``piper.plan``, ``piper.autoplan``): while inside, the model's parameter and
    buffer slots hold storage-less stand-ins on ``device`` for its meta tensors (new objects: the plan
    keeps them); afterwards the model holds its own meta tensors again, untouched."""

    def stand_in(t: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, no_storage(tuple(t.shape), t.dtype, device) if t.is_meta else t

    with swapped(model, stand_in):
        yield


def materialize_state(state: Any, buffers: dict[str, torch.Tensor], deferred: Deferred) -> None:
    """At the first call (where a built model's weights are broadcast from rank 0): storage and init
    values for what this rank holds -- whole parameters its programs read, its expert / tensor-parallel
    pieces (the full weight never gets storage) and every buffer it does not release. ZeRO-3 parameters
    wait for ``TrainState.shard``, which fills only the shard (``zero_fill``); other stages' weights and
    buffers get nothing."""
    if deferred.choice.mode == "checkpoint" and not state.pending:
        raise PiperError("piper: options['init']='checkpoint' leaves the parameters for piper.load, but no "
                         "piper.load(step, path) was called before the first step; call it first, or use "
                         "options['init']='module'")
    zero = state.zero.buckets.values() if state.zero is not None else ()
    zero3 = {f for b in zero if b.level >= 3 for f in b.fqns}
    with torch.no_grad():
        for f, p in sorted(state.named.items()):
            if deferred.key(p) is None or f in state.to_release:
                continue
            sh = state.shards.get(f)
            if sh is not None:
                for off, view in sh.boxes(sh.param.detach()):
                    deferred.fill_box(p, tuple(off), view)
                state.released.add(f)
            elif f not in zero3:
                deferred.fill_whole(p)
        for f, b in buffers.items():
            if deferred.key(b) is not None and f not in state.buffers_to_release:
                deferred.fill_whole(b)


def zero_fill(state: Any, deferred: Deferred) -> Callable[[str, int, torch.Tensor], None]:
    """How ``ZeroState.shard_`` fills a ZeRO-3 shard's range of parameter ``fqn`` (from ``start`` of the
    tensor the bucket holds): from its init program, or from this rank's tensor-parallel piece."""

    def fill(fqn: str, start: int, dest: torch.Tensor) -> None:
        sh = state.shards.get(fqn)
        if sh is not None:
            dest.copy_(sh.param.detach().reshape(-1)[start:start + dest.numel()])
        else:
            deferred.fill_flat(state.named[fqn], start, dest)

    return fill
