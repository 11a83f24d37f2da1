"""Loading compiled pieces from Inductor's cache without importing Inductor's compiler.

On a warm run ``PIPER_FAST_LOAD`` loads each piece through Inductor's cache-hit path, which compiles
nothing but imports most of Inductor's compiler on the way, ~1.1 s of CPU per process (over a quarter of a
warm pipeline rank's first step, spent by every rank on cores the ranks share). Two places import it:

Inductor's cache-hit step imports ``torch._inductor.graph`` (its lowerings, scheduler, kernel templates)
only to read ``GraphLowering.save_output_code``, a hook tests set to see the code. A process that never
imported that module cannot have set the hook, so :func:`no_compiler_import` lets the hit read ``None``
from a stand-in module for the duration of the load, and removes the stand-in afterwards (the real module
imports as usual later). Where the module is imported already, nothing changes.

Every wrapper module Inductor generates starts by importing ``extern_kernels`` from
``torch._inductor.select_algorithm`` and ``_align`` from ``torch._inductor.codegen.memory_planning``.
Importing those two modules imports Inductor's lowerings, its kernel templates and flex attention: ~0.6 s
of CPU per process, on a warm run that compiles nothing and only calls ``extern_kernels.mm`` / ``addmm``,
which are ``torch.mm`` / ``torch.addmm``.

So from a process's first fast load on (``PIPER_FAST_LOAD``), piper reads each wrapper module with those
two lines pointed at the same objects from where they are cheap: ``_align`` from ``torch._inductor.utils``
(where ``memory_planning`` takes it from), and ``extern_kernels`` from :data:`extern_kernels` below, whose
torch functions are the ones Inductor registers under the same names (a unit test checks each is the very
object in Inductor's namespace) and which takes any other name from Inductor's namespace, importing it then.
A wrapper whose lines differ (another torch) is read unchanged; wrappers a later compilation in the process
writes are read the same way (their modules are imported by then anyway). The code that runs is the same.

A loaded piece's every call (``CompiledFxGraph.__call__``) reads three flags of ``torch._inductor.debug``,
a module whose import brings Inductor's IR and scheduler (0.06-0.08 s of CPU per warm rank, measured on
the 32-layer bench GPT). Until something imports that module, :class:`DebugFlags` stands in for it as
``torch._inductor``'s attribute (not in ``sys.modules``): its flags read the real module's defaults, or the
real module's values once it is imported; setting one, or asking for any other name, imports the real
module, which then replaces the stand-in as the package's attribute (the import system's own step).
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

from piper_compile.codegen.hooks import wrap_once

# Inductor's extern kernels that are torch's own functions of the same name.
TORCH_KERNELS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_int_mm", "_scaled_mm", "_grouped_mm")

_HEAVY_IMPORTS = {
    "from torch._inductor.select_algorithm import extern_kernels":
        "from piper_compile.codegen.light_load import extern_kernels",
    "from torch._inductor.codegen.memory_planning import _align as align":
        "from torch._inductor.utils import _align as align",
}


class _ExternKernels:
    """``extern_kernels`` for loaded wrapper modules: :data:`TORCH_KERNELS` from ``torch``, any other name
    from Inductor's own namespace."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in TORCH_KERNELS:
            kernel = getattr(torch, name)
        else:
            from torch._inductor.select_algorithm import extern_kernels as inductors

            kernel = getattr(inductors, name)
        setattr(self, name, kernel)
        return kernel


extern_kernels = _ExternKernels()


def light_source(source: str) -> str:
    """``source`` (a wrapper module's text) with its heavy import lines replaced by the cheap ones."""
    lines = source.split("\n", 64)  # the imports are in the module's first lines
    for i, line in enumerate(lines[:-1]):
        lines[i] = _HEAVY_IMPORTS.get(line, line)
    return "\n".join(lines)


def light_reload(reload: Callable[..., ModuleType]) -> Callable[..., ModuleType]:
    """Inductor's ``_reload_python_module(key, path, set_sys_modules)`` reading the module through
    :func:`light_source` (the same module object, names and ``sys.modules`` entry)."""
    def load(key: str, path: str, set_sys_modules: bool = True) -> ModuleType:
        try:
            with open(path) as fh:
                code = compile(light_source(fh.read()), path, "exec", dont_inherit=True)
        except Exception:  # noqa: BLE001 - Inductor's own loader reports it as it does
            return reload(key, path, set_sys_modules=set_sys_modules)
        mod = ModuleType(f"{reload.__module__}.{key}")
        mod.__file__ = path
        mod.key = key  # type: ignore[attr-defined]
        exec(code, mod.__dict__, mod.__dict__)
        if set_sys_modules:
            sys.modules[mod.__name__] = mod
        return mod

    return load


def install() -> None:
    """Install :func:`light_reload` on Inductor's wrapper loader (a torch without one is left as it is)."""
    wrap_once("torch._inductor.codecache", "_reload_python_module", light_reload)


_GRAPH = "torch._inductor.graph"
_DEBUG = "torch._inductor.debug"
# The flags a compiled piece's call reads, with their values in torch._inductor.debug as it is imported.
DEBUG_FLAGS = {"RECORD_GRAPH_EXECUTION": False, "GRAPH_EXECUTION_ORDER": None, "GRAPH_COMPILE_IDS": None}


def _flag(name: str) -> property:
    def read(_: ModuleType) -> Any:
        real = sys.modules.get(_DEBUG)
        return DEBUG_FLAGS[name] if real is None else getattr(real, name)

    def write(_: ModuleType, value: Any) -> None:
        setattr(importlib.import_module(_DEBUG), name, value)

    return property(read, write)


class DebugFlags(ModuleType):
    """``torch._inductor.debug`` as a loaded piece's call reads it, before the real module is imported (see
    the module's docstring); anything else is the real module's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module(_DEBUG), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(importlib.import_module(_DEBUG), name, value)


for _name in DEBUG_FLAGS:
    setattr(DebugFlags, _name, _flag(_name))


def _debug_flags() -> None:
    """Make ``torch._inductor.debug`` readable without importing it (a :class:`DebugFlags`), unless it is."""
    import torch._inductor as inductor

    if _DEBUG not in sys.modules and not hasattr(inductor, "debug"):
        inductor.debug = DebugFlags(_DEBUG)  # type: ignore[attr-defined]


@contextlib.contextmanager
def no_compiler_import() -> Iterator[None]:
    """While inside, a cache hit's ``from torch._inductor.graph import GraphLowering`` reads a stand-in whose
    ``save_output_code`` is None (as the real one's is until someone sets it) -- unless the real module is
    imported already. Anything else asked of the stand-in is an ImportError or AttributeError, which the
    caller treats as a failed fast load (the full path then imports the real module)."""
    if _GRAPH in sys.modules:
        yield
        return
    _debug_flags()  # a loaded piece's call reads its flags; the compiler import brings the real module

    stand_in = ModuleType(_GRAPH)
    stand_in.GraphLowering = type("GraphLowering", (), {"save_output_code": None})  # type: ignore[attr-defined]
    sys.modules[_GRAPH] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(_GRAPH) is stand_in:
            del sys.modules[_GRAPH]
