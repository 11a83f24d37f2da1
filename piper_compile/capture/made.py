"""piper's run-time subclasses of a user's module class, and the one place that knows their layers.

Two kinds of layer go on a module's class, each one subclass per class (not per instance, so the blocks of
a stack keep one type and Dynamo reuses what it traced for one of them):

* **tags** (``Piper<Block>``, :class:`Tagged`): ``annotate(block, PP=1)``; its ``forward`` runs the user's
  under ``torch.fx.traceback.annotate`` with the module's own tags (``capture/annotate.py``);
* **region** (``Region<Block>``, :class:`Region`): a repeated block whose ``forward`` is a nested compile
  region (``capture/blocks.py``).

A tagged region is ``Piper<Region<Block>>``. Pickle finds a class by its module and name, which a class made
at run time does not have: :class:`Made` pickles an instance as its user's class plus its layers and loads it
(:func:`remade`, in any process that imports piper) with the same subclasses made again or found.
"""
from __future__ import annotations

import copyreg
import weakref
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn


class Made:
    """Base of piper's layer classes: an instance pickles as its user's class plus the layers piper put on
    it, so ``torch.save(model)`` of a tagged or marked model, and handing one to a spawned process, work as
    for the plain model."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        reduced = object.__reduce_ex__(self, protocol)
        base, layers = made_layers(type(self))
        if (not isinstance(reduced, tuple) or reduced[0] is not copyreg.__newobj__
                or tuple(reduced[1]) != (type(self),)):
            return reduced  # the user's class pickles itself its own way: theirs, as it is
        return (remade, (base, layers), *reduced[2:])


class Tagged(Made):
    """Marker of a class whose modules carry tags (``_piper_tags``): annotating one again updates its tags
    instead of stacking another layer."""


class Region(Made):
    """Marker of a block class whose ``forward`` is a nested compile region."""


_TAGGED: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()
_REGION: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def tagged_class(cls: type) -> type:
    """``cls`` whose ``forward`` runs under the module's tags (one class per ``cls``)."""
    made = _TAGGED.get(cls)
    if made is not None:
        return made
    base_forward = cls.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with fx_traceback.annotate(dict(self._piper_tags)):
            return base_forward(self, *args, **kwargs)

    made = type(f"Piper{cls.__name__}", (cls, Tagged), {"forward": forward, "__module__": cls.__module__})
    _TAGGED[cls] = made
    return made


def _nested_region(fn: Any) -> Any:
    """``fn`` marked as a nested compile region. Dynamo keeps a traced body per set of guards (a block whose
    attributes differ gets a body of its own) and refuses more than ``max_reuse_entries`` (8 by default):
    piper lifts the limit so a model whose blocks all differ is traced block by block, not refused."""
    try:
        return torch.compiler.nested_compile_region(fn, max_reuse_entries=1 << 20)
    except TypeError:  # a torch without the argument
        return torch.compiler.nested_compile_region(fn)


def region_class(cls: type) -> type:
    """``cls`` with its ``forward`` a nested compile region (one class per ``cls``)."""
    made = _REGION.get(cls)
    if made is None:
        marked = _nested_region(cls.forward)
        made = type(f"Region{cls.__name__}", (cls, Region),
                    {"forward": marked, "__module__": cls.__module__, "__qualname__": f"Region{cls.__qualname__}"})
        _REGION[cls] = made
    return made


def made_layers(cls: type) -> tuple[type, tuple[str, ...]]:
    """The user's class below piper's layers on ``cls``, and those layers from the user's class up
    ("tags", "region")."""
    layers: list[str] = []
    while any(b in (Tagged, Region) for b in cls.__bases__[1:]):
        layers.append("tags" if Tagged in cls.__bases__ else "region")
        cls = cls.__bases__[0]
    return cls, tuple(reversed(layers))


def user_class(cls: type) -> type:
    """The user's class below piper's layers on ``cls`` (``cls`` itself where it has none)."""
    return made_layers(cls)[0]


def with_layers(base: type, layers: tuple[str, ...]) -> type:
    """``base`` with piper's ``layers`` on it, from the user's class up (``made_layers`` undone)."""
    cls = base
    for layer in layers:
        cls = tagged_class(cls) if layer == "tags" else region_class(cls)
    return cls


def remade(base: type, layers: tuple[str, ...]) -> Any:
    """An empty instance of ``base`` with piper's ``layers`` of subclasses on it (what pickle calls to load
    one; its state is set afterwards)."""
    cls = with_layers(base, layers)
    return cls.__new__(cls)


def is_region(cls: type) -> bool:
    """A region class, or the tags layer on one."""
    return issubclass(cls, Region)
