"""Whether a call of a compiled step trains or only runs the forward.

``piper.compile``'s forward runs a ``torch.no_grad`` or ``torch.inference_mode`` call through the same
Dynamo version as a training call (grad mode on, inference mode off, inside :func:`forward_only`), so that
it plans on the training capture: the same joint graph, the same ZeRO layout, no second trace or capture.
A no-grad trace of nested compile regions exports no backward for the blocks, and an export under
inference mode none at all, so ZeRO-3's forward-only plan had no parameter gathers (released weights were
read) or disagreed with the training layout. ``torch.compile(model, backend="piper")`` keeps Dynamo's own
behaviour: a no-grad call is a version of its own, captured with gradients (``capture/joint.py``).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

_FORWARD_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("piper_forward_only", default=False)


@contextlib.contextmanager
def forward_only() -> Iterator[None]:
    """Run what is inside as a forward-only call, traced and captured as a training call would be."""
    token = _FORWARD_ONLY.set(True)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        _FORWARD_ONLY.reset(token)


def wants_forward_only() -> bool:
    """The caller asked for no gradients: ``torch.no_grad``, ``torch.inference_mode``."""
    return not torch.is_grad_enabled() or torch.is_inference_mode_enabled()


def training() -> bool:
    """This call of a compiled step trains (else it runs the forward-only plan)."""
    return torch.is_grad_enabled() and not _FORWARD_ONLY.get()
