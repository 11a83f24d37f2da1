"""GPipe and 1F1B for any number of stages and micro-batches.

A stage's sequence is a list of ``(pass, microbatch)`` steps; ``order`` directives chain them on the
stage's device group. The text form ``F0 F1 B0 ...`` is what tests and error messages show.
"""
from __future__ import annotations

from typing import Any

from piper_compile.errors import PiperDirectiveError

Step = tuple[str, int]


def _check(name: str, stages: int, microbatches: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise PiperDirectiveError(None, {"schedule": name, "stages": stages}, f"stages must be an int >= 1, got {stages!r}",
                                  "pass the number of pipeline stages")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PiperDirectiveError(None, {"schedule": name, "microbatches": microbatches},
                                  f"microbatches must be an int >= 1, got {microbatches!r}",
                                  "pass the split directive's micro-batch count")


def gpipe_sequence(stage: int, stages: int, microbatches: int) -> list[Step]:
    """All forwards, then all backwards (in micro-batch order)."""
    del stage, stages
    return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]


def one_f_one_b_sequence(stage: int, stages: int, microbatches: int) -> list[Step]:
    """Warm-up of ``stages - stage - 1`` forwards, then one forward / one backward, then cool-down."""
    warmup = min(stages - stage - 1, microbatches)
    seq: list[Step] = [("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < microbatches:
        seq += [("F", f), ("B", b)]
        f += 1
        b += 1
    seq += [("B", m) for m in range(b, microbatches)]
    return seq


def stage_sequence(kind: str, stage: int, stages: int, microbatches: int) -> list[Step]:
    return {"gpipe": gpipe_sequence, "1f1b": one_f_one_b_sequence}[kind](stage, stages, microbatches)


def _orders(kind: str, stages: int, microbatches: int, tag: str, mb_tag: str) -> list[dict[str, Any]]:
    _check(kind, stages, microbatches)
    out = []
    for s in range(stages):
        seq = stage_sequence(kind, s, stages, microbatches)
        out.append({"op": "order", "filters": [[{tag: s, mb_tag: m, "PASS": p}] for p, m in seq]})
    return out


def gpipe(stages: int, microbatches: int, tag: str = "PP", mb_tag: str = "MB") -> list[dict[str, Any]]:
    """GPipe: every stage runs F of all micro-batches, then B of all micro-batches."""
    return _orders("gpipe", stages, microbatches, tag, mb_tag)


def one_f_one_b(stages: int, microbatches: int, tag: str = "PP", mb_tag: str = "MB") -> list[dict[str, Any]]:
    """1F1B (PipeDream-flush): bounded in-flight micro-batches per stage (at most ``stages - stage``)."""
    return _orders("1f1b", stages, microbatches, tag, mb_tag)
