"""What names an object the same way in another process: the identity texts a saved trace's identity
guards are checked against at a load (``capture/forward_cache.py``), and the stable text of values that
go into cache keys.

Dynamo guards modules, functions, classes and closures by ``id``, which means nothing in the next run. An
identity text names the object by what makes it the same object there: a module by its name, a builtin or
class by its import path (a class also by the code of the functions it defines, and a dataclass by its
fields), a function by its import path, code and closure, an enum member by its class and name, a custom
op by its name, a dict's keys one by one. None: nothing names it (an arbitrary object), so a trace that
guards it is not saved.
"""
from __future__ import annotations

import enum
import hashlib
import sys
import types
from typing import Any

import torch


def stable(v: Any) -> str:
    """``repr`` that is the same in every process: sets and dicts in sorted order (a set of strings iterates
    in an order of the process's hash seed), objects whose ``repr`` is their address by their name."""
    if isinstance(v, (set, frozenset)):
        return f"{type(v).__name__}({sorted(stable(x) for x in v)})"
    if isinstance(v, dict):
        return "{" + ", ".join(sorted(f"{stable(k)}: {stable(x)}" for k, x in v.items())) + "}"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}({', '.join(stable(x) for x in v)})"
    text = repr(v)
    if " at 0x" in text:  # an object named by its address (a function in a config set): by its name instead
        return f"<{type(v).__qualname__} {getattr(v, '__module__', '')}.{getattr(v, '__qualname__', '')}>"
    return text


def code_digest(code: types.CodeType, h: Any) -> None:
    h.update(repr((code.co_name, code.co_names, code.co_varnames, code.co_freevars, code.co_argcount)).encode())
    h.update(code.co_code)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            code_digest(c, h)
        else:
            h.update(stable(c).encode())


def _import_path(obj: Any) -> str | None:
    """``module.name`` that gives ``obj`` back: its qualified name, or for a builtin its plain name
    (``torch.arange`` is ``_VariableFunctionsClass.arange``)."""
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        return None
    for name in dict.fromkeys([getattr(obj, "__qualname__", None), getattr(obj, "__name__", None)]):
        if not isinstance(name, str):
            continue
        try:
            if _by_path(f"{module}.{name}") is obj:
                return f"{module}.{name}"
        except Exception:  # noqa: BLE001 - not reachable by this name
            continue
    return None


def identity(obj: Any, depth: int = 0) -> str | None:
    """A text that names ``obj`` the same way in another process, or None where nothing does: a module by
    name, a class or builtin by its import path, an enum member by its class and name, a Python function by
    its import path or code and closure, a constant (in a closure) by its value, piper's block classes by
    the user's class."""
    from piper_compile.capture.made import Made

    if depth > 3:
        return None
    if type(obj) in (int, float, bool, str, bytes, type(None)):  # a closure's constant: its value
        return f"constant {type(obj).__name__} {obj!r}"
    if isinstance(obj, enum.Enum):
        path = _import_path(type(obj))
        return None if path is None or type(obj)[obj.name] is not obj else f"enum {path}.{obj.name}"
    if isinstance(obj, tuple):  # a dict's keys (``DICT_KEYS_MATCH``)
        parts = [identity(x, depth + 1) for x in obj]
        return None if None in parts else f"tuple ({', '.join(parts)})"  # type: ignore[arg-type]
    if isinstance(obj, torch._ops._OpNamespace):  # torch.ops.piper (a module subclass)
        return f"ops {obj.name}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}" if sys.modules.get(obj.__name__) is obj else None
    if isinstance(obj, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):  # torch.ops.piper.moe_experts
        return f"op {obj}"
    if isinstance(obj, type) and issubclass(obj, Made):  # piper's per-class subclasses (regions, tags)
        bases = [identity(b, depth + 1) for b in obj.__bases__]
        return None if None in bases else f"piper {obj.__qualname__}({', '.join(bases)})"  # type: ignore[arg-type]
    if isinstance(obj, types.FunctionType):
        return _function_identity(obj, depth)
    if isinstance(obj, types.CodeType):
        h = hashlib.sha256()
        code_digest(obj, h)
        return f"code {obj.co_qualname} {h.hexdigest()[:16]}"
    path = _import_path(obj)  # classes, builtins
    if path is None:
        return None
    return f"class {path} {_class_digest(obj)}" if isinstance(obj, type) else f"object {path}"


def _class_digest(cls: type) -> str:
    """The code of the functions a class defines and, for a dataclass, its fields: a class guarded by its
    name is the same class only while these are (a dataclass's generated ``__init__``, which Dynamo traces,
    has no source lines to compare)."""
    import dataclasses

    h = hashlib.sha256()
    for name, v in sorted(vars(cls).items()):
        fn = getattr(v, "__func__", v)  # staticmethod / classmethod
        if isinstance(fn, types.FunctionType):
            h.update(name.encode())
            code_digest(fn.__code__, h)
    if dataclasses.is_dataclass(cls):
        h.update(stable([(f.name, f.default, f.default_factory) for f in dataclasses.fields(cls)]).encode())
    return h.hexdigest()[:16]


def _function_identity(fn: types.FunctionType, depth: int) -> str | None:
    h = hashlib.sha256()
    code_digest(fn.__code__, h)
    h.update(stable(fn.__defaults__).encode())
    cells = [identity(c.cell_contents, depth + 1) for c in fn.__closure__ or ()]
    if None in cells:
        return None
    where = _import_path(fn) or "-"
    return f"function {where} {h.hexdigest()[:16]} [{', '.join(cells)}]"  # type: ignore[arg-type]


def resolve(text: str) -> Any:
    """The object of this process an identity text names, for the kinds that name one by where it lives (a
    module, an object or a class by import path); None otherwise, or where it names another object now."""
    import importlib

    kind, _, rest = text.partition(" ")
    path = rest.split(" ")[0]
    try:
        if kind == "module":
            found: Any = importlib.import_module(path)
        elif kind in ("object", "class"):
            found = _by_path(path)
        else:
            return None
    except Exception:  # noqa: BLE001 - nothing there now
        return None
    return found if identity(found) == text else None


def _by_path(path: str) -> Any:
    """``a.b.C`` imported: the longest module prefix, then attributes."""
    import importlib

    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            found = getattr(found, name)
        return found
    raise ImportError(path)
