"""How every pass runs, whatever it transforms (Dynamo's FX graph, the joint graph's segment pieces,
the training DAG): by name, timed, dumped after it with ``PIPER_DEBUG=1``, skippable by name with
``PIPER_SKIP_PASSES`` (debugging only)."""
from __future__ import annotations

import sys
import time
from typing import Callable, TypeVar

from piper_compile.knobs import knob

T = TypeVar("T")


def skipped_passes() -> set[str]:
    """The pass names ``PIPER_SKIP_PASSES`` lists."""
    return set(filter(None, knob("PIPER_SKIP_PASSES").split(",")))


def run_pass(name: str, fn: Callable[[], T], timings: dict[str, float], what: str, dump: Callable[[T], str]) -> T:
    """``fn()``, its seconds added to ``timings[name]``; with ``PIPER_DEBUG`` then ``what`` (e.g. "DAG")
    printed to stderr as ``dump`` shows it."""
    t0 = time.perf_counter()
    out = fn()
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
    if knob("PIPER_DEBUG"):
        print(f"--- piper: {what} after {name} ({timings[name] * 1e3:.1f} ms): {dump(out)}", file=sys.stderr)
    return out
