"""Where piper wraps one of Inductor's private functions to skip work a warm run does not need (the
vec-ISA load probe and the header precompiler in ``codegen/warmup.py``, the wrapper-module reader in
``codegen/light_load.py``): each is installed once per process, and only where this torch has the function."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def wrap_once(owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``wrap(owner.name)`` unless ``wrap`` wrapped it already (the result names
    what it wraps in ``__wrapped__`` and the wrapper in ``piper_wrapper``). ``owner`` is an object or a
    module's name; a missing module or attribute (another torch) is left as it is."""
    if isinstance(owner, str):
        try:
            owner = importlib.import_module(owner)
        except ImportError:
            return
    current = getattr(owner, name, None)
    if not callable(current) or getattr(current, "piper_wrapper", None) is wrap:
        return
    wrapped = wrap(current)
    wrapped.piper_wrapper = wrap  # type: ignore[attr-defined]
    wrapped.__wrapped__ = current  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)
