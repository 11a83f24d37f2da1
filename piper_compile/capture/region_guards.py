"""Guards on every block Dynamo stamps out of a nested compile region, not only on the first.

Dynamo traces a nested compile region's body at its first call and, at each later call, re-evaluates
that trace's guards against the new call's sources (``blocks[3].ln.eps`` for ``blocks[0].ln.eps``) to
decide whether the body can be reused (``torch/_dynamo/variables/invoke_subgraph.is_reusable``). torch
2.13 then stamps the body out without installing those re-evaluated guards: only the first block's are
checked when the compiled step is called again. An attribute of a later block changed between steps (a
residual ``scale``, a dropout ``p``, a layer norm's ``eps``) was silently ignored -- the step kept
computing with the old value, where a flat trace recompiles.

:func:`install` wraps Dynamo's reuse check so that the call it accepts installs each of the body's
guards on the call's own sources, as a flat trace would have installed them: the changed attribute
fails its guard and the step compiles again (with piper's one-line recompile message). Where torch's
reuse machinery is not the one this was written against, :func:`install` returns False and piper does
not mark blocks (``capture/blocks.wanted``): every block is traced, which is always right.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

_PARAMETERS = ["tx", "condition", "fingerprint", "cached_entry"]


def install() -> bool:
    """Make Dynamo install the guards of each stamped-out region call (done once: the wrapper marks itself);
    whether it does (False: torch's reuse check is not the one known here)."""
    try:
        from torch._dynamo.guards import install_guard
        from torch._dynamo.variables import invoke_subgraph as reuse
        original = reuse.is_reusable
        replacement_of = reuse.build_source_replacement
    except (ImportError, AttributeError):
        return False
    if getattr(original, "_piper_guards", False):
        return True
    if list(inspect.signature(original).parameters) != _PARAMETERS:
        return False

    @functools.wraps(original)
    def is_reusable(tx: Any, condition: Any, fingerprint: Any, cached_entry: Any) -> bool:
        reusable = original(tx, condition, fingerprint, cached_entry)
        if reusable:
            replaced = replacement_of(cached_entry.arg_sources, fingerprint.arg_sources)
            _install_moved(condition.guards, replaced, install_guard)
        return reusable

    is_reusable._piper_guards = True  # type: ignore[attr-defined]
    reuse.is_reusable = is_reusable
    return True


def _install_moved(guards: list[tuple[Any, Any, Any, Any]], replaced: dict[Any, Any],
                   install_guard: Callable[..., None]) -> None:
    """Install each of the body's ``guards`` on the sources of the call it is stamped out for."""
    if not replaced:
        return  # the same sources: the first trace's guards are this call's
    for source, _handler, _expected, guard in guards:
        moved = source.clone(lambda s: replaced.get(s, s))
        if moved != source:
            install_guard(moved.make_guard(guard.create_fn))
