"""Tensors whose memory piper gave back, marked between steps so that reading them is a clear error.

A parameter this rank never reads (another pipeline stage's), the full tensor of a ZeRO-3 parameter and
the full weight of an expert or tensor-parallel shard keep their shape but have no storage between steps
(``runtime/zero.free_storage``). Reading one read freed memory: a segfault on CPU, an illegal address on
CUDA, or numbers from nowhere -- e.g. an EMA of ``model.parameters()``, logging a weight's norm, calling
the original model instead of the compiled one (``generate()``), ``torch.save(model)`` or
``copy.deepcopy(model)``. After each call of a step made by ``piper.compile``, such tensors are marked:
their class becomes :class:`ReleasedParameter` (or :class:`ReleasedBuffer`), whose ``__torch_function__``
lets metadata through (shape, dtype, device, ``numel``, ``grad``, ``requires_grad``, its empty storage)
and raises a ``piper:`` error naming the tensor for anything that reads or writes its values. The next
call puts the classes back before Dynamo's guards look at them (``api._compiled_forward``), and so do
the state dict hooks (``checkpoint/hooks.py``, which fetch the full values from the ranks that hold
them), the public functions that read parameters (``registry.plain_tensors``) and
``zero.ensure_storage`` / ``free_storage``. A class change is one pointer write (~0.06 us); marking looks
at each parameter's storage once per call (~0.3 us a parameter, only in a run that released any).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from piper_compile.errors import PiperError

_T = torch.Tensor
_METADATA = frozenset({
    _T.shape.__get__, _T.size, _T.dim, _T.ndim.__get__, _T.numel, _T.nelement, _T.dtype.__get__,
    _T.device.__get__, _T.layout.__get__, _T.is_cuda.__get__, _T.is_meta.__get__, _T.is_sparse.__get__,
    _T.is_floating_point, _T.is_complex, _T.element_size, _T.stride, _T.is_contiguous, _T.__len__,
    _T.__hash__, _T.requires_grad.__get__, _T.requires_grad.__set__, _T.requires_grad_, _T.is_leaf.__get__,
    _T.grad.__get__, _T.grad.__set__, _T.grad_fn.__get__, _T.nbytes.__get__, _T.itemsize.__get__,
    # its (empty) storage is safe to look at: only a view larger than its storage reads freed memory
    _T.untyped_storage, _T.data_ptr, _T.storage_offset,
})
_NAMES: dict[int, str] = {}  # id of a marked tensor -> its name (for the error)


def _refuse(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    marked = next((a for a in tree_leaves((args, kwargs or {})) if is_marked(a)), None)
    name = _NAMES.get(id(marked), "?")
    what = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    raise PiperError(
        f"piper: {name!r} has no storage on this rank between steps (another pipeline stage holds it, or ZeRO-3, "
        f"expert or tensor parallelism keeps only shards of it), so {what} cannot read or write it; read full "
        "values with model.state_dict() or piper.trained_parameters(step) (every rank together), and run the "
        "model through the compiled step, not the original module")


class _Refusing:
    """What both marked classes do: metadata through, values refused (``__torch_function__``)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return _refuse(func, args, kwargs)

    def __repr__(self) -> str:
        t: Any = self
        return (f"{type(self).__name__}({_NAMES.get(id(self), '?')!r}, shape={tuple(t.shape)}, dtype={t.dtype}: "
                "no storage on this rank between steps)")

    def __format__(self, spec: str) -> str:
        return repr(self)


class ReleasedParameter(_Refusing, nn.Parameter):
    """A parameter piper released (no storage on this rank until the next step); see the module text."""


class ReleasedBuffer(_Refusing, torch.Tensor):
    """A buffer piper released (no storage on this rank until the next step)."""


_MARKED_AS = {nn.Parameter: ReleasedParameter, torch.Tensor: ReleasedBuffer}
_PLAIN = {ReleasedParameter: nn.Parameter, ReleasedBuffer: torch.Tensor}


def mark(named: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Mark every plain parameter or buffer of ``named`` (name -> tensor) that has elements and no storage;
    the tensors marked. Subclasses (a user's parameter class, DTensor) are left alone."""
    done = []
    for name, t in named.items():
        to = _MARKED_AS.get(type(t))
        if to is not None and t.untyped_storage().nbytes() == 0 and t.numel():
            t.__class__ = to
            _NAMES[id(t)] = name
            done.append(t)
    return done


def unmark(tensors: Iterable[torch.Tensor]) -> None:
    """Give marked tensors their plain class back (the others are left as they are)."""
    for t in tensors:
        plain = _PLAIN.get(type(t))
        if plain is not None:
            t.__class__ = plain


def unmarked(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its plain class back if it was marked."""
    unmark((t,))
    return t


def is_marked(t: Any) -> bool:
    return type(t) in _PLAIN
