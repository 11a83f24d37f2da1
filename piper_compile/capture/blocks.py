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
from typing import Any, Callable

import torch
from torch import nn

from piper_compile.capture import region_guards
from piper_compile.capture.made import Tagged, is_region, region_class, tagged_class, user_class
from piper_compile.directives.spec import Directive, ShardTensor
from piper_compile.disk import TESTED_TORCH, torch_version
from piper_compile.knobs import knob


def _signature(module: nn.Module) -> tuple[Any, ...]:
    return (user_class(type(module)), tuple((n, tuple(t.shape), t.dtype) for n, t in module.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in module.named_buffers()))


def _plain_inside(block: nn.Module) -> bool:
    """``block`` is made of modules (a single layer, one op, gains nothing from a region), none of which
    carries tags of its own (``annotate(block.moe, EP=i)``: those differ per block, and a body shared by
    the blocks would carry the first one's); nor is it a list itself, nor checkpointed by Hugging Face."""
    inside = [m for m in block.modules() if m is not block]
    return bool(inside) and not isinstance(block, (nn.ModuleList, nn.Sequential)) and not any(
        isinstance(m, Tagged) for m in inside) and not _checkpointed(block)


def _checkpointed(block: nn.Module) -> bool:
    """Hugging Face calls a layer whose ``gradient_checkpointing`` flag is on (``gradient_checkpointing_enable()``)
    through ``torch.utils.checkpoint``, which Dynamo cannot trace as a nested compile region (torch 2.13:
    a KeyError on a size symbol, then a trace of every block after all)."""
    return getattr(block, "gradient_checkpointing", False) is True and block.training


def _mark(module: nn.Module) -> None:
    cls = type(module)
    if is_region(cls):
        return
    region = region_class(user_class(cls))
    module.__class__ = tagged_class(region) if issubclass(cls, Tagged) else region


def _unmark(module: nn.Module) -> bool:
    """``module`` back to its class before :func:`_mark` (keeping its tags); whether it was marked."""
    cls = type(module)
    if not is_region(cls):
        return False
    base = user_class(cls)
    module.__class__ = tagged_class(base) if issubclass(cls, Tagged) else base
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
        if isinstance(e, BackendCompilerFailed) or not any(is_region(type(m)) for m in model.modules()):
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
