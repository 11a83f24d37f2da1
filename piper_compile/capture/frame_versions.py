"""Dynamo's compiled versions of the frames piper compiles: a piper step never runs eagerly.

Dynamo keeps the versions it compiles for a frame on the frame's code object, at most
``torch._dynamo.config.recompile_limit`` (8) of them, and past the limit runs the frame eagerly (unless
``fullgraph=True``). Every ``torch.compile(model, backend="piper", options=...)`` is a new backend, so each
model of one class adds a version to the class's ``forward``: the ninth model compiled in a process ran
its forward eagerly, i.e. it trained nothing (no optimizer step, no gradient reduction), silently, with
only Dynamo's warning. A plain ``torch.compile`` (Inductor) falls back to the same numbers; a piper step
cannot.

So piper counts the versions itself, per model (the frame's ``self``, the module whose forward Dynamo
compiles; per code object for a frame that is no module's method):

- a model's first version of a frame is not a recompile (Dynamo's reason then names another model's
  version: a different backend), so nothing is reported, unless the model already ran on a version
  compiled for another model (Dynamo runs it for every model whose guards pass, equal options included):
  a changed attribute then compiles the model's first version, and that is a recompile. A version for a
  ``torch.compile`` whose options differ from those of every version Dynamo holds (its ``BACKEND_MATCH``
  guard failed) is a new compile of the model, not a recompile (``another_compile``);
- a model gets the limit's worth of versions of its own: past them piper refuses with the recompile-limit
  error ``fullgraph=True`` gives (``recompiles.limit_message``), never an eager run;
- Dynamo's own limits (``recompile_limit``, ``accumulated_recompile_limit``) are kept above the versions the
  frame holds, so Dynamo never reaches its eager fallback on a piper frame. They are process-wide: other
  compiled functions then also get that many versions before Dynamo runs them eagerly (only slower, never
  other numbers). The limit piper counts a model's versions against is the user's (the value the config
  had when piper last found it changed by someone else).

Dynamo must also see a parameter's ``requires_grad_()`` (freezing a layer between steps): the version
compiled with the layer trained would go on training it. Before torch 2.13 (seen on 2.11; torch's fix is
pytorch#177158), Dynamo skips the tensor guards of a module's parameters while the module's parameter dict
is unchanged (``skip_tensor_guards_with_matching_dict_tags``), and ``requires_grad_()`` does not change the
dict: the frozen layer kept training, silently. There piper turns that skip off (process-wide, like the
limits: other compiled functions then check their parameters' guards on every call, a little slower, never
other numbers).
"""
from __future__ import annotations

import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch._dynamo import config as dynamo_config

# owner module -> code object -> versions piper compiled; code objects of frames without a module owner
_BY_OWNER: "weakref.WeakKeyDictionary[nn.Module, dict[types.CodeType, int]]" = weakref.WeakKeyDictionary()
_BY_CODE: "weakref.WeakKeyDictionary[types.CodeType, int]" = weakref.WeakKeyDictionary()
# owner module -> code objects whose version compiled for another model it ran on
_RAN: "weakref.WeakKeyDictionary[nn.Module, set[types.CodeType]]" = weakref.WeakKeyDictionary()
_LIMITS = {"recompile_limit": [0, 0], "accumulated_recompile_limit": [0, 0]}  # name -> [user's, last piper set]


@dataclass(frozen=True)
class Version:
    """The version of a frame Dynamo is compiling now, for its owner."""

    owner: nn.Module | None
    number: int  # 1: the owner's first version of this frame
    limit: int  # the user's recompile_limit
    code: types.CodeType | None = None
    ran_before: bool = False  # the owner ran on a version of this frame compiled for another model

    @property
    def first(self) -> bool:
        """No recompile: the owner's first version of the frame, and it ran on none before."""
        return self.number == 1 and not self.ran_before

    @property
    def over_limit(self) -> bool:
        return self.number > self.limit


def compiling() -> tuple[types.CodeType, nn.Module | None] | None:
    """The code object of the frame Dynamo is compiling, and the module it is a method of (the frame's
    first argument, where that is an nn.Module); None outside a Dynamo compile or where this torch's
    translator does not say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code, f_locals = tx.f_code, tx.f_locals
    except Exception:  # noqa: BLE001 - private API of another torch version, or no compile under way
        return None
    first = code.co_varnames[0] if code.co_argcount else None
    owner = f_locals.get(first) if first is not None else None
    return code, owner if isinstance(owner, nn.Module) else None


def count_version() -> Version | None:
    """Count the version Dynamo is compiling now (called once per backend call) and keep Dynamo's limits
    above the versions its frame will hold; None where the frame is unknown (nothing is counted)."""
    frame = compiling()
    if frame is None:
        return None
    code, owner = frame
    check_parameter_guards()
    table = _BY_OWNER.setdefault(owner, {}) if owner is not None else _BY_CODE
    number = table[code] = table.get(code, 0) + 1
    _keep_above(code)  # reads the user's limits before it raises Dynamo's
    ran_before = owner is not None and code in _RAN.get(owner, ())
    return Version(owner, number, _LIMITS["recompile_limit"][0], code, ran_before)


def another_compile(code: types.CodeType | None, options: Any) -> bool:
    """Whether every version of ``code`` Dynamo holds was compiled by a ``torch.compile`` whose options
    differ from ``options`` (the compiling one's): the frame is then compiled for a new ``torch.compile``
    of the model, not again. False where a version's backend shows no options or they do not compare."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        kwargs = [getattr(getattr(e, "backend", None), "kwargs", None) for e in _debug_get_cache_entry_list(code)]
        return all(isinstance(k, dict) and "options" in k for k in kwargs) and \
            not any(bool(k["options"] == options) for k in kwargs)
    except Exception:  # noqa: BLE001 - another torch's cache entries, or options that do not compare
        return False


def failed_guards(code: types.CodeType | None) -> list[str]:
    """The guard each version of ``code`` Dynamo holds fails on the call compiling now (as Dynamo writes a
    recompile's reason: ``<compile id>: <guard>``); empty where this torch does not say."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo import guards
        from torch._dynamo.symbolic_convert import InstructionTranslator

        local = getattr(guards, "strip_local_scope", lambda text: text)  # L['self'].k -> self.k, as Dynamo writes
        f_locals = InstructionTranslator.current_tx().f_locals
        out = []
        for entry in _debug_get_cache_entry_list(code):
            result = entry.guard_manager.check_verbose(f_locals)
            if not result.result and result.verbose_code_parts:
                out.append(local(f"{getattr(entry, 'compile_id', '?')}: {result.verbose_code_parts[0]}"))
        return out
    except Exception:  # noqa: BLE001 - private API of another torch version, or no compile under way
        return []


def note_ran(owner: nn.Module, code: types.CodeType) -> None:
    """``owner`` runs on a version of ``code`` that Dynamo compiled for another model."""
    _RAN.setdefault(owner, set()).add(code)


def check_parameter_guards() -> None:
    """Where this torch's Dynamo skips the guards of a module's parameters (before 2.13), make it check
    them, so that a changed ``requires_grad`` compiles a new version (read when Dynamo builds the guards of
    the frame compiling now, after the backend returns)."""
    from piper_compile.disk import torch_version

    if torch_version() < (2, 13) and getattr(dynamo_config, "skip_tensor_guards_with_matching_dict_tags", False):
        dynamo_config.skip_tensor_guards_with_matching_dict_tags = False


def _user_limit(name: str) -> int:
    """The limit as the user set it: the config's value unless it is the one piper wrote last."""
    now = int(getattr(dynamo_config, name))
    seen = _LIMITS[name]
    if now != seen[1]:
        seen[0] = now
    return seen[0]


def _keep_above(code: types.CodeType) -> None:
    """Room in Dynamo's limits for one more version of ``code`` after the one compiling now."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._guards import CompileContext

    held = len(_debug_get_cache_entry_list(code)) + 1  # with the version compiling now
    compile_id = CompileContext.current_compile_id()
    frame_id = compile_id.frame_compile_id if compile_id is not None and compile_id.frame_compile_id is not None else 0
    for name, need in (("recompile_limit", held + 1), ("accumulated_recompile_limit", max(held, frame_id + 1) + 1)):
        _user_limit(name)
        if int(getattr(dynamo_config, name)) < need:
            setattr(dynamo_config, name, need)
            _LIMITS[name][1] = need


def calling_module(params: list[Any]) -> nn.Module | None:
    """The module whose compiled forward is making this call: the innermost calling frame whose ``self``
    is an nn.Module holding every one of ``params`` (Dynamo runs the compiled forward in the module's own
    frame)."""
    ids = {id(p) for p in params}
    f = sys._getframe(1)
    for _ in range(24):
        if f is None:
            break
        m = f.f_locals.get("self") if "self" in f.f_code.co_varnames else None
        if isinstance(m, nn.Module) and ids <= {id(p) for p in m.parameters()}:
            return m
        f = f.f_back
    return None


def release_with(owner: nn.Module, step: Any) -> None:
    """When ``owner`` is garbage-collected, ``step.release()``: Dynamo keeps the compiled version of a
    class's ``forward`` (and with it the step, its parameters and optimizer state) as long as the class."""
    weakref.finalize(owner, _release, weakref.ref(step))


def _release(ref: "weakref.ref[Any]") -> None:
    step = ref()
    if step is not None:
        step.release()
