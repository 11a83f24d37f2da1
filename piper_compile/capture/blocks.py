"""Repeated blocks as nested compile regions: piper marks them, so a deep model traces like a shallow one.

``piper.compile`` marks the blocks of every ``ModuleList`` / ``Sequential`` whose children are alike
(the same class, the same parameter and buffer shapes and dtypes, at least two of them) with
``torch.compiler.nested_compile_region``: Dynamo then traces one block and stamps it out for the others
(after checking its guards on each; ``capture/region_guards.py`` makes each keep them at run time), and
AOTAutograd exports its forward and backward once (``capture/subgraphs.py`` inlines the calls into
piper's flat graph afterwards). A 32-layer model's trace and export cost about what one block's do, in
place of growing with the layer count.

A block is marked through a subclass per class (``Region<Block>``) whose ``forward`` is the marked
original; the module keeps its identity, parameters and state-dict names, and outside ``torch.compile``
the region is a plain call. A block annotated with tags (``annotate(block, PP=1)``) keeps its tags
outside the region, so each call's copy gets its own. ``PIPER_NESTED_REGIONS`` chooses ("auto": on
where the model has repeated blocks and no directive rewrites Dynamo's graph per layer, "off").
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from piper_compile.capture import region_guards
from piper_compile.capture.annotate import Made, _annotated_class, _ModuleAnnotation
from piper_compile.directives.spec import Directive, ShardTensor
from piper_compile.disk import TESTED_TORCH, torch_version
from piper_compile.knobs import knob

_REGION: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


class _Region(Made):
    """Marker of a block class whose ``forward`` is a nested compile region."""


def _signature(module: nn.Module) -> tuple[Any, ...]:
    return (_base(type(module)), tuple((n, tuple(t.shape), t.dtype) for n, t in module.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in module.named_buffers()))


def _plain_inside(block: nn.Module) -> bool:
    """``block`` is made of modules (a single layer, one op, gains nothing from a region), none of which
    carries tags of its own (``annotate(block.moe, EP=i)``: those differ per block, and a body shared by
    the blocks would carry the first one's); nor is it a list itself, nor checkpointed by Hugging Face."""
    inside = [m for m in block.modules() if m is not block]
    return bool(inside) and not isinstance(block, (nn.ModuleList, nn.Sequential)) and not any(
        isinstance(m, _ModuleAnnotation) for m in inside) and not _checkpointed(block)


def _checkpointed(block: nn.Module) -> bool:
    """Hugging Face calls a layer whose ``gradient_checkpointing`` flag is on (``gradient_checkpointing_enable()``)
    through ``torch.utils.checkpoint``, which Dynamo cannot trace as a nested compile region (torch 2.13:
    a KeyError on a size symbol, then a trace of every block after all)."""
    return getattr(block, "gradient_checkpointing", False) is True and block.training


def _base(cls: type) -> type:
    """The user's class of a block: below piper's annotation and region subclasses."""
    while issubclass(cls, (_ModuleAnnotation, _Region)) and cls.__mro__[1] is not object:
        cls = cls.__mro__[1]
    return cls


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
        made = type(f"Region{cls.__name__}", (cls, _Region),
                    {"forward": marked, "__module__": cls.__module__, "__qualname__": f"Region{cls.__qualname__}"})
        _REGION[cls] = made
    return made


def _mark(module: nn.Module) -> None:
    cls = type(module)
    if _marked(cls):
        return
    region = region_class(_base(cls))
    module.__class__ = _annotated_class(region) if issubclass(cls, _ModuleAnnotation) else region


def _marked(cls: type) -> bool:
    """A region class, or piper's annotation subclass of one."""
    return issubclass(cls, _Region) or (issubclass(cls, _ModuleAnnotation) and issubclass(cls.__mro__[1], _Region))


def _unmark(module: nn.Module) -> bool:
    """``module`` back to its class before :func:`_mark` (keeping its tags); whether it was marked."""
    cls = type(module)
    if not _marked(cls):
        return False
    base = _base(cls)
    module.__class__ = _annotated_class(base) if issubclass(cls, _ModuleAnnotation) else base
    return True


def unmark_blocks(model: nn.Module) -> int:
    """Undo :func:`mark_repeated_blocks` on every module of ``model``; the number of blocks unmarked."""
    return sum(_unmark(m) for m in model.modules())


def flat_on_failure(model: nn.Module, run: Callable[[], Any]) -> Any:
    """``run()`` (a Dynamo trace of ``model``), and, where Dynamo fails on a model whose blocks piper marked
    as nested compile regions, ``run()`` again with the blocks unmarked (traced one by one, as with
    ``PIPER_NESTED_REGIONS=off``), with a warning: Dynamo's region support has gaps (HF GPT-2's blocks
    fail its stamp-out where their floats are inputs), and a region is only ever a shortcut. A failure of
    the flat trace is the user's error."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    try:
        return run()
    except TorchDynamoException as e:
        if isinstance(e, BackendCompilerFailed) or not any(_marked(type(m)) for m in model.modules()):
            raise  # piper's own error (the trace got through), or nothing to unmark
        unmark_blocks(model)
        out = run()  # where this fails too, the failure is the model's own: raised without the warning
        warnings.warn(f"piper: Dynamo could not trace the repeated blocks of {type(model).__name__} as nested "
                      f"compile regions ({type(e).__name__}: {str(e).splitlines()[0][:200]}); traced them one by "
                      "one (slower first step, same training; PIPER_NESTED_REGIONS=off skips the attempt)",
                      stacklevel=3)
        return out


def repeated_lists(model: nn.Module) -> list[str]:
    """Names of the module lists of ``model`` whose children are alike, outermost first (a list inside a
    marked block is traced with it)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if any(name.startswith(f + ".") for f in found):
            continue
        children = list(module)
        first = _signature(children[0])
        if all(_signature(c) == first and _plain_inside(c) for c in children):
            found.append(name)
    return found


def wanted(directives: list[Directive]) -> bool:
    """Whether ``PIPER_NESTED_REGIONS`` marks blocks for a step with ``directives``: "auto" does unless a
    directive rewrites layers of Dynamo's graph one by one (``shard_tensor``), which a shared body cannot
    carry per layer, or torch is older than the one the region metadata (``capture/subgraphs.py``) is
    tested with. Never where Dynamo's reuse check is not the one ``capture/region_guards.py`` makes guard
    every block: a later block's changed attribute would be ignored."""
    mode = knob("PIPER_NESTED_REGIONS")
    if mode == "off" or getattr(torch.compiler, "nested_compile_region", None) is None:
        return False
    if mode != "on" and (torch_version() < TESTED_TORCH or any(isinstance(d, ShardTensor) for d in directives)):
        return False
    return region_guards.install()  # a torch whose stamped-out blocks piper cannot guard: trace every block


def mark_repeated_blocks(model: nn.Module) -> list[str]:
    """Mark the children of every repeated module list of ``model`` as nested compile regions; returns
    the lists' names."""
    lists = repeated_lists(model)
    for name in lists:
        for block in model.get_submodule(name):
            _mark(block)
    return lists
