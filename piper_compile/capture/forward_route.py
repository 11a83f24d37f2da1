"""Which forward a ``piper.compile`` call runs: piper's own traced one where its guards hold, else Dynamo's.

The first call loads the traced forward a previous run left on disk (``capture/forward_cache.py``) or,
lacking one, traces it (``capture/whole_trace.py``) and, once that call has captured its joint graph,
writes it down for the next run. Every call checks its guards: where one fails (an attribute changed), the
call goes to Dynamo's own path, which compiles it as a recompile (``piper_backend`` says which guard
failed, and reuses the step where the graph is the same). Calls that the traced forward would not see as
Dynamo's hook sees them -- a model with forward hooks or its own ``__call__`` (which run outside the frame
Dynamo traces), a torch without the whole-graph capture, ``PIPER_FORWARD_CACHE=off`` -- always take
Dynamo's path.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable, Iterator

from torch import nn

from piper_compile.capture import forward_cache, whole_trace
from piper_compile.capture.blocks import flat_on_failure
from piper_compile.recompiles import after_failed_guard

log = logging.getLogger(__name__)


def _plain_call(model: nn.Module) -> bool:
    """``model(...)`` is ``model.forward(...)``: no hooks, no ``__call__`` of its own (what Dynamo's hook
    would run outside the traced frame)."""
    from torch.nn.modules import module as m

    hooks = (model._forward_hooks, model._forward_pre_hooks, model._backward_hooks, model._backward_pre_hooks,
             m._global_forward_hooks, m._global_forward_pre_hooks, m._global_backward_hooks,
             m._global_backward_pre_hooks)
    return type(model).__call__ is nn.Module.__call__ and not any(hooks) and \
        isinstance(getattr(model.forward, "__func__", None), type(_plain_call))


@contextlib.contextmanager
def _one_version_taken() -> Iterator[None]:
    """Dynamo's ``recompile_limit`` counts the versions of the step: piper's own trace is one of them."""
    import torch._dynamo.config as dynamo_config

    limit = dynamo_config.recompile_limit
    dynamo_config.recompile_limit = max(limit - 1, 1)
    try:
        yield
    finally:
        dynamo_config.recompile_limit = limit


class ForwardRoute:
    """The forward of one ``piper.compile``d model (see the module's docstring). ``dynamo`` runs a call
    through ``torch.compile``'s hook; ``backend`` compiles a traced graph as Dynamo's path would (``piper_backend``
    with the options that path hands it: ``backend(gm, example_inputs)``); ``marked``:
    piper marked repeated blocks (a Dynamo failure on them traces block by block)."""

    def __init__(self, model: nn.Module, dynamo: Callable[..., Any], backend: Callable[[Any, list[Any]], Any],
                 marked: bool) -> None:
        self.model, self.dynamo, self.backend, self.marked = model, dynamo, backend, marked
        self.on = forward_cache.enabled() and whole_trace.supported()
        self.forward: whole_trace.Forward | None = None
        self._unsaved: tuple[whole_trace.Trace, bytes | None, str] | None = None  # written after its first call

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (self.on and _plain_call(self.model)):
            return self._through_dynamo(args, kwargs)
        if self.forward is None:  # the first call (or the first since a failed trace)
            t0 = time.perf_counter()
            loaded = self._loaded(args, kwargs)
            self.forward = loaded or self._traced(args, kwargs)
            self.forward.step.forward_how = "loaded" if loaded is not None else "traced"
            self.forward.step.forward_seconds = time.perf_counter() - t0
        f = self.forward
        f_locals = f.locals_of(self.model, args, kwargs)
        if not f.holds(f_locals):
            with after_failed_guard(f.failed_guard(f_locals)), _one_version_taken():
                return self._through_dynamo(args, kwargs)
        out = f(self.model, *args, **kwargs)
        if self._unsaved is not None:
            self._save(f, f_locals)
        return out

    def _through_dynamo(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.marked:
            return flat_on_failure(self.model, lambda: self.dynamo(*args, **kwargs))
        return self.dynamo(*args, **kwargs)

    def _loaded(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> whole_trace.Forward | None:
        name = forward_cache.entry_path(self.model, args, kwargs)
        with whole_trace.dynamo_metrics():
            return forward_cache.load(name, self.model, args, kwargs, self.backend)

    def _traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> whole_trace.Forward:
        run = functools.partial(whole_trace.trace, self.model, args, kwargs, self.backend)
        traced = flat_on_failure(self.model, run) if self.marked else run()
        forward = whole_trace.forward_of(self.model, traced.bytecode, traced.backend_name, traced.step,
                                         traced.import_sources, traced.manager, traced.identities)
        if traced.saved_guards is not None:
            graph = forward_cache.graph_bytes(traced.gm, list(traced.step.sources))
            self._unsaved = (traced, graph, forward_cache.entry_path(self.model, args, kwargs))
        return forward

    def _save(self, forward: whole_trace.Forward, f_locals: dict[str, Any]) -> None:
        """After the first call through a fresh trace: write it down, once its joint graph is captured."""
        assert self._unsaved is not None
        traced, graph, name = self._unsaved
        joint = getattr(forward.step, "joint", None)
        if joint is None:
            return  # not captured yet (a call that failed before capture): try after the next one
        self._unsaved = None
        entry = forward_cache.entry_of(traced, forward, f_locals, graph, joint.key)
        if entry is not None:
            forward_cache.save(name, entry)
