"""Schedule builders. Each returns ``order`` directives, one per rank, in the JSON vocabulary.

A rank's schedule is a list of steps ``(pass, stage, microbatch)`` (pass F, B, BI or BW); the text
form ``F0.0 F0.1 B0.0 ...`` (pass, stage, micro-batch) is what tests and error messages show.
Every builder checks its arguments and raises ``PiperDirectiveError`` for counts it cannot schedule.
"""
from __future__ import annotations

from typing import Any, Sequence

from piper_compile.errors import PiperDirectiveError

Step = tuple[str, int, int]  # (pass, stage, microbatch)


def _fail(name: str, args: dict[str, Any], problem: str, fix: str) -> PiperDirectiveError:
    return PiperDirectiveError(None, {"schedule": name, **args}, problem, fix)


def _check(name: str, stages: int, microbatches: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise _fail(name, {"stages": stages}, f"stages must be an int >= 1, got {stages!r}",
                    "pass the number of pipeline stages")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise _fail(name, {"microbatches": microbatches}, f"microbatches must be an int >= 1, got {microbatches!r}",
                    "pass the split directive's micro-batch count")


# -- one stage per rank ----------------------------------------------------------------------------
def gpipe_sequence(stage: int, stages: int, microbatches: int) -> list[Step]:
    """All forwards, then all backwards (in micro-batch order)."""
    del stages
    return [("F", stage, m) for m in range(microbatches)] + [("B", stage, m) for m in range(microbatches)]


def one_f_one_b_sequence(stage: int, stages: int, microbatches: int) -> list[Step]:
    """Warm-up of ``stages - stage - 1`` forwards, then one forward / one backward, then cool-down."""
    warmup = min(stages - stage - 1, microbatches)
    seq: list[Step] = [("F", stage, m) for m in range(warmup)]
    for k in range(microbatches - warmup):
        seq += [("F", stage, warmup + k), ("B", stage, k)]
    seq += [("B", stage, m) for m in range(microbatches - warmup, microbatches)]
    return seq


def zb_h1_sequence(stage: int, stages: int, microbatches: int) -> list[Step]:
    """ZeroBubble H1: 1F1B with backward split into BI (input gradients, on the critical path) and BW
    (weight gradients), each stage delaying its BWs by ``stages - stage - 1`` micro-batches so they fill
    the cool-down bubble. Peak activation memory stays that of 1F1B."""
    lag = stages - stage - 1
    warmup = min(lag, microbatches)
    seq: list[Step] = [("F", stage, m) for m in range(warmup)]
    f, bi, w = warmup, 0, 0
    while bi < microbatches:
        if f < microbatches:
            seq.append(("F", stage, f))
            f += 1
        seq.append(("BI", stage, bi))
        bi += 1
        if bi - w > lag:
            seq.append(("BW", stage, w))
            w += 1
    seq += [("BW", stage, m) for m in range(w, microbatches)]
    return seq


# -- several stages per rank -----------------------------------------------------------------------
def interleaved_1f1b_sequences(ranks: int, virtual: int, microbatches: int) -> list[list[Step]]:
    """Interleaved 1F1B (Megatron): rank r holds stages r, r + p, ..., r + (v-1)p. Forwards walk the
    local stages in groups of p micro-batches, backwards walk them in reverse."""
    p, v, m = ranks, virtual, microbatches
    total = m * v

    def step(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    out = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        seq: list[Step] = []
        for k in range(warmup):
            c, mb = step(k, False)
            seq.append(("F", c * p + r, mb))
        for k in range(total - warmup):
            c, mb = step(warmup + k, False)
            seq.append(("F", c * p + r, mb))
            c, mb = step(k, True)
            seq.append(("B", c * p + r, mb))
        for k in range(total - warmup, total):
            c, mb = step(k, True)
            seq.append(("B", c * p + r, mb))
        out.append(seq)
    return out


def _directives(sequences: list[list[Step]], tag: str, mb_tag: str) -> list[dict[str, Any]]:
    return [{"op": "order", "filters": [[{tag: s, mb_tag: m, "PASS": p}] for p, s, m in seq]} for seq in sequences]


def gpipe(stages: int, microbatches: int, tag: str = "PP", mb_tag: str = "MB") -> list[dict[str, Any]]:
    """GPipe: every stage runs F of all micro-batches, then B of all micro-batches."""
    _check("gpipe", stages, microbatches)
    return _directives([gpipe_sequence(s, stages, microbatches) for s in range(stages)], tag, mb_tag)


def one_f_one_b(stages: int, microbatches: int, tag: str = "PP", mb_tag: str = "MB") -> list[dict[str, Any]]:
    """1F1B (PipeDream-flush): at most ``stages - stage`` micro-batches in flight on each stage."""
    _check("1f1b", stages, microbatches)
    return _directives([one_f_one_b_sequence(s, stages, microbatches) for s in range(stages)], tag, mb_tag)


def zb_h1(stages: int, microbatches: int, tag: str = "PP", mb_tag: str = "MB") -> list[dict[str, Any]]:
    """ZeroBubble H1 (one stage per rank, backward split into BI/BW)."""
    _check("zb_h1", stages, microbatches)
    return _directives([zb_h1_sequence(s, stages, microbatches) for s in range(stages)], tag, mb_tag)


def interleaved_1f1b(ranks: int, virtual_stages: int, microbatches: int, tag: str = "PP",
                     mb_tag: str = "MB") -> list[dict[str, Any]]:
    """Interleaved 1F1B over ``ranks * virtual_stages`` stages placed round-robin (stage s on rank
    s % ranks, see ``round_robin``). Needs ``microbatches`` to be a multiple of ``ranks``."""
    _check("interleaved_1f1b", ranks, microbatches)
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise _fail("interleaved_1f1b", {"virtual_stages": virtual_stages},
                    f"virtual_stages must be an int >= 1, got {virtual_stages!r}", "use 2 or more")
    if microbatches % ranks:
        raise _fail("interleaved_1f1b", {"ranks": ranks, "microbatches": microbatches},
                    f"interleaved 1F1B walks micro-batches in groups of {ranks} (one per rank), so "
                    f"{microbatches} micro-batches do not fit", f"use a multiple of {ranks} micro-batches")
    return _directives(interleaved_1f1b_sequences(ranks, virtual_stages, microbatches), tag, mb_tag)


def round_robin(ranks: int, virtual_stages: int, tag: str = "PP") -> list[dict[str, Any]]:
    """Place stage s on rank s % ranks (``ranks * virtual_stages`` stages)."""
    return [{"op": "place", "filter": {tag: s}, "devices": [s % ranks]} for s in range(ranks * virtual_stages)]


def v_shape(ranks: int, tag: str = "PP", groups: Sequence[Sequence[int]] | None = None) -> list[dict[str, Any]]:
    """Place stage s on rank s for s < ranks and on rank 2*ranks-1-s after (2 stages per rank, the V
    of ZBV and DualPipeV: rank 0 holds the first and the last stage). ``groups[r]``: the device group
    standing for pipeline rank r (data/expert-parallel replicas of the stages), default ``[r]``."""
    if groups is not None and len(groups) != ranks:
        raise _fail("v_shape", {"ranks": ranks, "groups": [list(g) for g in groups]},
                    f"{len(groups)} device groups given for {ranks} pipeline ranks", "give one group per rank")
    where = [list(groups[r]) if groups is not None else [r] for r in range(ranks)]
    return [{"op": "place", "filter": {tag: s}, "devices": where[s if s < ranks else 2 * ranks - 1 - s]}
            for s in range(2 * ranks)]


def stage_sequence(kind: str, stage: int, stages: int, microbatches: int) -> list[Step]:
    """One stage's steps for the one-stage-per-rank schedules (``gpipe``, ``1f1b``, ``zb_h1``)."""
    fn = {"gpipe": gpipe_sequence, "1f1b": one_f_one_b_sequence, "zb_h1": zb_h1_sequence}[kind]
    return fn(stage, stages, microbatches)
