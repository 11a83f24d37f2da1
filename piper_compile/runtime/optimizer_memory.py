"""Memory an optimizer step holds while it runs, beyond the optimizer state: measured, and predicted.

``torch.optim`` implementations make temporaries. The per-tensor loop (torch's default on CPU) makes a
few tensors the size of the parameter it is updating (Adam: ``sqrt(v)`` and its quotient), so it holds
about twice the largest parameter at once; ``foreach`` (torch's default on CUDA) makes each of them for
every parameter of a group at once, about the size of all parameters; ``fused`` makes none. Which one
runs is piper's choice (``runtime/optimizer.build_optimizer``: fused where known correct) or the user's.

:class:`Allocations` measures it: the bytes of tensors made while it is active, at their peak (a torch
dispatch mode; the runtime measures the second update of a run with it, the first also making the
state: ``memory_report``'s ``optimizer_step``). :func:`step_transient` predicts it for the memory plan
without hand-written rules per optimizer: the optimizer, built as the run would build it (same class,
hyperparameters and implementation), steps on three sets of small scratch parameters under
:class:`Allocations`, and their peaks fit ``max_i (p * t[i-1] + c * t[i]) + b * sum(t)`` bytes over the
tensors ``t`` it updates (``c``: temporaries of the tensor being updated, ``p``: of the one before, still
held; ``b``: of every tensor at once), which then applies to the rank's own tensors. Any optimizer,
third-party ones included, is measured the same way.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from piper_compile.knobs import knob

# Probe parameter sizes (elements): (small, N), (N, N), (N, N, N). With the model below, their peaks are
# (c + b), (p + c + 2b) and (p + c + 3b) times N's bytes (the small tensor counts for nothing).
_N = 4096
_PROBES: tuple[tuple[int, ...], ...] = ((1, _N), (_N, _N), (_N, _N, _N))


class Allocations(TorchDispatchMode):
    """While active: bytes of the tensors ops make (not their in-place or ``out=`` results), ``live`` now
    and at their ``peak``. A tensor counts until its Python object dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if nbytes and ptr not in inputs and ptr not in self._seen:
                self._seen.add(ptr)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, ptr, nbytes)
        return out

    def _free(self, ptr: int, nbytes: int) -> None:
        self._seen.discard(ptr)
        self.live -= nbytes


def implementation(factory: Callable[..., Any], device_type: str, dtype: torch.dtype) -> dict[str, bool]:
    """The ``fused`` / ``foreach`` flags the optimizer ``factory`` runs with for parameters of
    ``device_type`` and ``dtype``: the factory's own choice, else piper's (``build_optimizer``: fused where
    known correct), else torch's default (foreach on CUDA, the per-tensor loop elsewhere)."""
    from piper_compile.runtime.optimizer import fused_is_correct

    kw = factory.keywords if isinstance(factory, functools.partial) else {}
    if "fused" in kw or "foreach" in kw:  # as build_optimizer: built as given (None: torch's default)
        fused, foreach = bool(kw.get("fused")), kw.get("foreach")
        return {"fused": fused, "foreach": not fused and (device_type == "cuda" if foreach is None else bool(foreach))}
    cls = getattr(factory, "func", factory)
    if knob("PIPER_FUSED_OPTIMIZER") and isinstance(cls, type) and \
            fused_is_correct(factory, cls, torch.device(device_type), dtype):
        return {"fused": True, "foreach": False}
    return {"fused": False, "foreach": device_type == "cuda"}


def flags_of(opt: torch.optim.Optimizer) -> dict[str, bool]:
    """The ``fused`` / ``foreach`` flags a built optimizer runs with (torch's default resolved)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    fused, foreach = opt.defaults.get("fused"), opt.defaults.get("foreach")
    if fused or foreach is not None:
        return {"fused": bool(fused), "foreach": bool(foreach)}
    params = [p for g in opt.param_groups for p in g["params"]]
    _, default = _default_to_fused_or_foreach(params, False, False)
    return {"fused": False, "foreach": bool(default)}


_FITTED: dict[tuple[str, bool, bool], tuple[float, float, float]] = {}


def _coefficients(factory: Callable[..., Any], fused: bool, foreach: bool) -> tuple[float, float, float]:
    """(p, c, b) of the model ``max_i (p * t[i-1] + c * t[i]) + b * sum(t)`` bytes over the tensors ``t`` in
    the order the optimizer updates them, for ``factory`` with these flags: ``c`` temporaries of the tensor
    being updated, ``p`` of the one before still held (Adam's loop keeps the last ``denom`` until the next
    is made), ``b`` of every tensor at once (``foreach``). Fitted once per process, factory and flags."""
    key = (_describe(factory), fused, foreach)
    if key not in _FITTED:
        one, two, three = (_probe_peak(factory, sizes, fused, foreach) / (4 * _N) for sizes in _PROBES)
        b = max(three - two, 0.0)
        c = max(one - b, 0.0)
        _FITTED[key] = (max(two - c - 2 * b, 0.0), c, b)
    return _FITTED[key]


def _probe_peak(factory: Callable[..., Any], sizes: tuple[int, ...], fused: bool, foreach: bool) -> int:
    """Peak bytes made during the second step (the first makes the state) on fp32 scratch parameters."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    try:
        opt = factory(params, fused=True) if fused else factory(params, foreach=foreach)
    except (TypeError, RuntimeError, ValueError):  # an optimizer without these options: as it comes
        opt = factory(params)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 0:
            opt.step()
            continue
        with Allocations() as seen:
            opt.step()
        return seen.peak
    return 0


def _describe(factory: Any) -> str:
    """``factory`` as text (a class, or a partial of one with its arguments): what the fit is kept by."""
    if isinstance(factory, functools.partial):
        return f"{factory.func!r}{factory.args!r}{sorted(factory.keywords.items())!r}"
    return repr(factory)


def step_transient(optimizer: Any, tensor_bytes: list[int], device_type: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> int:
    """Predicted bytes an optimizer step holds while it updates tensors of ``tensor_bytes`` (a rank's
    parameters, pieces and ZeRO shards, in any order: the two largest count as if updated one after the
    other, an upper bound): ``optimizer`` is the built optimizer, its class or a partial. 0 without an
    optimizer or tensors, or for an optimizer that cannot step on scratch tensors."""
    if optimizer is None or not tensor_bytes:
        return 0
    if isinstance(optimizer, torch.optim.Optimizer):
        flags, factory = flags_of(optimizer), _factory_of(optimizer)
    else:
        flags, factory = implementation(optimizer, device_type, dtype), optimizer
    try:
        p, c, b = _coefficients(factory, flags["fused"], flags["foreach"])
    except Exception:  # noqa: BLE001 - e.g. an optimizer that needs a closure
        return 0
    top = sorted(tensor_bytes, reverse=True)[:2] + [0]
    return int(max(p, c) * top[0] + min(p, c) * top[1] + b * sum(tensor_bytes))


def _factory_of(opt: torch.optim.Optimizer) -> Callable[..., Any]:
    """A factory building ``opt``'s class with its first group's hyperparameters (those its constructor
    takes; the implementation flags are passed by the probe)."""
    import inspect

    takes = inspect.signature(type(opt).__init__).parameters
    group = {k: v for k, v in opt.param_groups[0].items()
             if k in takes and k not in ("params", "fused", "foreach") and not isinstance(v, torch.Tensor)}
    return functools.partial(type(opt), **group)
