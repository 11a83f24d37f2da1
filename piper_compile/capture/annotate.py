"""``piper_compile.annotate``: tag regions of a model, inside ``forward`` or on a module from outside.

Tags travel through ``torch.fx.traceback.annotate`` into ``node.meta["custom"]`` of both forward and
backward nodes of the joint graph. ``annotate("PP")`` auto-indexes: every entry gets a fresh raw index
(``"auto:N"``), and capture renumbers them 0, 1, ... in trace order.
"""
from __future__ import annotations

import copyreg
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


class Made:
    """Base of the marker classes of piper's run-time subclasses of a user's module class (tags:
    ``Piper<Block>``; a nested compile region: ``Region<Block>``, ``capture/blocks.py``). Pickle finds a
    class by its module and name, which a class made at run time does not have: an instance pickles as
    its user's class plus the layers piper put on it, and loads (in any process that imports piper) with
    the same subclasses made again, or found where they exist. ``torch.save(model)`` of a tagged model,
    and handing one to a spawned process, work as for the untagged model."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        reduced = object.__reduce_ex__(self, protocol)
        base, layers = made_layers(type(self))
        if (not isinstance(reduced, tuple) or reduced[0] is not copyreg.__newobj__
                or tuple(reduced[1]) != (type(self),)):
            return reduced  # the user's class pickles itself its own way: theirs, as it is
        return (remade, (base, layers), *reduced[2:])


class _ModuleAnnotation(Made):
    """Marker so that annotating a module twice updates its tags instead of stacking wrappers."""


def made_layers(cls: type) -> tuple[type, tuple[str, ...]]:
    """The user's class below piper's subclasses of ``cls``, and those subclasses from the user's class up
    ("tags", "region")."""
    from piper_compile.capture.blocks import _Region

    layers: list[str] = []
    while any(b in (_ModuleAnnotation, _Region) for b in cls.__bases__[1:]):
        layers.append("tags" if _ModuleAnnotation in cls.__bases__ else "region")
        cls = cls.__bases__[0]
    return cls, tuple(reversed(layers))


def remade(base: type, layers: tuple[str, ...]) -> Any:
    """An empty instance of ``base`` with piper's ``layers`` of subclasses on it (what pickle calls to load
    one; its state is set afterwards)."""
    from piper_compile.capture.blocks import region_class

    cls = base
    for layer in layers:
        cls = _annotated_class(cls) if layer == "tags" else region_class(cls)
    return cls.__new__(cls)


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
