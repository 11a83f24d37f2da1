"""Dynamo compiling the piper step again: which guard failed (said once, in the user's terms) and whether
the new graph is the old one (``piper_backend`` then reuses the existing step)."""
from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
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


# model -> Dynamo frame (its code object) -> the grad modes it has a version for (weak: a dropped model takes
# its entries along); frames compiled for no model in _UNOWNED
_GRAD_MODES: "weakref.WeakKeyDictionary[Any, dict[Any, set[bool]]]" = weakref.WeakKeyDictionary()
_UNOWNED: dict[Any, set[bool]] = {}
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


def compiling_version(options: Any = None) -> tuple[Any, str | None]:
    """The version of the frame Dynamo is compiling for piper (``capture/frame_versions.Version``, None
    where unknown) and, when it is a recompile, its reason (:func:`recompile_reason`; a version for a
    ``torch.compile`` with other ``options`` than every earlier one is none). A model past its versions is
    refused with the recompile-limit error: Dynamo would run its forward eagerly."""
    from piper_compile.capture.frame_versions import another_compile, count_version
    from piper_compile.errors import PiperCaptureError

    version = count_version()
    code = version and version.code
    first = version is not None and (version.first or another_compile(code, options))
    reason = recompile_reason(first, version and version.owner, code)
    if version is not None and version.over_limit:
        raise PiperCaptureError(limit_message(version.limit, reason and guard_text(reason)))
    return version, reason


def recompile_reason(first: bool = False, owner: object = None, code: Any = None) -> str | None:
    """When Dynamo compiles this frame again: the guard that failed, said once on stderr (a switch between
    training and ``torch.no_grad`` calls is expected and not reported, and so is the other mode's version
    after a reported one: one change, said once). Read from Dynamo's metrics context
    (private: None where this torch has no such record). ``first``: the first version of the frame for
    ``owner``, the model it is compiled for (``capture/frame_versions.py``): Dynamo's reason then names
    another model's version, and this one is no recompile. ``code``: the frame's code object (else the
    frame Dynamo's metrics name)."""
    try:
        from torch._dynamo.utils import get_metrics_context

        metrics = get_metrics_context()._metrics  # noqa: SLF001
        reason = metrics.get("recompile_reason")
        frame = code or (metrics.get("co_filename"), metrics.get("co_firstlineno"), metrics.get("co_name"))
    except Exception:  # noqa: BLE001 - another torch version: no report
        return None
    grad = torch.is_grad_enabled()
    modes = _UNOWNED if owner is None else _GRAD_MODES.setdefault(owner, {})
    if not reason or first:  # the frame's first version (since a torch._dynamo.reset()) for this model
        modes[frame] = {grad}
        return _FAILED.get()
    seen = modes.setdefault(frame, set())
    if grad not in seen:  # the first training or the first torch.no_grad version: expected
        seen.add(grad)
        return None
    modes[frame] = {grad}  # the other mode's version of this change is its first there: said once, here
    return _named(reason, code)


def _named(reason: str, code: Any) -> str:
    """``reason``, or where it names only the grad mode (Dynamo names the first version it checked, which
    may be the other mode's), the guard another version of the frame fails on (the attribute that changed)."""
    if "grad_mode" not in reason:
        return reason
    from piper_compile.capture.frame_versions import failed_guards

    return next((r for r in failed_guards(code) if "grad_mode" not in r), reason)


def ran_on_version(owner: Any, code: Any) -> None:
    """``owner`` (a model) runs on the version of frame ``code`` Dynamo compiled for another model, in the
    current grad mode: the next version Dynamo compiles for it is a recompile, and is said as one (nothing
    is noted where the frame is unknown: ``code`` None)."""
    from piper_compile.capture.frame_versions import note_ran

    if code is None:
        return
    note_ran(owner, code)
    _GRAD_MODES.setdefault(owner, {}).setdefault(code, set()).add(torch.is_grad_enabled())


_LAST: list[str] = []  # the guard the latest recompile named (for the error at Dynamo's recompile limit)


def last_guard() -> str | None:
    """The guard the latest recompile of a piper step named, in the user's terms; None before any."""
    return _LAST[-1] if _LAST else None


def limit_message(limit: int | None = None, last: str | None = None) -> str:
    """The error at Dynamo's recompile limit (``limit``: the user's, the config's by default), naming the
    guard that failed last (``last``; the latest recompile's by default)."""
    limit = limit if limit is not None else torch._dynamo.config.recompile_limit
    last = last if last is not None else last_guard()
    return (f"piper: Dynamo has compiled this model's step {limit} times (torch._dynamo.config.recompile_limit) "
            "and refuses another version: something its guards check changed between calls"
            f"{f' (the latest: {last})' if last else ''}. Keep the model's attributes and the non-tensor "
            "arguments fixed between steps; pass a value that changes every step as an argument of forward (a "
            "tensor, or a Python float, which stays an input); or raise the limit where the versions are few "
            "and meant.")


def guard_text(reason: str) -> str:
    """Dynamo's recompile reason in one line: the guard that failed."""
    if "grad_mode" in reason:  # Dynamo names the first failing guard of its newest version only
        return "a guard failed (TORCH_LOGS=recompiles names it)"
    return f"a guard failed: {' '.join(reason.split(chr(10))[0].split())}"


def say_recompile(reason: str, reused: bool) -> None:
    """The one line a recompile prints: the guard that failed, and what piper does about it."""
    what = guard_text(reason)
    _LAST[:] = [what]
    then = ("Dynamo traced the same graph again, so piper reuses its capture, plan and compiled segments (only "
            "Dynamo's trace was repeated)" if reused else
            "piper captures, plans and compiles the new version at its next call")
    warnings.warn(f"piper: Dynamo compiles the piper step again: {what}; {then} (see piper.stats(step).recompiles); "
                  "keep that attribute or input fixed to avoid it", stacklevel=3)
