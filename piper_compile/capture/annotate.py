"""``piper_compile.annotate``: tag regions of a model, inside ``forward`` or on a module from outside.

Tags travel through ``torch.fx.traceback.annotate`` into ``node.meta["custom"]`` of both forward and
backward nodes of the joint graph. ``annotate("PP")`` auto-indexes: every entry gets a fresh raw index
(``"auto:N"``), and capture renumbers them 0, 1, ... in trace order.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

AUTO_PREFIX = "auto:"
_counter = itertools.count()


@torch._dynamo.assume_constant_result
def _next_auto_index() -> int:
    # Evaluated once per trace by Dynamo and baked in as a constant: no guard, no recompile.
    return next(_counter)


class _ModuleAnnotation:
    """Marker so that annotating a module twice updates its tags instead of stacking wrappers."""


def _annotate_module(module: nn.Module, tags: dict[str, Any]) -> nn.Module:
    cls = type(module)
    if issubclass(cls, _ModuleAnnotation):
        module._piper_tags = {**module._piper_tags, **tags}  # type: ignore[attr-defined]
        return module
    module.__class__ = _annotated_class(cls)
    module._piper_tags = dict(tags)  # type: ignore[attr-defined]
    return module


_ANNOTATED: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _annotated_class(cls: type) -> type:
    """One subclass per annotated class, not per instance: Dynamo traces it like any module, and the
    blocks of a stack keep one type, so a nested compile region traced for one is reused for the others
    (its guards match the module's type)."""
    made = _ANNOTATED.get(cls)
    if made is not None:
        return made
    base_forward = cls.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with fx_traceback.annotate(dict(self._piper_tags)):
            return base_forward(self, *args, **kwargs)

    made = type(f"Piper{cls.__name__}", (cls, _ModuleAnnotation), {"forward": forward, "__module__": cls.__module__})
    _ANNOTATED[cls] = made
    return made


def annotate(target: nn.Module | str | None = None, /, **tags: int | str) -> Any:
    """Tag a region of the model.

    * ``with annotate("PP"): ...`` inside ``forward`` -- auto-indexed in trace order (0, 1, ...);
    * ``with annotate(PP=1): ...`` inside ``forward`` -- explicit index;
    * ``annotate(model.blocks[3], PP=1)`` -- tags every op of that module's forward, without editing
      its code; returns the module.
    """
    if isinstance(target, nn.Module):
        if not tags:
            raise TypeError("piper: annotate(module, ...) needs at least one tag, e.g. annotate(block, PP=1)")
        return _annotate_module(target, tags)
    if isinstance(target, str):
        tags = {**tags, target: f"{AUTO_PREFIX}{_next_auto_index()}"}
    elif target is not None:
        raise TypeError(f"piper: annotate() takes a module or a tag name, got {type(target).__name__}")
    if not tags:
        raise TypeError('piper: annotate() needs a tag, e.g. annotate("PP") or annotate(PP=0)')
    return fx_traceback.annotate(dict(tags))
