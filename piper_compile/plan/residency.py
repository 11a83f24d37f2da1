"""What a rank's program reads of the model's state, and so what the rank may give back.

A pipeline rank keeps only the parameters and buffers its own programs read: other stages' weights and
buffers give their memory back after the first training plan (``TrainState.shard``), and a model built
on the meta device never allocates them. A parameter or buffer no rank reads or trains keeps its memory:
nobody else holds it to fetch it from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from piper_compile.errors import PiperError
from piper_compile.ir.dag import BUFFER_PREFIX, Kind, TrainingDAG, param_fqn
from piper_compile.ir.ops import ParamGather
from piper_compile.plan.program import Program


@dataclass(frozen=True, slots=True)
class Reads:
    """The parameters (FQNs) a program reads, gathers (ZeRO-3) or updates, and the buffers it reads."""

    params: frozenset[str] = frozenset()
    buffers: frozenset[str] = frozenset()


def buffer_fqn(value: str) -> str | None:
    """The buffer FQN a value names (``buffer:fqn``, per micro-batch ``buffer:fqn@mbN``); None otherwise."""
    if not value.startswith(BUFFER_PREFIX):
        return None
    return value[len(BUFFER_PREFIX):].split("@mb", 1)[0]


def reads_of(program: Program) -> Reads:
    """What ``program`` needs resident on its rank."""
    params = {f for i in program.instrs for f in map(param_fqn, i.node.inputs) if f is not None}
    upd = program.update_node()
    params |= set(upd.op.params) if upd is not None else set()  # type: ignore[attr-defined]
    params |= {f for i in program.instrs if isinstance(i.node.op, ParamGather) for f in i.node.op.params}
    buffers = {f for i in program.instrs for f in map(buffer_fqn, i.node.inputs) if f is not None}
    return Reads(frozenset(params), frozenset(buffers))


def unread(dag: TrainingDAG, programs: Iterable[Program], program: Program, buffers: Iterable[str]) -> Reads:
    """What ``program``'s rank may give back: trained parameters that none of its instructions reads or
    updates (other pipeline stages' weights, with or without ZeRO, data / tensor / expert parallel inside
    the stages alike), and those of the model's ``buffers`` that another rank's program reads and this
    one's does not. Frozen parameters and buffers nobody reads are kept."""
    trained = {f for n in dag.of_kind(Kind.UPDATE) for f in n.op.params}  # type: ignore[attr-defined]
    mine = reads_of(program)
    held = buffer_holders(programs, buffers)
    return Reads(frozenset(trained - mine.params), frozenset(held) - mine.buffers)


def buffer_holders(programs: Iterable[Program], buffers: Iterable[str]) -> dict[str, list[int]]:
    """Buffer FQN (of ``buffers``) -> the ranks whose program reads it, for the buffers some program
    reads (every rank of the world computes the same map; nothing to walk for a model without buffers)."""
    names = set(buffers)
    out: dict[str, list[int]] = {}
    if not names:
        return out
    for p in programs:
        for f in sorted(reads_of(p).buffers & names):
            out.setdefault(f, []).append(p.rank)
    return out


def check_resident(reads: Reads, state: Any, rank: int, what: str) -> None:
    """Raise if ``what`` (a program of this rank) reads a parameter or buffer this rank released (another
    pipeline stage's, given back after the training plan): it would compute with a tensor that has no
    storage. A released expert / tensor-parallel weight is fine: programs read this rank's piece."""
    missing = sorted((reads.params & state.released) - set(state.shards))
    missing += sorted(reads.buffers & state.released_buffers)
    if missing:
        more = f", ... ({len(missing)} in all)" if len(missing) > 4 else ""
        raise PiperError(
            f"piper: rank {rank}'s {what} reads {', '.join(missing[:4])}{more}, which this rank released after "
            "planning training (its training program does not read them: they belong to another pipeline stage "
            "there). The programs of one model must place every stage alike: compile the training and "
            "forward-only calls with the same directives (piper.full_state_dict(step) still returns every weight)")
