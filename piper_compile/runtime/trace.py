"""Opt-in recorder of real steps (``PIPER_TRACE=dir``): the executor calls it around every
instruction; after each step it writes ``dir/rank{r}.json`` (the last step wins; forward-only steps
write ``rank{r}.fwd.json``) in the trace format of ``piper_compile.sim.trace``.

A compute span runs from the end of the instruction's waits to the end of its bookkeeping (frees
included). An asynchronous span runs from its issue to its completion: the first of a completion
callback (collectives whose work has a future) and the end of the wait that consumes it (P2P on gloo
has no future, so completion is *as observed at the wait*; the time the wait blocked is recorded as
``blocked_s``). Times come from ``time.perf_counter`` (CLOCK_MONOTONIC: comparable between processes
on one host). On CUDA compute spans are host issue times (no device synchronisation is added).

Files are written by one background thread fed through a queue, so a step only pays for handing its
records over; ``flush_traces()`` waits until they are written (it also runs at interpreter exit).
Without ``PIPER_TRACE`` the executor gets a ``NullRecorder`` whose methods do nothing.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from piper_compile.plan.program import Instr, Program
from piper_compile.knobs import knob


_Record = tuple[int, Instr, float, float, float]  # position, instruction, start, host end, wait before it


_QUEUE: "queue.Queue[tuple[Recorder, tuple[Any, ...]]]" = queue.Queue()
_WRITER: list[threading.Thread] = []


def _writer_loop() -> None:
    while True:
        rec, record = _QUEUE.get()
        try:
            rec._write(*record)
        finally:
            _QUEUE.task_done()


def _submit(rec: "Recorder", record: tuple[Any, ...]) -> None:
    if not _WRITER:
        _WRITER.append(threading.Thread(target=_writer_loop, name="piper-trace-writer", daemon=True))
        _WRITER[0].start()
        atexit.register(flush_traces)
    _QUEUE.put((rec, record))


def flush_traces() -> None:
    """Wait until every trace file this process has recorded is written."""
    _QUEUE.join()


class NullRecorder:
    """The recorder used when tracing is off: every hook is an empty method."""

    enabled = False

    def now(self) -> float:
        return 0.0

    def step_begin(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def end(self, pos: int, ins: Instr, pending: Any) -> None:
        pass

    def complete(self, name: str, wait_start: float) -> None:
        pass

    def step_end(self) -> None:
        pass


class Recorder(NullRecorder):
    """Records one rank's instruction spans for the current step and writes them at its end."""

    enabled = True

    def __init__(self, program: Program, directory: str | os.PathLike[str], forward_only: bool = False) -> None:
        self.program = program
        self.rank = program.rank
        suffix = ".fwd" if forward_only else ""
        self.path = Path(directory) / f"rank{self.rank}{suffix}.json"
        self.steps = 0
        self._reset()

    @staticmethod
    def from_env(program: Program, forward_only: bool = False) -> NullRecorder:
        """A ``Recorder`` writing to ``$PIPER_TRACE`` when it is set, else a ``NullRecorder``."""
        directory = knob("PIPER_TRACE")
        return Recorder(program, directory, forward_only) if directory else NullRecorder()

    def _reset(self) -> None:
        self._step_start = self._begin = self.now()
        self._waited = 0.0  # time spent in waits since the last instruction ended
        self._compute: list[_Record] = []
        self._async: dict[str, _Record] = {}  # name -> (pos, ins, start, issue end, wait_s)
        self._done: dict[str, float] = {}  # name -> completion time
        self._blocked: dict[str, float] = {}

    def now(self) -> float:
        return time.perf_counter()

    def step_begin(self) -> None:
        self._reset()

    def begin(self) -> None:
        self._begin = self.now()

    def end(self, pos: int, ins: Instr, pending: Any) -> None:
        """Instruction ``pos`` finished on the host; ``pending`` is its executor entry (work, ...) if async."""
        t = self.now()
        record = (pos, ins, self._begin, t, self._waited)
        self._waited = 0.0
        if not ins.is_async:
            self._compute.append(record)
            return
        self._async[ins.name] = record
        work = pending[0] if pending else None
        if work is not None and hasattr(work, "get_future"):
            try:  # collectives: a callback at completion (gloo P2P has no future)
                work.get_future().add_done_callback(
                    lambda _f, n=ins.name, done=self._done: done.setdefault(n, time.perf_counter()))
            except RuntimeError:
                pass

    def complete(self, name: str, wait_start: float) -> None:
        """The executor's wait for ``name`` (begun at ``wait_start``) returned."""
        t = self.now()
        self._waited += t - wait_start
        if name in self._async and name not in self._blocked:
            self._blocked[name] = t - wait_start
            self._done[name] = min(self._done.get(name, t), t)

    def step_end(self) -> None:
        """Close the step and write ``rank{r}.json`` in the background."""
        self.steps += 1
        record = (self._compute, self._async, dict(self._done), self._blocked, self._step_start, self.now(), self.steps)
        _submit(self, record)  # one writer thread, in step order: the last step wins

    def _write(self, compute: list[_Record], pending: dict[str, _Record], done: dict[str, float],
               blocked: dict[str, float], start: float, end: float, step: int) -> None:
        from piper_compile.sim.trace import STEP_KIND, STEP_STREAM, Span, span_of, write_trace

        spans = [span_of(ins, self.rank, pos, t0, t1, wait_s=w) for pos, ins, t0, t1, w in compute]
        for name, (pos, ins, t0, issued, wait_s) in pending.items():
            spans.append(span_of(ins, self.rank, pos, t0, max(done.get(name, issued), issued), issue_end=issued,
                                 wait_s=wait_s, blocked_s=blocked.get(name, 0.0)))
        spans.append(Span(self.rank, STEP_STREAM, "step", f"step {step}", STEP_KIND, start, end))
        spans.sort(key=lambda s: (s.start, s.pos))
        write_trace(spans, self.path, {"rank": self.rank, "step": step})
