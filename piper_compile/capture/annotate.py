"""``piper_compile.annotate``: tag regions of a model, inside ``forward`` or on a module from outside.

Tags travel through ``torch.fx.traceback.annotate`` into ``node.meta["custom"]`` of both forward and
backward nodes of the joint graph. ``annotate("PP")`` auto-indexes: every entry gets a fresh raw index
(``"auto:N"``), and capture renumbers them 0, 1, ... in trace order.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from piper_compile.capture.made import Tagged, tagged_class
from piper_compile.capture.made import remade  # noqa: F401 - pickles written before made.py existed name it here

AUTO_PREFIX = "auto:"
_counter = itertools.count()


@torch._dynamo.assume_constant_result
def _next_auto_index() -> int:
    # Evaluated once per trace by Dynamo and baked in as a constant: no guard, no recompile.
    return next(_counter)


def _annotate_module(module: nn.Module, tags: dict[str, Any]) -> nn.Module:
    cls = type(module)
    if issubclass(cls, Tagged):
        module._piper_tags = {**module._piper_tags, **tags}  # type: ignore[attr-defined]
        return module
    module.__class__ = tagged_class(cls)
    module._piper_tags = dict(tags)  # type: ignore[attr-defined]
    return module


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
