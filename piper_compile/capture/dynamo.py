"""Tracing a module with Dynamo outside the user's own ``torch.compile``: for planning without a launch
(``piper.plan``) and for re-capturing a step in its mixed-precision compute dtype (``capture/retrace.py``)."""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import fx, nn

from piper_compile.capture.joint import source_names


@dataclass
class Traced:
    """Dynamo's graph of one call, with its example inputs and each placeholder's source."""

    gm: fx.GraphModule
    inputs: list[Any]
    sources: list[str]


@contextlib.contextmanager
def forward_of_its_own(model: nn.Module) -> Iterator[None]:
    """Run ``model.forward`` through a copy of its function with a code object of its own while tracing.

    Dynamo keeps its compiled entries on the code object of the frame it compiles (``forward``), at most
    ``recompile_limit`` (8) of them per code object. Each trace compiles with a new capture backend, so
    tracing the model's own ``forward`` code added an entry per call: the 9th call raised
    ``FailOnRecompileLimitHit`` and the user's own ``torch.compile(model)`` found the budget spent. The copy
    (same globals, closure, defaults and source lines, so the same graph and source names) takes the entry
    and is dropped afterwards with it."""
    bound = model.forward
    func = getattr(bound, "__func__", None)
    if not isinstance(bound, types.MethodType) or not isinstance(func, types.FunctionType):
        yield  # not a plain method (a callable object, a builtin): compile it as it is
        return
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__ = func.__kwdefaults__
    own.__dict__.update(func.__dict__)
    had = "forward" in model.__dict__
    before = model.__dict__.get("forward")
    model.__dict__["forward"] = types.MethodType(own, model)  # found before the class's forward
    try:
        yield
    finally:
        if had:
            model.__dict__["forward"] = before
        else:
            del model.__dict__["forward"]


def takes_floats(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a Python float is among a call's arguments (at any depth of its lists, tuples and dicts)."""
    from torch.utils._pytree import tree_leaves

    return any(type(x) is float for x in tree_leaves((args, kwargs)))


@contextlib.contextmanager
def capture_settings(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """The Dynamo settings piper traces a call with (``piper.compile``'s forward, ``trace``).

    Floats become constants (``torch._dynamo.config.specialize_float``): under ``dynamic=True`` Dynamo
    otherwise passes every float attribute of the model (RMSNorm ``eps``, attention ``scaling``) as a
    0-dim input read with ``.item()``, which costs the trace ~4 ms each (a third of a second for a
    32-layer model) and which Inductor cannot compile (``passes/graph.py``'s ``specialize_floats`` makes
    them constants after the trace instead, for ``torch.compile(model, backend="piper")``). Dynamo guards
    each constant, so a changed attribute compiles the step again (with piper's one-line recompile
    message), never a stale one. A call that passes floats itself keeps Dynamo's default: those stay
    inputs, a new value each step must not compile again, and the pass makes the attributes constants."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.specialize_float or takes_floats(args, kwargs):
        yield
        return
    dynamo_config.specialize_float = True  # set and put back (every step passes here: config.patch costs 18 us)
    try:
        yield
    finally:
        dynamo_config.specialize_float = False


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Traced:
    """Dynamo's graph of ``model(*args, **kwargs)`` (whole, symbolic batch); runs nothing and leaves no
    Dynamo cache entry on the model's code."""
    captured: dict[str, Any] = {}

    def stash(gm: Any, example_inputs: list[Any], **_: Any) -> Any:
        captured.update(gm=gm, inputs=list(example_inputs), sources=source_names(gm))
        return lambda *a: (torch.zeros(()),)  # only the graph is needed: run nothing

    with forward_of_its_own(model), capture_settings(args, kwargs or {}):
        torch.compile(model, backend=stash, fullgraph=True, dynamic=True)(*args, **(kwargs or {}))
    return Traced(captured["gm"], captured["inputs"], captured["sources"])
