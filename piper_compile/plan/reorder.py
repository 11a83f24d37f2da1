"""Which compute steps of a rank's program may run out of program order, and when -- decided when the
plan is built and recorded in it (``Instr.partner``, ``Instr.fillers``), so the verifier checks and the
executor runs exactly that.

Two mechanisms, both keeping every number bitwise equal to program order (two accumulations into the
same gradient, or two into the loss, are never swapped):

* overlap partners: the two halves of an overlap slot (DualPipeV/ZBV pairs an F with a B). On CUDA the
  partner runs on a second stream (with gloo's host-blocking waits, ranks sharing a GPU, only once its
  input has arrived); elsewhere it runs first when its predecessor's input is late.
  Shown as ``F0.mb3|B1.mb2`` in a program's text.
* fillers: where a wait blocks the host (gloo on CPU), a compute step whose input is still in flight
  lets later independent *sink* steps run first -- steps whose results nothing else reads, only
  accumulated into gradients or the loss (a zero-bubble schedule's deferred weight-gradient steps) --
  nearest first, up to ``window`` compute steps ahead, each only once the communication it needs has
  completed. A filler that reads what the partner produces, or adds into what a nearer filler adds
  into, is recorded with that step (``fill[BW.PP1.mb0 after BI.PP1.mb0]``) and runs only after it. A step that feeds others (a forward, an input gradient) stays in place: run early, it
  would delay the waiting step, whose output a neighbour stage is waiting for, and keep its own
  activations alive longer.

``reorder_problem`` is the one statement of what makes such a reordering safe: the planner records
only reorderings it accepts, and the verifier rejects a program whose recorded reordering it refuses
(e.g. one that would wait for communication issued after the step it jumps: a deadlock).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Container

from piper_compile.errors import PiperPlanError
from piper_compile.ir.dag import Kind
from piper_compile.ir.ops import LOSS

if TYPE_CHECKING:
    from piper_compile.plan.program import Instr, Program


def accumulates(ins: "Instr") -> frozenset[str]:
    """Gradients (by parameter name) and the loss this instruction adds into."""
    return ins.node.op.accumulates()


def needs(program: "Program") -> dict[int, tuple[str, ...]]:
    """compute position -> the communication that must be complete before it runs: its own waits and
    every asynchronous producer of its inputs (an earlier consumer may hold the wait in program order,
    so a step run ahead of that consumer must wait itself)."""
    source = {v: ins.name for ins in program.instrs if ins.is_async for v in ins.node.outputs}
    return {k: tuple(dict.fromkeys([*ins.waits, *(source[v] for v in ins.node.inputs if v in source)]))
            for k, ins in enumerate(program.instrs) if ins.node.kind is Kind.COMPUTE}


def still_read(program: "Program", pos: int, k: int, done: Container[int]) -> set[str]:
    """Values read by the instructions from ``pos`` up to (not including) ``k`` that have not run: once
    step ``k`` has run ahead of them, its last-use values outside this set can be freed at once."""
    return {v for m in range(pos, k) if m not in done for v in program.instrs[m].node.inputs}


def reorder_problem(program: "Program", pos: int, k: int, need: dict[int, tuple[str, ...]],
                    how: str, ran: Container[int] = (), at: dict[str, int] | None = None) -> str | None:
    """Why compute step ``k`` may not run before instruction ``pos`` as its overlap partner (``how`` =
    "partner") or as a filler ("filler") once the steps at positions ``ran`` (between them) have run
    early; None when it may. Both: ``k`` is a later compute step, reads nothing produced from ``pos`` up
    to it by a step that has not run, and needs only communication issued before ``pos`` (else it would
    wait for something this rank has not issued yet: a deadlock). A partner and ``pos`` do not both add
    into gradients or both into the loss; a filler adds into nothing the steps it jumps add into, and
    jumps only instructions whose op allows it (``jumpable``). ``at``: ``program.positions()``, if the
    caller has it already."""
    instrs = program.instrs
    if not pos < k < len(instrs) or k not in need:
        return f"{_at(program, k)} is not a compute step after {_at(program, pos)}"
    at = program.positions() if at is None else at
    late = [w for w in need[k] if at.get(w, len(instrs)) >= pos]
    if late:
        return (f"{_at(program, k)} needs {late[0]}, which rank {program.rank} issues only at or after "
                f"{_at(program, pos)}: run there, it would wait forever (deadlock)")
    between = [instrs[m] for m in range(pos, k) if m not in ran]
    clash = {v for i in between for v in i.node.outputs} & set(instrs[k].node.inputs)
    if clash:
        return f"{_at(program, k)} reads {sorted(clash)[0]}, produced after {_at(program, pos)}"
    mine = accumulates(instrs[k])
    if how == "partner":
        theirs = accumulates(instrs[pos])
        if (mine - {LOSS} and theirs - {LOSS}) or (LOSS in mine and LOSS in theirs):
            return f"{_at(program, k)} and {_at(program, pos)} both add into gradients or both into the loss"
        return None
    if mine & set().union(*(accumulates(i) for i in between)):
        return f"{_at(program, k)} adds into a gradient a step it would jump adds into (numerics would change)"
    fixed = next((i for i in between[1:] if i.node.kind is not Kind.COMPUTE and not i.node.op.jumpable), None)
    if fixed is not None:
        return f"{_at(program, k)} would jump {fixed.short()}, which keeps its place relative to every compute"
    return None


def _at(program: "Program", k: int) -> str:
    return f"{program.instrs[k].short()} (position {k})" if 0 <= k < len(program.instrs) else f"position {k}"


def _partners(program: "Program", need: dict[int, tuple[str, ...]]) -> dict[int, int]:
    """compute position -> the next compute step, where that one may run first if this one's input is
    late (this one waits for communication, and ``reorder_problem`` accepts the pair)."""
    computes, at = list(need), program.positions()
    return {a: b for a, b in zip(computes, computes[1:])
            if program.instrs[a].waits and reorder_problem(program, a, b, need, "partner", at=at) is None}


Filler = tuple[int, tuple[int, ...]]  # (position, positions of the reordered steps it needs to have run first)


def _fillers(program: "Program", window: int, need: dict[int, tuple[str, ...]],
             partners: dict[int, int]) -> dict[int, tuple[Filler, ...]]:
    """compute position with waits -> the sink steps among the next ``window`` compute steps (its
    partner not counted) that may run while it waits, nearest first; each with the partner or nearer
    fillers that must have run before it (e.g. a weight-gradient step adding into the weights a nearer
    one adds into: order kept)."""
    instrs = program.instrs
    read = {v for ins in instrs for v in ins.node.inputs}
    sinks = {k for k in need if accumulates(instrs[k]) and not set(instrs[k].node.outputs) & read}
    computes, at = list(need), program.positions()
    out: dict[int, tuple[Filler, ...]] = {}
    for idx, pos in enumerate(computes):
        if not instrs[pos].waits or not window:
            continue
        ahead = [k for k in computes[idx + 1:] if k != partners.get(pos)][:window]
        early = [partners[pos]] if pos in partners else []
        found: list[Filler] = []
        for k in (k for k in ahead if k in sinks):
            first = tuple(m for m in early if m < k and _conflict(instrs[m], instrs[k]))
            if reorder_problem(program, pos, k, need, "filler", first, at) is None:
                found.append((k, first))
                early.append(k)
        if found:
            out[pos] = tuple(found)
    return out


def _conflict(m: "Instr", k: "Instr") -> bool:
    """Whether ``k`` reads what ``m`` produces or adds into something ``m`` adds into."""
    return bool(set(m.node.outputs) & set(k.node.inputs) or accumulates(m) & accumulates(k))


def record_reorders(program: "Program", window: int) -> "Program":
    """``program`` with its overlap partners and fillers (``window`` compute steps ahead at most)
    recorded on the instructions they may run before."""
    need = needs(program)
    partners = _partners(program, need)
    fillers = _fillers(program, window, need, partners)
    names = [ins.name for ins in program.instrs]
    program.instrs = [dataclasses.replace(ins, partner=names[partners[k]] if k in partners else None,
                                          fillers=tuple((names[j], tuple(names[m] for m in first))
                                                        for j, first in fillers.get(k, ())))
                      for k, ins in enumerate(program.instrs)]
    return program


def check_reorders(program: "Program") -> None:
    """Raise ``PiperPlanError`` if a recorded partner or filler is one ``reorder_problem`` refuses."""
    need = needs(program)
    at = program.positions()
    for pos, ins in enumerate(program.instrs):
        recorded = [(ins.partner, "partner", ())] if ins.partner else []
        recorded += [(f, "filler", first) for f, first in ins.fillers]
        for name, how, first in recorded:
            why = reorder_problem(program, pos, at.get(name, -1), need, how, {at.get(m, -1) for m in first}, at)
            if why is not None:
                role = "an overlap partner" if how == "partner" else "a filler"
                raise PiperPlanError(f"piper: rank {program.rank}'s program records {name} as {role} of "
                                     f"{ins.short()} (position {pos}), but {why}")
