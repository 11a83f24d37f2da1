"""Tracing a module with Dynamo outside the user's own ``torch.compile``: for planning without a launch
(``piper.plan``) and for re-capturing a step in its mixed-precision compute dtype (``capture/retrace.py``)."""
from __future__ import annotations

import contextlib
import re
import sys
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import fx, nn

from piper_compile.capture.joint import source_names
from piper_compile.errors import PiperCaptureError, PiperError


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
    had = "forward" in model.__dict__
    before = model.__dict__.get("forward")
    if not give_own_forward(model):
        yield  # not a plain method (a callable object, a builtin): compile it as it is
        return
    try:
        yield
    finally:
        if had:
            model.__dict__["forward"] = before
        else:
            del model.__dict__["forward"]


def give_own_forward(model: nn.Module) -> bool:
    """Make ``model.forward`` (an instance attribute, found before the class's) a copy of its function with a
    code object of its own (same globals, closure, defaults and source lines, so the same graph and source
    names), where it is a plain method: Dynamo's compiled entries for ``model`` go on that code object, not
    on the class's. Whether it did."""
    bound = model.forward
    func = getattr(bound, "__func__", None)
    if not isinstance(bound, types.MethodType) or not isinstance(func, types.FunctionType):
        return False
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__ = func.__kwdefaults__
    own.__dict__.update(func.__dict__)
    own.__qualname__ = func.__qualname__
    model.__dict__["forward"] = types.MethodType(own, model)
    return True


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


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s+(\S.*)')


@contextlib.contextmanager
def one_graph_errors(model: nn.Module) -> Iterator[None]:
    """Dynamo's failure to trace ``model``'s step as one graph (``fullgraph``: a branch on a tensor's value,
    a call it cannot trace) as a ``piper:`` error naming the user's line, the reason and the ways out
    (``adapt_moe`` where the line is in a transformers MoE block), with Dynamo's own message after it;
    piper's own errors and everything else pass as they are -- a piper error the backend raised too, which
    torch 2.11 hands on wrapped in ``BackendCompilerFailed``."""
    from torch._dynamo import exc

    limit_hit = getattr(exc, "FailOnRecompileLimitHit", ())  # named so since torch 2.6
    try:
        yield
    except (exc.Unsupported, exc.UserError) as e:
        raise PiperCaptureError(_one_graph_message(str(e), model)) from e
    except limit_hit as e:
        from piper_compile.recompiles import limit_message

        raise PiperCaptureError(limit_message()) from e
    except exc.BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, PiperError):
            raise inner from None
        raise


def _moe_hint(files: set[str], model: nn.Module) -> str:
    """Where Dynamo stopped inside a mixture-of-experts block ``adapt_moe`` can replace: say so."""
    from piper_compile.nn.hf import moe_blocks

    hit = [f"{name} ({type(m).__name__})" for name, m in moe_blocks(model)
           if getattr(sys.modules.get(type(m).__module__), "__file__", None) in files]
    return (f" The line is in the mixture-of-experts block {hit[0]}, whose Python loop over the experts "
            "hit cannot be one graph: call `piper_compile.nn.hf.adapt_moe(model)` before compiling, which "
            "computes the same experts in one op (and lets `shard({'EP': ...})` shard them).") if hit else ""


def _one_graph_message(text: str, model: nn.Module) -> str:
    frames = _USER_FRAME.findall(text.split("from user code:")[-1])
    where = f" at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}: `{frames[-1][3].strip()}`" if frames else ""
    reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
    reason = reason.replace("Consider annotating your code using torch._check*(). ", "")[:240]
    hint = _moe_hint({f[0] for f in frames}, model)
    return (f"piper: Dynamo cannot trace the training step as one graph{where} ({reason}).{hint} piper captures the "
            "whole step (forward and loss) as one graph, so the forward cannot branch on a tensor's value "
            "(`if x.sum() > 0:`, `if loss.item() > t:`, or a check such as `torch.any(var < 0)` inside a torch "
            "function like `F.gaussian_nll_loss`) nor call what Dynamo cannot trace (file I/O, `print` of a "
            "tensor). Write the branch with tensor ops (`torch.where`, `torch.clamp`), state what holds with "
            "`torch._check`, move the check out of the model's forward, or write the loss without that function. "
            f"Dynamo's message:\n{text}")


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Traced:
    """Dynamo's graph of ``model(*args, **kwargs)`` (whole, symbolic batch); runs nothing and leaves no
    Dynamo cache entry on the model's code."""
    captured: dict[str, Any] = {}

    def stash(gm: Any, example_inputs: list[Any], **_: Any) -> Any:
        captured.update(gm=gm, inputs=list(example_inputs), sources=source_names(gm))
        return lambda *a: (torch.zeros(()),)  # only the graph is needed: run nothing

    with forward_of_its_own(model), capture_settings(args, kwargs or {}), one_graph_errors(model):
        torch.compile(model, backend=stash, fullgraph=True, dynamic=True)(*args, **(kwargs or {}))
    return Traced(captured["gm"], captured["inputs"], captured["sources"])
