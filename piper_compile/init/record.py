"""Recording a meta-device model's initialization as a program per tensor.

A model built under ``torch.device("meta")`` has shapes and no values. Its modules' own initializers
(``reset_parameters()``, or a user ``init_fn(module)`` applied as ``model.apply(init_fn)``) are run once
on the meta tensors under a dispatch mode that writes down every in-place op they apply to a parameter or
buffer: ``uniform_(-b, b)``, ``normal_(0, 0.02)``, ``fill_(1)``, ``zero_()`` on a row (an embedding's
padding index), the ``erfinv_``/``mul_``/``clamp_`` chain of ``trunc_normal_``. Those are elementwise
(random ones keyed by position, ``init/replay.py``), so any piece of a tensor -- a ZeRO-3 shard's flat
range, a tensor-parallel column block, a rank's experts -- can be computed alone, equal to the same piece
of the whole tensor. A call that does anything else with a tensor (reads it into another op, copies a
meta value in, QR for ``orthogonal_``) is kept as a *fallback*: it is run again on full real tensors of
its module when needed (``init/replay.py``), which is exact but materializes that module whole.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from piper_compile.errors import PiperError

InitFn = Callable[[nn.Module], Any]

# In-place ops whose result at an element depends on the element's old value and scalar arguments only
# (random ones also on its position): replayable on any piece of the tensor.
RANDOM = frozenset({"uniform_", "normal_", "bernoulli_", "exponential_", "log_normal_", "cauchy_",
                    "geometric_", "random_"})
ELEMENTWISE = frozenset({"fill_", "zero_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_",
                         "erfinv_", "abs_", "neg_", "exp_", "log_", "sqrt_", "tanh_", "pow_", "sign_", "floor_",
                         "ceil_", "round_", "reciprocal_", "copy_", "sigmoid_", "fmod_", "remainder_"})

# Ops that read a tensor's metadata only (its values stay unread).
METADATA = frozenset({"size", "stride", "sym_size", "sym_stride", "sym_numel", "numel", "sym_storage_offset",
                      "storage_offset", "is_contiguous", "dim", "is_strides_like_format",
                      "is_non_overlapping_and_dense", "empty_like", "new_empty", "new_empty_strided", "new_zeros",
                      "new_ones", "new_full", "zeros_like", "ones_like", "full_like"})


@dataclass(frozen=True, slots=True)
class View:
    """The elements of a tensor an op wrote through a view: sizes, strides and offset in its storage."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def flat_indices(self) -> torch.Tensor:
        """Flat (row-major, contiguous base) index of each element of the view, in the view's order."""
        idx = torch.full((), self.offset, dtype=torch.int64)
        for n, s in zip(self.size, self.stride):
            idx = idx.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
        return idx.reshape(-1)


@dataclass(frozen=True, slots=True)
class InitOp:
    """One recorded in-place op on a tensor (``view``: None when it covers the whole tensor in order)."""

    func: Any  # the aten OpOverload
    view: View | None
    args: tuple[Any, ...]  # after the target; tensors only as real 0-dim values
    kwargs: tuple[tuple[str, Any], ...]  # without ``generator`` (replay draws from its own)
    index: int  # position in the tensor's program: keys the random stream

    @property
    def random(self) -> bool:
        return self.func.overloadpacket.__name__ in RANDOM


@dataclass(frozen=True, slots=True)
class Fallback:
    """The tensor's value here is what the init call ``call`` leaves when run on full real tensors."""

    call: int


Step = InitOp | Fallback


@dataclass
class Call:
    """One init call (``reset_parameters()`` of a module, or ``init_fn(module)``)."""

    index: int
    module: str  # its FQN ("" for the root)
    fn: Callable[[], Any]  # runs the call on the module as it is at replay time
    why: str = ""  # why it is a fallback ("" when its ops were replayable)


@dataclass
class InitPlan:
    """Every meta tensor's init program, keyed by a stable name (the tensor's first FQN)."""

    programs: dict[str, list[Step]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    names: dict[StorageWeakRef, str] = field(default_factory=dict)  # a fake stand-in's storage -> key (recording)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    real: set[StorageWeakRef] = field(default_factory=set)  # the model's tensors that are not on meta
    ids: dict[int, str] = field(default_factory=dict)  # id(tensor object) -> key (kept across swap_tensors)


def meta_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(first FQN, tensor) of every parameter and buffer of ``model`` on the meta device, ties once."""
    seen: set[int] = set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is not None and t.is_meta and id(t) not in seen:
            seen.add(id(t))
            yield name, t


class _Recorder(TorchDispatchMode):
    """Writes down in-place ops on the model's meta tensors during one init call; notes anything else
    that touches them (``why``) and does not change the model's real tensors."""

    def __init__(self, plan: InitPlan) -> None:
        super().__init__()
        self.plan = plan
        self.ops: list[tuple[str, InitOp]] = []
        self.why = ""
        self.touched: set[str] = set()  # keys of every meta tensor an op of the call took

    def _key(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        return self.plan.names.get(StorageWeakRef(t.untyped_storage()))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        target = args[0] if args else None
        key = self._key(target)
        self.touched.update(k for k in map(self._key, _tensors(args, kwargs)) if k is not None)
        inplace = name.endswith("_") and func._schema.arguments and func._schema.arguments[0].alias_info is not None \
            and func._schema.arguments[0].alias_info.is_write
        if isinstance(target, torch.Tensor) and key is None and inplace \
                and StorageWeakRef(target.untyped_storage()) in self.plan.real:
            return target  # a real tensor of a partly-meta model keeps the values it was built with
        if key is not None and inplace:
            self._record(func, name, key, target, args[1:], kwargs)
        elif self._reads(func, name, args, kwargs):
            self.why = self.why or f"{func} reads a tensor being initialized"
        return func(*args, **kwargs)

    def _reads(self, func: Any, name: str, args: Any, kwargs: dict) -> bool:
        """Whether a non-inplace op reads the values of a tensor being initialized (views and metadata
        queries do not)."""
        if func.is_view or func.namespace == "prim" or name in METADATA:
            return False
        return any(self._key(a) is not None for a in _tensors(args, kwargs))

    def _record(self, func: Any, name: str, key: str, target: torch.Tensor, rest: tuple, kwargs: dict) -> None:
        if name not in RANDOM and name not in ELEMENTWISE:
            self.why = self.why or f"{func} is not elementwise"
            return
        values = []
        for a in rest:
            if isinstance(a, torch.Tensor):
                if a.dim() > 0 or isinstance(a, FakeTensor) and a.constant is None:
                    self.why = self.why or f"{func} takes a tensor argument of shape {tuple(a.shape)}"
                    return
                a = (a.constant if isinstance(a, FakeTensor) else a).detach().clone()
            values.append(a)
        shape, _ = self.plan.shapes[key]
        view = _view_of(target, shape)
        kw = tuple((k, v) for k, v in kwargs.items() if k != "generator")
        self.ops.append((key, InitOp(func, view, tuple(values), kw, 0)))


def _tensors(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _view_of(t: torch.Tensor, shape: tuple[int, ...]) -> View | None:
    """None when ``t`` is the whole (contiguous) tensor in row-major order, else its elements."""
    if t.storage_offset() == 0 and t.numel() == math.prod(shape) and t.is_contiguous():
        return None
    return View(tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _calls(model: nn.Module, init_fn: InitFn | None) -> list[tuple[str, nn.Module, Callable[[], Any]]]:
    """The init calls in ``model.apply`` order (children first): ``init_fn(module)`` for every module, or
    ``module.reset_parameters()`` for those that have one. Modules with no meta tensor are skipped."""
    out = []
    for name, mod in _post_order(model):
        if not any(t.is_meta for t in [*mod.parameters(), *mod.buffers()]):
            continue
        if init_fn is not None:
            out.append((name, mod, (lambda m=mod: init_fn(m))))
        elif callable(getattr(mod, "reset_parameters", None)):
            out.append((name, mod, mod.reset_parameters))
    return out


def _post_order(model: nn.Module, prefix: str = "", seen: set[int] | None = None) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` in the order ``model.apply`` visits them: children before their parent."""
    seen = set() if seen is None else seen
    out: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if id(child) not in seen:
            seen.add(id(child))
            out += _post_order(child, f"{prefix}{name}.", seen)
    out.append((prefix.rstrip("."), model))
    return out


def record(model: nn.Module, init_fn: InitFn | None = None, params_required: bool = True) -> InitPlan:
    """Every meta tensor's init program (see the module docstring). The calls run on fake CPU tensors
    standing in for the meta ones (``torch.nn.init`` skips meta tensors outright). Raises, naming them,
    when some meta buffer, or parameter (``params_required``; not when a checkpoint load fills them), is
    written by no init call."""
    plan = InitPlan()
    plan.real = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    for key, t in meta_tensors(model):
        plan.ids[id(t)] = key
        plan.programs[key] = []
        plan.shapes[key] = (tuple(t.shape), t.dtype)
    calls = _calls(model, init_fn)
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> tuple[str | None, torch.Tensor]:
        key = plan.ids.get(id(t))
        if key is None:
            return None, t
        with mode:
            f = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        plan.names[StorageWeakRef(f.untyped_storage())] = key
        return key, f

    with swapped(model, fake):
        for index, (name, mod, fn) in enumerate(calls):
            rec = _Recorder(plan)
            try:
                with torch.no_grad(), mode, rec:
                    fn()
            except Exception as e:  # noqa: BLE001 - e.g. .item() of a random value: run it on real tensors
                rec.why = rec.why or f"it raised on fake tensors ({type(e).__name__}: {str(e)[:80]})"
                rec.touched.update(plan.names[StorageWeakRef(t.untyped_storage())]
                                   for t in [*mod.parameters(), *mod.buffers()]
                                   if StorageWeakRef(t.untyped_storage()) in plan.names)
            call = Call(index, name, fn, rec.why)
            plan.calls.append(call)
            _append(plan, call, rec)
    params = {id(p) for p in model.parameters()}
    _check_covered(plan, init_fn, {k for i, k in plan.ids.items() if params_required or i not in params})
    return plan


def _append(plan: InitPlan, call: Call, rec: _Recorder) -> None:
    """The call's ops onto each tensor's program, or one ``Fallback`` step on every meta tensor the call
    touched (all of its module's when it raised)."""
    if not call.why:
        for key, op in rec.ops:
            prog = plan.programs[key]
            prog.append(dataclasses.replace(op, index=len(prog)))
        return
    for key in sorted(rec.touched):
        plan.programs[key].append(Fallback(call.index))


def _check_covered(plan: InitPlan, init_fn: InitFn | None, keys: set[str]) -> None:
    """Every meta tensor of ``keys`` has a program that starts by writing all of it."""
    bad = [k for k, prog in plan.programs.items() if k in keys and (
           not prog or (isinstance(prog[0], InitOp) and (prog[0].view is not None or not _overwrites(prog[0]))))]
    if bad:
        more = f", ... ({len(bad)} in all)" if len(bad) > 4 else ""
        how = "init_fn" if init_fn is not None else "reset_parameters()"
        raise PiperError(
            f"piper: options['init']: {', '.join(bad[:4])}{more} are on the meta device and no {how} call sets all of "
            "their values first (a meta tensor has no values to keep). Give options['init_fn'] a function init_fn(module) "
            "that sets them (piper applies it as model.apply(init_fn)), add reset_parameters() to their modules, or "
            "create those tensors off the meta device")


def _overwrites(op: InitOp) -> bool:
    """Whether the op's result does not depend on the old values (a first write)."""
    name = op.func.overloadpacket.__name__
    return op.random or name in ("fill_", "zero_", "copy_")


@contextlib.contextmanager
def swapped(mod: nn.Module, real: Any) -> Iterator[Any]:
    """Every parameter and buffer slot of ``mod`` (recursively) holds ``real(t)``'s tensor instead of its own
    ``t`` while inside (fake stand-ins for recording, full CPU values for a fallback call, storage-less
    stand-ins for planning; a tied tensor gets one shared object); yields a function returning the keyed
    slots' values now, by key."""
    made: dict[int, tuple[str | None, torch.Tensor]] = {}
    saved: list[tuple[dict[str, Any], str, Any]] = []
    slots: list[tuple[dict[str, Any], str, str | None]] = []
    for sub in mod.modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    key, value = real(t)
                    made[id(t)] = (key, nn.Parameter(value, requires_grad=t.requires_grad) if is_param else value)
                saved.append((table, name, t))
                slots.append((table, name, made[id(t)][0]))
                table[name] = made[id(t)][1]
    try:
        yield lambda: {key: table[name] for table, name, key in slots if key is not None}
    finally:
        for table, name, t in saved:
            table[name] = t
