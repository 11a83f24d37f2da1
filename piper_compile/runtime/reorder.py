"""Which compute steps of a rank's program the runtime may run out of program order, and when.

Two mechanisms, both keeping every number bitwise equal to program order (two accumulations into the
same gradient, or two into the loss, are never swapped):

* ``overlap_partners``: the two halves of an overlap slot (DualPipeV/ZBV pairs an F with a B). On CUDA
  the partner always runs on a second stream; elsewhere it runs first when its predecessor's input is
  late.
* ``Fillers``: where a wait blocks the host (gloo on CPU), a compute step whose input is still in flight
  lets later independent *sink* steps run first -- steps whose results nothing else reads, only
  accumulated into gradients or the loss (a zero-bubble schedule's deferred weight-gradient steps) --
  nearest first, up to ``window`` compute steps ahead. A step that feeds others (a forward, an input
  gradient) stays in place: run early, it would delay the waiting step, whose output a neighbour stage
  is waiting for, and keep its own activations alive longer.
"""
from __future__ import annotations

from typing import Container, Iterator

from piper_compile.ir.dag import Kind
from piper_compile.ir.ops import LOSS
from piper_compile.plan.program import Instr, Program



def accumulates(ins: Instr) -> frozenset[str]:
    """Gradients (by parameter name) and the loss this instruction adds into."""
    return ins.node.op.accumulates()


def needs(program: Program) -> dict[int, tuple[str, ...]]:
    """compute position -> the communication that must be complete before it runs: its own waits and
    every asynchronous producer of its inputs (an earlier consumer may hold the wait in program order,
    so a step run ahead of that consumer must wait itself)."""
    source = {v: ins.name for ins in program.instrs if ins.is_async for v in ins.node.outputs}
    return {k: tuple(dict.fromkeys([*ins.waits, *(source[v] for v in ins.node.inputs if v in source)]))
            for k, ins in enumerate(program.instrs) if ins.node.kind is Kind.COMPUTE}


def still_read(program: Program, pos: int, k: int, done: Container[int]) -> set[str]:
    """Values read by the instructions from ``pos`` up to (not including) ``k`` that have not run: once
    step ``k`` has run ahead of them, its last-use values outside this set can be freed at once."""
    return {v for m in range(pos, k) if m not in done for v in program.instrs[m].node.inputs}


def overlap_partners(program: Program, need: dict[int, tuple[str, ...]] | None = None) -> dict[int, int]:
    """compute position -> the next compute step, where the runtime may run that one first if this one's
    input has not arrived: nothing it reads comes from this step or the instructions between them,
    the communication it needs (``needs``) is issued before this step, and at most one of the two
    accumulates gradients or the loss (so accumulation order, and with it every number, stays the same)."""
    instrs = program.instrs
    need = needs(program) if need is None else need
    computes = [k for k, i in enumerate(instrs) if i.node.kind is Kind.COMPUTE]
    out: dict[int, int] = {}
    for a, b in zip(computes, computes[1:]):
        i, j = instrs[a].node, instrs[b].node
        produced = {v for k in range(a, b) for v in instrs[k].node.outputs}
        issued = {instrs[k].name for k in range(a)}
        if produced & set(j.inputs) or not set(need[b]) <= issued:
            continue
        ai, aj = i.op.accumulates(), j.op.accumulates()
        if (ai - {LOSS} and aj - {LOSS}) or (LOSS in ai and LOSS in aj):
            continue
        if not instrs[a].waits:
            continue
        out[a] = b
    return out


def _jumpable(ins: Instr) -> bool:
    """Whether a filler may run before this (not yet issued) instruction: compute, activation sends and
    receives, expert all-to-alls and ZeRO-3 per-use gathers only. Gradient-state traffic, gradient
    reductions, tensor-parallel collectives and the update keep their place relative to every compute."""
    return bool(ins.node.op.jumpable)  # the op's rule


class Fillers:
    """Static facts the runtime needs to pick a filler quickly: per instruction what it produces and adds
    into and whether a filler may pass it; the sink steps; what each needs complete (``needs``)."""

    def __init__(self, program: Program, window: int, need: dict[int, tuple[str, ...]]) -> None:
        self.window = window
        self.need = need
        instrs = program.instrs
        self.pos_of = {ins.name: k for k, ins in enumerate(instrs)}
        self.outs = [frozenset(ins.node.outputs) for ins in instrs]
        self.acc = [accumulates(ins) for ins in instrs]
        self.jumpable = [_jumpable(ins) for ins in instrs]
        read = {v for ins in instrs for v in ins.node.inputs}
        self.sinks = {k: frozenset(instrs[k].node.inputs) for k in need
                      if self.acc[k] and not self.outs[k] & read}  # sink position -> what it reads

    def candidates(self, pos: int, done: Container[int]) -> Iterator[int]:
        """Sink steps after ``pos`` that may run before it, nearest first: each reads nothing produced
        by ``pos`` or any not-yet-run instruction before it, adds into nothing they add into, needs only
        communication issued before ``pos``, and is reached without passing an instruction that must
        keep its place. ``done``: positions already run early. The caller still checks that the needed
        communication has completed."""
        produced: set[str] = set()
        accs: set[str] = set()
        seen = 0
        for k in range(pos, len(self.outs)):
            if k in done:
                continue
            if k > pos:
                if k not in self.need and not self.jumpable[k]:
                    return
                if k in self.need:  # a compute step
                    reads = self.sinks.get(k)
                    if (reads is not None and not reads & produced and not self.acc[k] & accs
                            and all(self.pos_of[w] < pos for w in self.need[k])):
                        yield k
                    seen += 1
                    if seen >= self.window:
                        return
            produced |= self.outs[k]
            accs |= self.acc[k]
