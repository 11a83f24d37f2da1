"""``piper.compile``'s forward traced by piper itself with Dynamo's whole-graph capture, so the trace can be
kept on disk and a warm run can skip it (``capture/forward_cache.py``).

``torch.compile`` traces a frame when its hook sees it and keeps the result on the code object, where
nothing can be saved. Here piper calls Dynamo's ``fullgraph_capture`` on the model's forward (the same
``compile_frame`` the hook runs, so the same graph and guards), hands the graph to ``piper_backend``, and
builds two guard sets from the one trace: every guard, for this process (exactly what Dynamo's hook would
check on each call), and the guards Dynamo can write to disk, with the others (object identities: modules,
functions, classes, closures) listed by source so that a warm load can check them its own way. The
forward is Dynamo's transformed bytecode run with the module's live globals, the compiled step installed
there under a name of its own (as Dynamo installs ``__compiled_fn_*``), so globals the forward reads are
read at each call, never copied.

A call whose guards fail does not run this forward: ``piper.compile`` hands it to Dynamo's own path (a
recompile, reported by ``piper_backend`` with the failed guard, as any recompile).
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import types
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from torch import fx, nn

# Guard kinds Dynamo cannot serialize: identities of objects in this process.
UNSAVED_KINDS = frozenset({"DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH",
                           "MODULE_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE"})
# Those of them (and of the kinds that derive from them) whose check is "the very object": piper checks
# them itself (``CLOSURE_MATCH``: a function of the very code; ``DICT_KEYS_MATCH``: a dict with the very
# keys, as pytree's node registry; ``CONSTANT_MATCH`` is dropped only where it compares by ``id``, as for a
# method's code object). Others (a dict's version, a live weakref) leave the trace to Dynamo's
# own full guard set, unsaved.
IDENTITY_KINDS = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH",
                            "NN_MODULE", "BUILTIN_MATCH", "DICT_KEYS_MATCH", "CONSTANT_MATCH"})
_NAMES = itertools.count()


@dataclass(frozen=True, slots=True)
class Dropped:
    """A guard left out of the saved set: its kind, its source expression and the object it held."""

    kind: str
    name: str
    value: Any


@dataclass
class Trace:
    """What one whole-graph trace gives: the backend's step, the pieces a forward is built from, and what
    can be written to disk (``saved_guards`` None: some guard could not be serialized)."""

    step: Any
    gm: fx.GraphModule
    example_inputs: list[Any]
    bytecode: types.CodeType
    backend_name: str
    import_sources: dict[str, str]
    manager: Any  # the guards this process checks: Dynamo's serializable set, or all of them
    identities: list[tuple[types.CodeType, str, Any]]  # the rest, where the manager is the serializable set
    saved_guards: bytes | None
    dropped: list[Dropped]
    traced_code: list[types.CodeType]


def _unsaved(entry: Any) -> bool:
    return entry.guard_type in UNSAVED_KINDS or any(t in UNSAVED_KINDS for t in (entry.derived_guard_types or ()))


@contextlib.contextmanager
def dynamo_metrics() -> Iterator[None]:
    """A fresh Dynamo metrics context (building guards records its time there; ``piper_backend`` reads
    a recompile's reason from it)."""
    from torch._dynamo.utils import dynamo_timed, get_metrics_context

    with get_metrics_context(), dynamo_timed("piper_whole_trace"):
        yield


@contextlib.contextmanager
def _dynamo_context() -> Iterator[None]:
    """The contexts Dynamo's own whole-graph compile (``aot_compile_fullgraph``) runs its capture in."""
    from torch._dynamo.eval_frame import set_enable_dynamic
    from torch._dynamo.variables.torch_function import torch_function_mode_stack_state_mgr

    with dynamo_metrics(), set_enable_dynamic(True), torch_function_mode_stack_state_mgr:
        yield


def supported() -> bool:
    """Whether this torch has the whole-graph capture this module is written against."""
    try:
        from torch._dynamo import convert_frame
    except ImportError:
        return False
    return all(hasattr(convert_frame, n) for n in ("fullgraph_capture", "get_traced_fn", "GraphCaptureOutput"))


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
          backend: Callable[[fx.GraphModule, list[Any]], Any]) -> Trace:
    """Trace ``model(*args, **kwargs)``'s forward as one graph (symbolic batch) and give it to ``backend``."""
    from torch._dynamo import convert_frame
    from torch._dynamo.hooks import Hooks
    from torch._dynamo.variables.torch_function import torch_function_mode_stack_state_mgr
    from torch._guards import TracingContext, tracing

    dropped: list[Dropped] = []
    with _dynamo_context():
        captured = _capture(model, args, kwargs)
        out, given = captured.graph_capture_output, captured.backend_input
        fn, _ = convert_frame.get_traced_fn(model)
        context = TracingContext(given.fake_mode)
        context.tensor_to_context = given.tensor_to_context
        with tracing(context):
            step = backend(given.graph_module, given.example_inputs)
        restore = contextlib.ExitStack()
        if torch_function_mode_stack_state_mgr.stack:
            restore.enter_context(torch_function_mode_stack_state_mgr.temp_restore_stack())
        with restore:
            saved, manager = _saved_guards(out, fn.__code__, dropped)
            f_locals = _locals(fn, model, args, kwargs)
            identities = identity_checks(dropped, fn.__globals__, f_locals) if manager is not None else None
            if identities is None:  # guards piper cannot check itself: Dynamo's whole set, built again
                manager, identities = out.build_guards(fn.__code__, hooks=Hooks(), save=False).guard_manager, []
    return Trace(step, given.graph_module, list(given.example_inputs), out.bytecode, given.backend_id,
                 dict(out.import_sources), manager, identities, saved, dropped, list(out.traced_code))


def identity_checks(dropped: list[Dropped], f_globals: Mapping[str, Any],
                    f_locals: dict[str, Any]) -> list[tuple[types.CodeType, str, Any]] | None:
    """Each dropped guard as (its compiled source, its kind, the object it must be), where every one is an
    identity guard whose source reads its object back on this call; None otherwise."""
    out = []
    for d in dropped:
        code = compile(d.name, d.name, "eval")
        if d.kind not in IDENTITY_KINDS or not same_object(d.kind, evaluate(code, f_globals, f_locals), d.value):
            return None
        out.append((code, d.kind, d.value))
    return out


def _locals(fn: types.FunctionType, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The frame locals of ``fn(model, *args, **kwargs)`` (its closure's cells included), as guards read them."""
    from torch._dynamo import convert_frame

    bound = convert_frame._get_signature(fn).bind(model, *args, **kwargs)
    bound.apply_defaults()
    f_locals = dict(bound.arguments)
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        f_locals[name] = cell.cell_contents
    return f_locals


def _capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Dynamo's whole-graph capture; an internal error inside Dynamo raised as Dynamo's hook raises it (an
    ``InternalTorchDynamoError``, which ``capture/blocks.flat_on_failure`` answers by tracing flat)."""
    from torch._dynamo import convert_frame
    from torch._dynamo.exc import InternalTorchDynamoError, TorchDynamoException

    try:
        return convert_frame.fullgraph_capture(model, args, kwargs)
    except TorchDynamoException:
        raise
    except Exception as e:
        raise InternalTorchDynamoError(f"{type(e).__qualname__}: {e}").with_traceback(e.__traceback__) from None


def _saved_guards(out: Any, code: types.CodeType, dropped: list[Dropped]) -> tuple[bytes | None, Any]:
    """The serializable guards, written and as a guard manager (the others go to ``dropped``); (None, None)
    where Dynamo cannot write them."""
    from torch._dynamo.hooks import Hooks

    def keep(entries: Any) -> list[bool]:
        dropped[:] = [Dropped(e.guard_type, e.name, snapshot(e.guard_type, e.value)) for e in entries if _unsaved(e)]
        return [not _unsaved(e) for e in entries]

    try:
        check = out.build_guards(code, hooks=Hooks(guard_filter_fn=keep), save=True, strict_error=True)
    except Exception:  # noqa: BLE001 - a guard Dynamo cannot write: the trace is kept in this process only
        return None, None
    return check.guards_state, check.guard_manager


def _renamed(code: types.CodeType, old: str, new: str) -> types.CodeType:
    """``code`` with global name ``old`` read as ``new`` (the compiled step's name in the module)."""
    if old not in code.co_names:
        raise RuntimeError(f"piper: internal: Dynamo's bytecode does not name its compiled graph {old}")
    return code.replace(co_names=tuple(new if n == old else n for n in code.co_names))


@dataclass
class Forward:
    """A traced forward of ``piper.compile``: call it where its guards hold on the call's arguments.

    ``manager`` is Dynamo's guard manager; ``identities`` the guards it lacks (a warm load's dropped ones),
    each a compiled source expression, its kind and the object it must be."""

    fn: types.FunctionType
    signature: inspect.Signature
    manager: Any
    step: Any
    identities: list[tuple[types.CodeType, str, Any]] = field(default_factory=list)
    guard_globals: Mapping[str, Any] = field(default_factory=dict)  # ``G`` of the identity guards

    def locals_of(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        return _locals(self.fn, model, args, kwargs)

    def holds(self, f_locals: dict[str, Any]) -> bool:
        """Whether every guard holds on a call's locals (then the call runs this forward)."""
        if not self.manager.check(f_locals):
            return False
        return all(same_object(kind, evaluate(code, self.guard_globals, f_locals), obj)
                   for code, kind, obj in self.identities)

    def failed_guard(self, f_locals: dict[str, Any]) -> str:
        """The first guard that fails on ``f_locals``, as Dynamo writes it."""
        if not self.manager.check(f_locals):
            parts = self.manager.check_verbose(f_locals).verbose_code_parts
            return parts[0] if parts else "a guard of the traced forward"
        for code, kind, obj in self.identities:
            if not same_object(kind, evaluate(code, self.guard_globals, f_locals), obj):
                return f"{code.co_filename} is not the object the forward was traced with ({kind})"
        return "none"

    def __call__(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.fn(model, *args, **kwargs)


def evaluate(code: types.CodeType, f_globals: Mapping[str, Any], f_locals: dict[str, Any]) -> Any:
    """A guard's source expression on a call (``G`` the module's globals, ``L`` its locals); a sentinel
    where it cannot be read (an attribute gone)."""
    try:
        return eval(code, {"G": f_globals, "L": f_locals, "__builtins__": __builtins__}, f_locals)  # noqa: S307
    except Exception:  # noqa: BLE001 - the source no longer resolves: the guard fails
        return _GONE


_GONE = object()


def snapshot(kind: str, value: Any) -> Any:
    """What an identity guard holds of its object: the object, or for ``DICT_KEYS_MATCH`` its keys now."""
    return tuple(value) if kind == "DICT_KEYS_MATCH" and isinstance(value, dict) else value


def same_object(kind: str, now: Any, then: Any) -> bool:
    """Dynamo's identity guards: the object itself, for ``CLOSURE_MATCH`` a function of the same code, for
    ``DICT_KEYS_MATCH`` a dict of the very keys (``then``: their ``snapshot``), in order."""
    if kind == "CLOSURE_MATCH":
        return getattr(now, "__code__", _GONE) is getattr(then, "__code__", None)
    if kind == "DICT_KEYS_MATCH":
        return isinstance(now, dict) and isinstance(then, tuple) and len(now) == len(then) and \
            all(a is b for a, b in zip(now, then))
    return now is then


def forward_of(model: nn.Module, bytecode: types.CodeType, backend_name: str, step: Any,
               import_sources: dict[str, str], manager: Any,
               identities: list[tuple[types.CodeType, str, Any]] | None = None,
               guard_globals: Mapping[str, Any] | None = None) -> Forward:
    """The callable forward: ``bytecode`` with the module's live globals, ``step`` installed there under a
    name of this process's own (a loaded trace's name could be another model's in this process)."""
    import importlib

    from torch._dynamo import convert_frame

    fn, _ = convert_frame.get_traced_fn(model)
    scope = fn.__globals__
    for alias, module_name in import_sources.items():  # what Dynamo installs while it traces
        scope.setdefault(alias, importlib.import_module(module_name))
    name = f"__piper_forward_{next(_NAMES)}_{uuid.uuid4().hex}"
    scope[name] = step
    code = _renamed(bytecode, backend_name, name)
    made = types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    made.__kwdefaults__ = fn.__kwdefaults__
    weakref.finalize(made, scope.pop, name, None)  # the step goes with its forward (as Dynamo's entries do)
    return Forward(made, convert_frame._get_signature(fn), manager, step, identities or [], guard_globals or scope)
