"""Dynamo compiling the piper step again: which guard failed (said once, in the user's terms) and whether
the new graph is the old one (``piper_backend`` then reuses the existing step)."""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Iterator

import torch
from torch import fx


def graph_key(gm: fx.GraphModule, example_inputs: list[Any], options: Any) -> tuple[Any, ...]:
    """What makes two backend calls the same step: the options dict, the graph's code, the inputs' types."""
    def sig(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return (type(t).__name__, t.dtype, tuple(map(str, t.shape)), tuple(map(str, t.stride())), t.device.type,
                    t.requires_grad)
        return (type(t).__name__, str(t))

    from piper_compile.capture.subgraphs import graph_code

    return (id(options), graph_code(gm), tuple(sig(t) for t in example_inputs), torch.is_grad_enabled())


_GRAD_MODES: dict[tuple[Any, ...], set[bool]] = {}  # Dynamo frame -> grad modes it has a version for
_FAILED: contextvars.ContextVar[str | None] = contextvars.ContextVar("piper_failed_guard", default=None)


@contextlib.contextmanager
def after_failed_guard(guard: str) -> Iterator[None]:
    """A call that Dynamo's own path compiles because ``guard`` of piper's own traced forward failed
    (``capture/forward_route.py``): for Dynamo it is a first compile, for the user a recompile."""
    token = _FAILED.set(guard)
    try:
        yield
    finally:
        _FAILED.reset(token)


def recompile_reason() -> str | None:
    """When Dynamo compiles this frame again: the guard that failed, said once on stderr (a switch between
    training and ``torch.no_grad`` calls is expected and not reported). Read from Dynamo's metrics context
    (private: None where this torch has no such record)."""
    try:
        from torch._dynamo.utils import get_metrics_context

        metrics = get_metrics_context()._metrics  # noqa: SLF001
        reason = metrics.get("recompile_reason")
        frame = (metrics.get("co_filename"), metrics.get("co_firstlineno"), metrics.get("co_name"))
    except Exception:  # noqa: BLE001 - another torch version: no report
        return None
    grad = torch.is_grad_enabled()
    if not reason:  # the frame's first version (since a torch._dynamo.reset())
        _GRAD_MODES[frame] = {grad}
        return _FAILED.get()
    seen = _GRAD_MODES.setdefault(frame, set())
    if grad not in seen:  # the first training or the first torch.no_grad version: expected
        seen.add(grad)
        return None
    return reason


_LAST: list[str] = []  # the guard the latest recompile named (for the error at Dynamo's recompile limit)


def last_guard() -> str | None:
    """The guard the latest recompile of a piper step named, in the user's terms; None before any."""
    return _LAST[-1] if _LAST else None


def say_recompile(reason: str, reused: bool) -> None:
    """The one line a recompile prints: the guard that failed, and what piper does about it."""
    grad_mode = "grad_mode" in reason  # Dynamo names the first failing guard of its newest version only
    what = ("a guard failed (TORCH_LOGS=recompiles names it)" if grad_mode else
            f"a guard failed: {' '.join(reason.split(chr(10))[0].split())}")
    _LAST[:] = [what]
    then = ("Dynamo traced the same graph again, so piper reuses its capture, plan and compiled segments (only "
            "Dynamo's trace was repeated)" if reused else
            "piper captures, plans and compiles the new version at its next call")
    warnings.warn(f"piper: Dynamo compiles the piper step again: {what}; {then} (see piper.stats(step).recompiles); "
                  "keep that attribute or input fixed to avoid it", stacklevel=3)
