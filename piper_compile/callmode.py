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
from typing import Any, Iterator

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


class _NoopBackward(torch.autograd.Function):
    """Lets ``loss.backward()`` on the returned loss run and do nothing (the step already did it)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        return None, None


_ANCHOR = torch.zeros((), requires_grad=True)


def trained_loss(loss: torch.Tensor) -> torch.Tensor:
    """What a training call returns: the loss, whose ``backward()`` is accepted and does nothing more."""
    return _NoopBackward.apply(loss, _ANCHOR)
