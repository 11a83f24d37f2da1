"""A warm run skips Dynamo's trace: ``piper.compile``'s traced forward kept on disk.

Dynamo's trace of the step's forward is most of what a warm first step costs once the joint graph and every
segment come from the caches (1.5-1.8 s of CPU per rank for a 32-layer GPT, against ~0.4 s to load
it). ``capture/whole_trace.py`` traces the forward so that it can be written down; this module writes it
after the first call and loads it at a later run's first call. An entry holds:

- Dynamo's serializable guards (tensor properties, attribute values, types, grad mode, ...), which a load
  rebuilds against the live objects and checks on every call, as Dynamo would;
- the guards Dynamo cannot serialize (identities of modules, functions, classes and closures), each with
  its source expression and an identity text (``capture/identity.py``) the live object must give at the
  load; afterwards they are checked by identity on each call. A guard on an object with no stable identity
  text (an arbitrary object's ``id``) makes the trace unsaved: the next run traces again. A global Dynamo
  named by an object's id is installed anew under another name of the same length;
- a checksum of the source lines of every function Dynamo inlined (the model's code, torch's modules):
  an edited line makes the entry stale;
- Dynamo's graph (``GraphPickler``, metadata capture reads), its placeholders' sources (the example inputs
  are read off the call) and the key of the joint graph the first call captured. The graph is written only
  when its round trip keeps the joint-graph key (``capture/cache.joint_key``: every node's op, arguments,
  tags, source line, module path and fake value), and loaded only while the joint-graph cache holds that
  key, so a warm step captures exactly what a traced one would.

The entry's name hashes what the trace does not guard (the torch, Python and piper versions and settings,
Dynamo's configuration, the rank and world size, which Dynamo reads as constants, the model's class and
forward, the arguments' kinds). Under that name up to ``SLOTS`` entries are kept, one per joint graph (two
configurations of one model, a sweep, a training and an evaluation script: each run loads its own), tried
most recently used first; a new trace evicts the least recently used. Anything that does not match, load
or check traces again, as a cold run does. ``PIPER_FORWARD_CACHE``
("auto": from torch 2.13, where the Dynamo internals used are tested; "off").
"""
from __future__ import annotations

import builtins
import collections
import contextlib
import glob
import hashlib
import inspect
import logging
import os
import pickle
import platform
import re
import types
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx, nn
from torch._C._functorch import get_unwrapped, is_batchedtensor

from piper_compile.capture import cache as joint_cache
from piper_compile.capture.identity import code_digest, identity, resolve, stable
from piper_compile.capture.whole_trace import (Dropped, Forward, Trace, evaluate, forward_of, identity_checks,
                                                snapshot)
from piper_compile.disk import TESTED_TORCH, cache_root, torch_version, trace_settings
from piper_compile.knobs import knob

log = logging.getLogger(__name__)
_VERSION = 1
SLOTS = 4  # traced forwards kept per entry name (each of another joint graph)
_GRAPH_META = ("example_value", "custom", "stack_trace", "nn_module_stack")


def enabled() -> bool:
    """``PIPER_FORWARD_CACHE``: 'auto' is on from ``TESTED_TORCH``."""
    mode = knob("PIPER_FORWARD_CACHE")
    return mode == "on" or (mode == "auto" and torch_version() >= TESTED_TORCH)


# -- the entry -------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    version: int
    guards: bytes
    dropped: list[tuple[str, str, str]]  # kind, source expression, identity
    bytecode: Any  # torch's SerializedCode
    backend_name: str
    import_sources: dict[str, str]
    sources: list[str]  # each placeholder's source: the call gives the example inputs
    kinds: list[str]  # "param", "tensor" or "int" per example input
    graph: bytes  # Dynamo's graph, GraphPickler
    code_sums: list[tuple[str, int, int, str]]  # module, first and last line, checksum of the lines
    joint_key: str
    by_id: dict[str, str]  # globals Dynamo named by an object's id (``_<id>_c0``) -> the object's identity


def entry_path(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The name of this model's traced forwards for calls like this one (see the module's docstring): its
    entries are files beside it (``_slots``)."""
    from piper_compile.runtime.groups import world_info

    import torch._dynamo.config as dynamo_config

    fn = type(model).forward
    h = hashlib.sha256(trace_settings().encode())
    h.update(repr((_VERSION, platform.python_version(), world_info(), type(model).__module__,
                   type(model).__qualname__, torch.is_grad_enabled(),
                   stable(dynamo_config.save_config_portable()))).encode())
    if isinstance(fn, types.FunctionType):
        code_digest(fn.__code__, h)
    h.update(repr([_arg_kind(a) for a in (*args, *sorted(kwargs.items()))]).encode())
    return os.path.join(cache_root(), "piper-forward", f"{h.hexdigest()[:32]}.pkl")


def _arg_kind(a: Any) -> Any:
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str):  # a keyword argument
        return (a[0], _arg_kind(a[1]))
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, a.dim(), a.device.type, a.requires_grad)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, [_arg_kind(x) for x in a])
    return (type(a).__name__, a if isinstance(a, (int, float, bool, str, type(None))) else None)


def _unview(v: Any) -> Any:
    """A fake value with a view's metadata but no base (a view's description holds what pickle cannot
    write; the key reads shapes, strides, dtype, device and requires_grad, which this keeps). A value inside
    ``torch.vmap`` (transformers' mask functions) is a functorch ``BatchedTensor`` over a fake one, which
    pickle cannot write either: it is kept as a plain fake tensor of its logical shape, as the key reads it
    (``capture/cache._value_text``)."""
    if isinstance(v, torch.Tensor) and (v._is_view() or is_batchedtensor(v)):
        with _fake_mode(v):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device,
                                       requires_grad=v.requires_grad)
    if isinstance(v, (list, tuple)):
        return type(v)(_unview(x) for x in v)
    return v


def _fake_mode(v: torch.Tensor) -> Any:
    """The fake mode of ``v``, below any vmap levels wrapped around it."""
    while is_batchedtensor(v):
        v = get_unwrapped(v)
    return v.fake_mode  # type: ignore[attr-defined]


def _graph_meta(meta: dict[str, Any]) -> dict[str, Any]:
    out = {k: meta[k] for k in _GRAPH_META if k in meta}
    if "example_value" in out:
        out["example_value"] = _unview(out["example_value"])
    if out.get("nn_module_stack"):  # classes by name, as the joint-graph cache keeps them
        out["nn_module_stack"] = {a: (p, getattr(c, "__qualname__", str(c)))
                                  for a, (p, c) in out["nn_module_stack"].items()}
    return out


def graph_bytes(gm: fx.GraphModule, sources: list[str]) -> bytes | None:
    """Dynamo's graph with the metadata capture reads (and each placeholder's ``sources`` entry, which Dynamo
    keeps only while it compiles), written with ``GraphPickler``; None where its round trip would not give
    the same joint-graph key (or it cannot be keyed or written)."""
    from torch.fx._graph_pickler import Options

    from piper_compile.fxgraph import graph_module

    key = joint_cache.joint_key(gm, _placeholder_values(gm))
    if key is None:
        return None
    saved = {n: n.meta for g in joint_cache._graphs(gm) for n in g.graph.nodes}
    try:
        for n in saved:
            n.meta = _graph_meta(n.meta)
        for n, source in zip(gm.graph.find_nodes(op="placeholder"), sources):
            n.meta["piper_source"] = source
        plain = graph_module(gm, gm.graph)  # without Dynamo's attributes on the module
        with joint_cache.pytree_registry_untouched():
            data = joint_cache._pickler().dumps(plain, Options(ops_filter=None, node_metadata_key_filter=None))
    except Exception as e:  # noqa: BLE001 - metadata the pickler cannot write: not saved
        log.info("piper: the traced forward is not saved (%s: %s)", type(e).__name__, e)
        return None
    finally:
        for n, meta in saved.items():
            n.meta = meta
    back = joint_cache._loads(data)
    return data if joint_cache.joint_key(back, _placeholder_values(back)) == key else None


def _placeholder_values(gm: fx.GraphModule) -> tuple[Any, ...]:
    return tuple(n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder"))


def _kind(x: Any) -> str | None:
    if isinstance(x, nn.Parameter):
        return "param"
    if isinstance(x, torch.Tensor):
        return "tensor"
    return "sym" if isinstance(x, torch.SymInt) else "int" if type(x) is int else None


def _reads_back(read: Any, given: Any) -> bool:
    """A placeholder's source, evaluated on the call, gives the example input Dynamo handed the backend."""
    if isinstance(given, torch.SymInt):
        return type(read) is int and read == given.node.hint
    return read is given or (type(given) is int and read == given)


def _as_traced(value: Any, fake: Any) -> bool:
    """A call's input has the sizes the saved graph was traced with (its symbols' hints)."""
    if isinstance(fake, torch.SymInt):
        return value == fake.node.hint
    if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor):
        return tuple(value.shape) == tuple(d.node.hint if isinstance(d, torch.SymInt) else d for d in fake.shape)
    return True


def _code_sums(codes: list[types.CodeType], classes: list[Any]) -> list[tuple[str, int, int, str]] | None:
    """(module, first line, last line, checksum) of the source of every function Dynamo inlined; a function
    without source lines (a dataclass's generated ``__init__``) must be one of ``classes``' (guarded by
    identity, which includes the code of their functions: :func:`_class_digest`)."""
    owned = {getattr(getattr(f, "__func__", f), "__code__", None) for c in classes if isinstance(c, type)
             for f in vars(c).values()}
    out = []
    for code in codes:
        module = inspect.getmodule(code)
        if module is None and code in owned:
            continue
        if module is None:
            return None
        try:
            lines, first = inspect.getsourcelines(code)
        except (OSError, TypeError):
            return None
        out.append((module.__name__, first, first + len(lines), _checksum(module, first, first + len(lines))))
    return sorted(set(out))


def _checksum(module: types.ModuleType, first: int, last: int) -> str:
    lines = inspect.getsourcelines(module)[0][first - 1:last - 1]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _compiled(source: str) -> types.CodeType:
    return compile(source, source, "eval")


def _dropped_identities(dropped: list[Dropped], f_globals: dict[str, Any],
                        f_locals: dict[str, Any]) -> list[tuple[str, str, str]] | None:
    """The dropped guards with their identity texts; None where one is not an identity guard piper can
    check (``whole_trace.identity_checks``) or its object has no identity text."""
    if identity_checks(dropped, f_globals, f_locals) is None:
        return None
    texts = [identity(d.value) for d in dropped]
    return None if None in texts else [(d.kind, d.name, t) for d, t in zip(dropped, texts)]  # type: ignore[misc]


def entry_of(traced: Trace, forward: Forward, f_locals: dict[str, Any], graph: bytes | None,
             joint_key: str | None) -> _Entry | None:
    """What to write for a trace after its first call captured ``joint_key``; None where a part cannot be
    written or read back exactly (then the next run traces again)."""
    from torch._dynamo.package import SerializedCode

    if traced.saved_guards is None or graph is None or joint_key is None:
        return None
    scope = forward.fn.__globals__
    dropped = _dropped_identities(traced.dropped, scope, f_locals)
    kinds = [_kind(x) for x in traced.example_inputs]
    sources = list(traced.step.sources)
    read = [evaluate(_compiled(s), scope, f_locals) for s in sources]
    if dropped is None or None in kinds or not all(map(_reads_back, read, traced.example_inputs)):
        return None
    sums = _code_sums(traced.traced_code, [d.value for d in traced.dropped])
    by_id = _named_by_id(traced, scope)
    if sums is None or by_id is None or not _plain_globals(traced):
        return None
    return _Entry(_VERSION, traced.saved_guards, dropped, SerializedCode.from_code_object(traced.bytecode),
                  traced.backend_name, traced.import_sources, sources, kinds, graph, sums,
                  joint_key, by_id)  # type: ignore[arg-type]


_BY_ID = re.compile(rb"_\d{6,}_c\d+")  # the name of a global Dynamo installed by an object's id


def _named_by_id(traced: Trace, scope: dict[str, Any]) -> dict[str, str] | None:
    """The globals named by an object's id that the guards read (``type(x)`` reads ``torch`` so), each with its
    object's identity; None where one has none. A load installs each object under a new name of the same
    length and renames it in the written guards (a per-process id means nothing in the next run)."""
    names = {m.decode() for m in _BY_ID.findall(traced.saved_guards or b"")}
    names |= {m.decode() for d in traced.dropped for m in _BY_ID.findall(d.name.encode())}
    texts = {n: identity(scope[n]) if n in scope else None for n in names}
    return None if None in texts.values() else texts  # type: ignore[return-value]


_MADE_UP = re.compile(r"^(__|_\d)")  # __builtins_dict___3, _140613083367520_c0: Dynamo's per-process names


def _plain_globals(traced: Trace) -> bool:
    """The bytecode reads no global Dynamo made up for this process (named by a counter or an object's id)
    besides the compiled step and the module aliases, which a load installs anew."""
    made = {traced.backend_name, *traced.import_sources}
    return not any(_MADE_UP.match(r) for r in _globals_read(traced.bytecode) - made)


def _globals_read(code: types.CodeType) -> set[str]:
    from torch._dynamo.convert_frame import GraphCaptureOutput

    return set(GraphCaptureOutput._get_external_refs(code))


def _slot(name: str, joint_key: str) -> str:
    """The file of the entry under ``name`` whose joint graph is ``joint_key``."""
    return f"{name.removesuffix('.pkl')}.{joint_key[:16]}.pkl"


def _slots(name: str) -> list[str]:
    """The entries kept under ``name``, the most recently used first."""
    def used(path: str) -> float:
        try:
            return os.path.getmtime(path)
        except OSError:
            return 0.0

    return sorted(glob.glob(f"{glob.escape(name.removesuffix('.pkl'))}.*.pkl"), key=used, reverse=True)


def save(name: str, entry: _Entry) -> None:
    """Write ``entry`` under ``name`` whole or not at all (ranks writing the same entry at once see one whole
    file: they trace the same joint graph), and drop the least recently used beyond ``SLOTS``."""
    path = _slot(name, entry.joint_key)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as fh:
            pickle.dump(entry, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        stale = _slots(name)[SLOTS:] + ([name] if os.path.exists(name) else [])  # and the one-entry layout's file
        for old in stale:
            os.remove(old)
    except OSError:
        pass


def _read(path: str) -> _Entry | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as fh:
            entry = pickle.load(fh)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: trace again and overwrite it
        log.warning("piper: the traced forward %s did not load (%s: %s); tracing again", path, type(e).__name__, e)
        return None
    return entry if isinstance(entry, _Entry) and entry.version == _VERSION else None


def _sources_unchanged(entry: _Entry) -> bool:
    import importlib

    try:
        return all(_checksum(importlib.import_module(m), a, b) == c for m, a, b, c in entry.code_sums)
    except Exception:  # noqa: BLE001 - a module gone or unreadable
        return False


def _install_by_id(entry: _Entry, scope: dict[str, Any]) -> list[str] | None:
    """Each global the trace named by an object's id, under a name of this process (as long: the name is
    replaced inside the written guards) holding the object its identity names; the names, or None where an
    object is not here."""
    objects = {old: resolve(text) for old, text in entry.by_id.items()}
    if any(obj is None for obj in objects.values()):
        return None
    names = []
    for old, obj in objects.items():
        new = ("_P" + uuid.uuid4().hex * 2)[:len(old)]  # Dynamo never makes a name of this form
        scope[new] = obj
        names.append(new)
        entry.guards = entry.guards.replace(old.encode(), new.encode())
        entry.dropped = [(k, n.replace(old, new), t) for k, n, t in entry.dropped]
    return names


def _guard_manager(entry: _Entry, code: types.CodeType, scope: dict[str, Any]) -> tuple[Any, Mapping[str, Any]]:
    """Dynamo's serializable guards rebuilt against this process's objects (as a precompiled load does), and
    the globals the dropped guards read: the module's, plus the builtins dict under the name the trace
    gave it. That name is not installed in the module: Dynamo numbers such names per process, and a later
    trace here would choose it again (the guards that read it are all identity guards, checked by piper)."""
    import importlib

    from torch._dynamo.output_graph import get_builtins_dict
    from torch._dynamo.package import load_guard_manager, load_guards_state

    from torch._guards import TracingContext, tracing

    for alias, module_name in entry.import_sources.items():
        scope.setdefault(alias, importlib.import_module(module_name))
    with tracing(TracingContext(None)):  # a source of an import installs a guard as it is made: into this one
        state = load_guards_state(entry.guards)
    _one_tensor_check_per_source(state.output_graph.guards)
    name = state.output_graph.name_of_builtins_dict_key_in_fglobals
    extra = {name: get_builtins_dict(scope)} if name and name not in scope else {}
    return load_guard_manager(state, code, scope), collections.ChainMap(extra, scope)


def _one_tensor_check_per_source(guards: Any) -> None:
    """Drop the second ``TENSOR_MATCH`` of a source from rebuilt guards. A block Dynamo stamps out of a
    nested compile region guards its tensors once per check of the region's reuse (a transformers decoder:
    each layer's weights twice), which the live guards tell apart by their guard function's identity. Read
    back, each carries the fake value it was made with instead of the parameter, so Dynamo's rule that
    parameters are left out of its no-aliasing check does not apply, and one tensor twice in that check is
    "Duplicate tensor found where not expected!" on every warm call. The two are the same check (their
    code too: a guard that differs is kept)."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    kept = []
    for g in guards.inner:
        if g.create_fn_name() == "TENSOR_MATCH":
            key = (g.name, tuple(g.code_list or ()))  # the same source, checked the same way
            if key in seen:
                continue
            seen.add(key)
        kept.append(g)
    if len(kept) == len(guards.inner):
        return
    guards.inner = type(guards.inner)(kept)
    if hasattr(guards, "source_to_guards") and hasattr(guards, "track_guard_by_source"):
        guards.source_to_guards.clear()
        for g in kept:
            guards.track_guard_by_source(g)


def load(name: str, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
         backend: Callable[[fx.GraphModule, list[Any]], Any]) -> Forward | None:
    """The first traced forward under ``name`` (most recently used first) that applies to this call, with its
    step made by ``backend`` (that entry is then the most recently used); None where none does (stale
    sources, a failed guard, an identity that differs, other sizes, the joint graph no longer cached; each
    logged at INFO): the caller traces."""
    for path in _slots(name):
        try:
            forward = _load(path, model, args, kwargs, backend)
        except Exception as e:  # noqa: BLE001 - an entry that does not load here: try the next, or trace
            log.warning("piper: the traced forward %s was not used (%s: %s)", path, type(e).__name__, e,
                        exc_info=True)
            continue
        if forward is not None:
            with contextlib.suppress(OSError):
                os.utime(path)
            return forward
    return None


def _load(path: str, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
          backend: Callable[[fx.GraphModule, list[Any]], Any]) -> Forward | None:
    """The traced forward at ``path`` for this call (``load``), or None."""
    from torch._dynamo import convert_frame
    from torch._dynamo.package import SerializedCode

    entry = _read(path)
    if entry is None:
        return None
    fn, _ = convert_frame.get_traced_fn(model)
    scope = fn.__globals__
    installed = _install_by_id(entry, scope)
    found = _applies(entry, model, fn, args, kwargs) if installed is not None else \
        "an object that a global named by its id held is not in this process"
    bytecode = SerializedCode.to_code_object(entry.bytecode)
    missing = _globals_read(bytecode) - {entry.backend_name, *entry.import_sources} - set(scope) - set(vars(builtins))
    if not isinstance(found, str) and missing:
        found = f"it reads globals this process lacks ({sorted(missing)})"
    if isinstance(found, str):
        log.info("piper: the traced forward %s is not used: %s", path, found)
        for name in installed or ():
            scope.pop(name, None)
        return None
    forward = forward_of(model, bytecode, entry.backend_name, backend(found.gm, found.inputs), entry.import_sources,
                         found.manager, found.ids, found.guard_globals)
    for name in installed or ():
        weakref.finalize(forward.fn, scope.pop, name, None)
    return forward


@dataclass
class _Found:
    """What a loaded forward is made of."""

    manager: Any
    guard_globals: Mapping[str, Any]
    ids: list[tuple[types.CodeType, str, Any]]
    inputs: list[Any]
    gm: fx.GraphModule


def _applies(entry: _Entry, model: nn.Module, fn: types.FunctionType, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> _Found | str:
    """What a forward is made of, where ``entry`` applies to this call exactly; else why not."""
    if not os.path.exists(joint_cache.entry_path(entry.joint_key)):
        return "its joint graph is no longer cached"
    if not _sources_unchanged(entry):
        return "a line of source it traced changed"
    scope = fn.__globals__
    manager, guard_globals = _guard_manager(entry, fn.__code__, scope)
    f_locals = Forward(fn, inspect.signature(fn, follow_wrapped=False), manager, None).locals_of(model, args, kwargs)
    if not manager.check(f_locals):
        return f"a guard fails: {manager.check_verbose(f_locals).verbose_code_parts[:1]}"
    ids = [(_compiled(name), kind, snapshot(kind, evaluate(_compiled(name), guard_globals, f_locals)))
           for kind, name, _ in entry.dropped]
    for (_, _, obj), (_, name, text) in zip(ids, entry.dropped):
        if identity(obj) != text:
            return f"{name} is another object ({identity(obj)}, traced: {text})"
    inputs = [evaluate(_compiled(src), scope, f_locals) for src in entry.sources]
    if [("sym" if k == "sym" and type(x) is int else _kind(x)) for x, k in zip(inputs, entry.kinds)] != entry.kinds:
        return "an input is of another kind"
    gm = joint_cache._loads(entry.graph)
    fakes = _placeholder_values(gm)
    if not all(map(_as_traced, inputs, fakes)):
        return "other sizes than the trace's (its size hints, and the joint graph's, are the first call's)"
    inputs = [f if k == "sym" else x for x, f, k in zip(inputs, fakes, entry.kinds)]  # as Dynamo hands sizes over
    return _Found(manager, guard_globals, ids, inputs, gm)
