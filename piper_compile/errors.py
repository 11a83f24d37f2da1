"""Error types. Every message starts with ``piper:`` and says what is wrong and how to fix it."""
from __future__ import annotations

import json
from typing import Any


def some(names: list[str], n: int = 4) -> str:
    """The first ``n`` of ``names`` for a message, and how many more there are."""
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


class PiperError(RuntimeError):
    """Base class of every error piper raises on purpose."""

    def __init__(self, message: str) -> None:
        if not message.startswith("piper:"):
            message = "piper: " + message
        super().__init__(message)


class PiperDirectiveError(PiperError, ValueError):
    """A directive is malformed or cannot be applied to the captured model."""

    def __init__(self, index: int | None, directive: Any, problem: str, fix: str) -> None:
        where = "directive" if index is None else f"directive #{index}"
        try:
            text = json.dumps(directive, default=str, sort_keys=True)
        except (TypeError, ValueError):
            text = repr(directive)
        self.index = index
        self.directive = directive
        super().__init__(f"piper: {where} {text}: {problem.rstrip('.')}. Fix: {fix}")


class PiperCaptureError(PiperError):
    """The model could not be captured as one joint forward+backward graph."""


class PiperPlanError(PiperError):
    """The per-rank programs deadlock or do not match (found by the verifier before running)."""


class PiperRuntimeError(PiperError):
    """A step failed while running (timeout, peer failure)."""
