"""The optimizer piper steps (``options["optimizer"]``): which implementation it builds, and a check
that the first update moved the parameters.

piper asks for the fused implementation (one kernel per step over each tensor instead of a dozen
passes; AdamW over a 3.5M-parameter GPT on one CPU thread: ~10 ms instead of ~22 ms for the default
per-tensor loop and ~40 ms for foreach) only where it is known to compute the same update as the
default one. A fused kernel is not always correct: in torch 2.13 fused SGD on CPU leaves bf16 and fp16
parameters exactly unchanged, so a model trained with it silently never learns. Known correct means
both: the (optimizer class, device type, dtype) is in :data:`FUSED_KNOWN_CORRECT`, and a probe (two
steps on a scratch tensor of that device and dtype, with the user's hyperparameters) gives the default
implementation's result. Anything else gets the default implementation.

:func:`step_checked` then guards what the probe cannot see: until an update with a nonzero gradient has
moved a parameter of a given device and dtype, each step checks that one did, and raises otherwise.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable

import torch
from torch import nn

from piper_compile.errors import PiperError
from piper_compile.knobs import knob

# (optimizer class name, device type, dtype) whose fused kernel matches the default implementation.
# Not listed, hence default: every 16-bit dtype (fused SGD on CPU does not update bf16/fp16 parameters in
# torch 2.13; fused Adam(W) in 16 bits on CUDA is believed correct but is not verified here).
FUSED_KNOWN_CORRECT: frozenset[tuple[str, str, torch.dtype]] = frozenset(
    (cls, device, dtype) for cls in ("Adam", "AdamW", "SGD") for device in ("cpu", "cuda")
    for dtype in (torch.float32, torch.float64))

PROBE_RTOL = 1e-2  # fused vs default update on the probe, relative to the largest update (fp32: ~1e-7)
_probed: dict[tuple[Any, ...], bool] = {}


def build_optimizer(factory: Callable[..., torch.optim.Optimizer], params: list[nn.Parameter]) -> Any:
    """``factory(params)``, with ``fused=True`` where that is known to be correct for every (device, dtype)
    of ``params`` (:data:`FUSED_KNOWN_CORRECT` and :func:`fused_matches_default`) and the factory does not
    choose an implementation itself (``functools.partial(AdamW, foreach=True)`` is built as given).
    ``PIPER_FUSED_OPTIMIZER=0`` always builds the default implementation."""
    chosen = isinstance(factory, functools.partial) and bool({"fused", "foreach"} & set(factory.keywords))
    opt = factory(params)
    if chosen or not knob("PIPER_FUSED_OPTIMIZER") or not isinstance(opt, torch.optim.Optimizer):
        return opt
    devices = {(p.device, p.dtype) for g in opt.param_groups for p in g["params"]}
    if not devices or not all(fused_is_correct(factory, type(opt), d, dt) for d, dt in devices):
        return opt
    try:
        return factory(params, fused=True)
    except (TypeError, RuntimeError, ValueError):  # no fused kernel for this optimizer/device/dtype
        return opt


def fused_is_correct(factory: Callable[..., Any], cls: type, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``factory(..., fused=True)`` may be used for parameters of ``device`` and ``dtype``: listed in
    :data:`FUSED_KNOWN_CORRECT` and the probe agrees (once per class, device, dtype and hyperparameters)."""
    if (cls.__name__, device.type, dtype) not in FUSED_KNOWN_CORRECT:
        return False
    key = (cls, device, dtype, _hyperparameters(factory))
    if key not in _probed:
        _probed[key] = fused_matches_default(factory, device, dtype)
    return _probed[key]


def _hyperparameters(factory: Callable[..., Any]) -> Any:
    if isinstance(factory, functools.partial):
        return (factory.func, repr(factory.args), repr(sorted(factory.keywords.items())))
    return factory


def fused_matches_default(factory: Callable[..., Any], device: torch.device, dtype: torch.dtype) -> bool:
    """Two steps of ``factory`` on a scratch parameter, fused and default: do the updates agree (within
    :data:`PROBE_RTOL` of the largest)? The parameter starts at zero so every update is representable
    whatever the learning rate; the gradients are random."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, generator=gen).to(device, dtype) for _ in range(2)]
    results = []
    for fused in (True, False):
        p = nn.Parameter(torch.zeros(64, device=device, dtype=dtype))
        try:
            opt = factory([p], fused=True) if fused else factory([p])
            for g in grads:
                p.grad = g.clone()
                opt.step()
        except Exception:  # noqa: BLE001 - any failure: not usable
            return False
        results.append(p.detach().float().cpu())
    got, want = results
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return bool(torch.equal(got, want))
    scale = want.abs().max().item()
    return (got - want).abs().max().item() <= PROBE_RTOL * scale if scale > 0 else bool((got == 0).all())


SAMPLE_BYTES = 16 << 20  # the first check of a (device, dtype) copies at most this much (its smallest parameters)


def _sample(watched: list[torch.Tensor], budget: dict[Any, int]) -> tuple[list[torch.Tensor], set[Any]]:
    """Per (device, dtype), its smallest watched parameters up to its byte budget (at least one), and the
    kinds whose sample is all of their watched parameters."""
    by_kind: dict[Any, list[torch.Tensor]] = {}
    for p in watched:
        by_kind.setdefault((p.device, p.dtype), []).append(p)
    sample: list[torch.Tensor] = []
    whole: set[Any] = set()
    for kind, ps in by_kind.items():
        ps.sort(key=lambda p: p.numel())
        room, taken = budget.setdefault(kind, SAMPLE_BYTES), 0
        while taken < len(ps) and (taken == 0 or room >= ps[taken].numel() * ps[taken].element_size()):
            room -= ps[taken].numel() * ps[taken].element_size()
            taken += 1
        sample += ps[:taken]
        if taken == len(ps):
            whole.add(kind)
    return sample, whole


def step_checked(opt: torch.optim.Optimizer, params: Iterable[torch.Tensor], measure: Any = None) -> None:
    """``opt.step()`` for ``params`` (whose ``.grad`` is set). Until a step with a nonzero gradient has
    moved a parameter of a (device, dtype), check that this one did: raise if no parameter of a (device,
    dtype) with a nonzero gradient and a positive learning rate moved. The check copies the smallest such
    parameters up to ``SAMPLE_BYTES`` (not every parameter: the first step would hold a second copy of
    them all); where none of a partial sample moved, the next step checks again with twice the budget.
    ``measure`` (``optimizer_memory.Allocations``): active during the step itself, for its temporaries."""
    seen: set[tuple[torch.device, torch.dtype]] = opt.__dict__.setdefault("_piper_moved", set())
    budget: dict[Any, int] = opt.__dict__.setdefault("_piper_check_bytes", {})
    lr = {id(p): g.get("lr", 1.0) for g in opt.param_groups for p in g["params"]}
    watched = [p for p in params if (p.device, p.dtype) not in seen and id(p) in lr and p.grad is not None
               and float(lr[id(p)]) > 0 and bool(p.grad.any())]
    watched, whole = _sample(watched, budget)
    before = [p.detach().clone() for p in watched]
    with measure if measure is not None else contextlib.nullcontext():
        opt.step()
    if not watched:
        return
    kinds = {(p.device, p.dtype) for p in watched}
    moved = {(p.device, p.dtype) for p, b in zip(watched, before) if not torch.equal(p.detach(), b)}
    seen.update(moved)
    for kind in kinds - moved - whole:  # inconclusive: an unsampled parameter may have moved
        budget[kind] *= 2
    for device, dtype in sorted((kinds & whole) - moved, key=str):
        impl = "fused" if opt.defaults.get("fused") else "foreach" if opt.defaults.get("foreach") else "default"
        rates = sorted({float(lr[id(p)]) for p in watched if (p.device, p.dtype) == (device, dtype)})
        raise PiperError(
            f"piper: the optimizer step left every {dtype} parameter on {device} unchanged although their "
            f"gradients are nonzero: {type(opt).__name__} ({impl} implementation, lr={rates}). Training would "
            "silently not learn. Either the implementation does not update this dtype (e.g. fused SGD on CPU "
            "bf16/fp16 in torch 2.13) or the update is below the dtype's resolution. Fix: choose the "
            f"implementation (functools.partial(torch.optim.{type(opt).__name__}, foreach=False, ...)) or set "
            "PIPER_FUSED_OPTIMIZER=0; keep fp32 master weights (options['mixed_precision']); or raise the "
            "learning rate")
