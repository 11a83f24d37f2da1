"""Which training state a model trains with: one ``TrainState`` per model instance.

Dynamo may hand two module instances of one class the same compiled code (it guards on types and
tensor properties, not on which module is called, and two equal ``options`` dicts make equal
backends), so a compiled step cannot assume the parameters it was captured with are the ones it is
called with. The runtime identifies a model by the exact parameter objects a call passes (see
``CompiledStep.bind``); the user-facing API identifies it by the module (``state_of_module``). Both
meet here: a state's parameter set is the set of parameter objects its calls pass, compared by
identity, never by ``id()`` alone (ids are reused once an object dies) and never by "any parameter
in common" (two models sharing a trunk are two models).
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn

from piper_compile.errors import PiperError, some
from piper_compile.runtime.state import TrainState

class ModelLink:
    """The explicit link from a compiled step to its module, made by ``piper.compile`` (or ``piper.plan``):
    Dynamo hands a backend a graph, never the module it traced, nor the forward's own arguments. The link
    holds the module (weakly), the ``options`` dict given to ``torch.compile`` (the backend receives that
    very dict, which is how it finds the link) and the arguments of the first call until the step has
    been captured (mixed precision re-traces the module with them, ``capture/retrace.py``)."""

    def __init__(self, module: nn.Module, options: dict[str, Any]) -> None:
        self._module = weakref.ref(module)
        self.options = options
        self.call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.handle: Any = None  # the forward pre-hook recording the first call
        self.deferred: Any = None  # a model built on the meta device: its init (init/deferred.Deferred)

    def module(self) -> nn.Module | None:
        return self._module()

    def __reduce__(self) -> tuple[Any, ...]:
        """Not saved with the model (``torch.save(model)``, ``copy.deepcopy(model)``: the attribute
        ``_piper_link`` sits on the module): a copy is not compiled, and the link holds only a weak
        reference to its module."""
        return (_no_link, ())

    def record(self, _mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook on the compiled module (outside Dynamo's trace): keep the first call's arguments;
        a model built on the meta device gets storage-less stand-ins on the batch's device first."""
        if self.call is None:
            self.call = (args, kwargs)
            module = self.module()
            if module is not None and self.deferred is None:
                from piper_compile.init.deferred import defer

                self.deferred = defer(module, _device_of(args, kwargs), self.options)

    def captured(self) -> None:
        """The step is captured: drop the first batch and the hook."""
        self.call = None
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _no_link() -> None:
    return None


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device of the call's first tensor argument (CPU without one)."""
    return next((a.device for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), torch.device("cpu"))


_LINKS: "weakref.WeakValueDictionary[int, ModelLink]" = weakref.WeakValueDictionary()


def link(module: nn.Module, options: dict[str, Any]) -> ModelLink:
    """Link ``module`` to the ``options`` dict it is compiled with (the caller keeps the link alive)."""
    made = ModelLink(module, options)
    _LINKS[id(options)] = made
    return made


def link_for(options: Any) -> ModelLink | None:
    """The link made for this very ``options`` dict, if any."""
    found = _LINKS.get(id(options)) if options is not None else None
    return found if found is not None and found.options is options else None


_LIVE: "weakref.WeakSet[TrainState]" = weakref.WeakSet()
_BY_MODULE: "weakref.WeakKeyDictionary[nn.Module, TrainState]" = weakref.WeakKeyDictionary()
_COUNTER = itertools.count()


def _same_set(a: Iterable[Any], b: Iterable[Any]) -> bool:
    ia = {id(x): x for x in a}
    ib = {id(x): x for x in b}
    return ia.keys() == ib.keys() and all(ia[k] is ib[k] for k in ia)


def _outside(named: dict[str, nn.Parameter], params: Iterable[Any]) -> list[str]:
    """The names in ``named`` whose parameters are not among ``params`` (by identity), sorted."""
    held = {id(p): p for p in params}
    return sorted(f for f, p in named.items() if held.get(id(p)) is not p)


def _covers(big: Iterable[Any], small: Iterable[Any]) -> bool:
    ib = {id(x): x for x in big}
    return all(ib.get(id(x)) is x for x in small)


def live_states() -> list[TrainState]:
    """Every training state alive in this process, in creation order."""
    return sorted(_LIVE, key=lambda s: s.index)


def state_for(named: dict[str, nn.Parameter], factory: Callable[..., torch.optim.Optimizer] | None,
              module: nn.Module | None = None, options: Any = None) -> TrainState:
    """The state of the model whose calls pass exactly the parameters ``named``: an existing one (the grad
    and no-grad programs of one model share it; a state made by the API for the module before its first
    call, holding all of the module's parameters, is adopted), or a new one. Versions of one model whose
    forward reads different parameters (a branch on a Python flag: an auxiliary loss on some steps) share
    one state: a module linked by ``piper.compile`` trains one holding all of its parameters; under
    ``torch.compile`` (``options``: the dict it was given) a version reading a subset of an earlier
    version's parameters takes that version's state, and one reading more is refused. Refused too where
    ``module`` had parameters replaced since it trained, or where the state's parameters changed dtype or
    device."""
    check_not_replaced(module, named)
    params = list(named.values())
    states = live_states()
    st = _linked_state(module, params, factory) if module is not None else None
    st = st or next((s for s in states if _same_set(s.params, params)), None) or _earlier_version(states, named, options)
    if st is None:
        pre = [s for s in states if s.from_module and not s.steps and _covers(s.params, params)]
        st = pre[0] if len(pre) == 1 else None
    if st is None:
        st = TrainState(list(params), factory)
        st.index = next(_COUNTER)
        _LIVE.add(st)
    elif st.factory is None:
        st.factory = factory
    check_unchanged_kinds(st, named)
    return st


def _linked_state(module: nn.Module, params: list[nn.Parameter], factory: Any) -> TrainState | None:
    """The state of a ``piper.compile``d module, holding all of its parameters (made at its first call):
    each version of its step trains the parameters its forward reads, with one optimizer, as eager does."""
    if not _covers(list(module.parameters()), params):
        return None  # another model's parameters (two models of one class sharing the compiled code)
    st = state_of_module(module, factory, create=True)
    return st if st is not None and _covers(st.params, params) else None


def _earlier_version(states: list[TrainState], named: dict[str, nn.Parameter], options: Any) -> TrainState | None:
    """Under ``torch.compile``: the state of an earlier version compiled from the same ``options`` dict whose
    parameters cover ``named`` (this version's forward reads fewer); one that reads more is refused, since
    that state's optimizer was built without them."""
    if options is None:
        return None
    params = list(named.values())
    for st in states:
        if not any(getattr(step, "raw_options", None) is options for step in st.steps):
            continue
        if _covers(st.params, params):
            return st
        if _covers(params, st.params):
            more = _outside(named, st.params)
            raise PiperError(
                f"piper: Dynamo compiled the step again, and this version's forward uses {len(more)} parameter(s) "
                f"its first version did not ({some(more)}: a branch on "
                "a Python attribute, e.g. an auxiliary loss turned on later), but the model's optimizer was built "
                "without them. Compile it with piper.compile(model, ...), whose optimizer holds every parameter "
                "of the model, or have the first compiled step use them")
    return None


def state_of_module(module: nn.Module, factory: Callable[..., torch.optim.Optimizer] | None = None,
                    create: bool = False) -> TrainState | None:
    """The state ``module`` trains with (the link is remembered per module instance). Before its first
    call a state holding all of the module's parameters is made when ``create`` (so that e.g.
    ``piper.optimizer(step)`` works before training starts)."""
    st = _BY_MODULE.get(module)
    if st is not None:
        return st
    mine = list(module.parameters())
    found = [s for s in live_states() if s.params and _covers(mine, s.params)]
    if len(found) > 1:  # e.g. a model and a sub-model both compiled: the one with every parameter
        exact = [s for s in found if _same_set(s.params, mine)]
        widest = max(found, key=lambda s: len(s.params))
        found = exact or [widest]
    if found:
        _BY_MODULE[module] = found[0]
        return found[0]
    if not create:
        return None
    st = TrainState(mine, factory)
    st.index = next(_COUNTER)
    st.from_module = True
    _LIVE.add(st)
    _BY_MODULE[module] = st
    return st


def plain_tensors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a public entry point that reads parameters: checkpoints, reports, planning) run with every
    released tensor's plain class back, marked again afterwards (``runtime/released.py``)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = [st for st in live_states() if st.unmark_released()]
        try:
            return fn(*args, **kwargs)
        finally:
            for st in was:
                st.mark_released()

    return run


def check_shared_parameters(st: TrainState) -> None:
    """Parameters shared by two compiled models train exactly only while both update them in place as
    eager would (no ZeRO flattening, no expert / tensor-parallel pieces, no released stages); otherwise
    one model would write into storage the other re-laid out. Raised at the first call that would mix."""
    mine = {id(p): p for p in st.params}
    for other in live_states():
        if other is st or not other.steps:
            continue
        shared = [f for f, p in other.named.items() if mine.get(id(p)) is p]
        if shared and not (st.is_plain and other.is_plain):
            raise PiperError(
                f"piper: this model shares {len(shared)} parameter(s) ({some(sorted(shared))}) with another model compiled with piper, and one of them "
                "shards or releases parameters (ZeRO, expert/tensor parallel or pipeline stages), so their "
                "updates would land on storage the other re-laid out. Fix: compile one module that contains "
                "both (e.g. a wrapper whose forward returns the sum of both losses), or give each model its own "
                "copy of the shared weights, or train them with plain data parallelism (zero=0)")


def check_unchanged_kinds(st: TrainState, named: dict[str, nn.Parameter]) -> None:
    """A model trained by piper whose parameters then changed dtype or device (``model.to(torch.bfloat16)``,
    ``model.cuda()`` between steps) cannot keep its optimizer state, shards and gradient buffers: refused
    with what to do instead, rather than failing deep in a kernel or training on stale state."""
    if not st.kinds:
        return
    moved = [(f, st.kinds[id(p)], (p.dtype, p.device.type)) for f, p in named.items()
             if id(p) in st.kinds and st.kinds[id(p)] != (p.dtype, p.device.type)]
    if moved:
        what = ", ".join(f"{f}: {a[0]} on {a[1]} -> {b[0]} on {b[1]}" for f, a, b in moved[:3])
        raise PiperError(
            f"piper: {len(moved)} parameter(s) of this model changed dtype or device after piper started training "
            f"it ({what}{', ...' if len(moved) > 3 else ''}); its optimizer state, gradient buffers and shards "
            "were made for the old ones. Convert the model before its first compiled step, or, to compute in "
            "bf16/fp16 while keeping fp32 weights, keep the model in fp32 and pass "
            "mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16) (options['mixed_precision']).")


def _trained_by(module: nn.Module) -> TrainState | None:
    """The state a step linked to ``module`` has trained (``piper.compile``), if any."""
    for st in live_states():
        links = (getattr(step, "link", None) for step in st.steps)
        if st.first_call_done and any(link is not None and link.module() is module for link in links):
            return st
    return None


def check_not_replaced(module: nn.Module | None, named: dict[str, nn.Parameter]) -> None:
    """``module`` (the one ``piper.compile`` linked) now passes ``named``, not the parameters its trained
    state holds: some attribute was given a new ``nn.Parameter`` between steps. Its optimizer state would
    silently restart (data parallel) or be refused as another model's (ZeRO, pipeline stages): refused
    here, naming the parameters and the in-place way to change them."""
    trained = _trained_by(module) if module is not None else None
    if trained is None or not _covers(list(module.parameters()), list(named.values())):
        return  # not trained yet, or another model's parameters (two models of one class sharing the code)
    new = _outside(named, trained.params)  # the forward may read a subset of the module's parameters
    if not new:
        return
    raise PiperError(
        f"piper: {len(new)} parameter(s) of this model were replaced by new tensors after piper started training "
        f"it ({some(new)}), so its training state (optimizer state, "
        "shards, gradient buffers) no longer matches the model. Change a weight's values in place instead "
        "(with torch.no_grad(): module.weight.copy_(new)) or with model.load_state_dict(...) / piper.load(...), "
        "or assign new parameters before the first compiled step.")
