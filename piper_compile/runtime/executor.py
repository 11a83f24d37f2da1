"""Execute one rank's program: compute in order on the host thread, communication asynchronous on
its stream's process group, waits placed just before the first consumer, values freed at last use.

Each instruction is run by its op (``ir/ops``): compute ops through ``Executor.compute`` (inputs,
last-use release, loss and gradient accumulation), the others through ``Op.start`` against the step's
state (``runtime/step.py``). A collective or receive that does not finish within ``timeout_s`` raises
``PiperRuntimeError`` naming the rank, the instruction, the peer and its position in the program.
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from piper_compile.capture.joint import JointGraph, eval_sym
from piper_compile.errors import PiperRuntimeError
from piper_compile.ir.dag import Kind
from piper_compile.ir.ops import Local, NormReduce, Segment
from piper_compile.plan.program import Instr, Program
from piper_compile.runtime.consistency import CallCheck
from piper_compile.runtime.groups import GroupRegistry, describe_failure, settle
from piper_compile.plan.reorder import needs, still_read
from piper_compile.runtime.grads import GradBuffers
from piper_compile.runtime.host_heap import keep_host_heap
from piper_compile.runtime.state import TrainState
from piper_compile.runtime.step import Pending, Step, StepStats
from piper_compile.sim.segment_memory import root_value
from piper_compile.runtime.trace import Recorder
from piper_compile.runtime.zero import tensor_bytes as _nbytes

__all__ = ["Executor", "SideStream", "StepStats", "side_stream_for"]


class SideStream:
    """CUDA: the second compute stream of an overlap slot. The partner step of a pair (see
    ``overlap_partners``) is launched on it after the main stream's work so far (``fork``), waits for its
    own communication there only, and the main stream waits for it at the partner's program position
    (``join``): a late input of one step then delays that step alone, not the other on the GPU. Only
    NCCL's waits stay on the stream; where a wait blocks the host (gloo, ranks sharing a GPU) the executor
    starts a partner there only once its input is here (``Executor._early``)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def fork(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def context(self) -> Any:
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def device_waits(device: torch.device) -> bool:
    """Whether waiting for a communication only orders the device's streams (NCCL on CUDA) rather than
    blocking the host until it completes (gloo, also for CUDA tensors staged through host memory on a
    shared GPU): those host waits get ``options["timeout"]`` and a message naming the instruction."""
    return device.type == "cuda" and dist.is_initialized() and dist.get_backend() == "nccl"


def side_stream_for(device: torch.device, enabled: bool) -> SideStream | None:
    """The overlap slots' second stream: CUDA only (on CPU one host thread computes; the communication
    of one step is in flight while the other runs)."""
    return SideStream(device) if enabled and device.type == "cuda" else None


class Executor:
    """Runs a rank's program for one step at a time."""

    def __init__(self, program: Program, joint: JointGraph, segments: dict[str, Callable[[list[Any]], list[Any]]],
                 state: TrainState, groups: GroupRegistry | None, microbatches: int,
                 loss_group: tuple[int, ...], timeout_s: float, forward_only: bool,
                 overlap_streams: bool = True, codegen: str = "inductor",
                 aliases: dict[str, dict[int, tuple[str, int]]] | None = None) -> None:
        self.program = program
        self.aliases = aliases or {}  # segment -> its outputs that are views (sim/segment_memory.alias_map)
        self.codegen = codegen  # how compute outside segments (the local experts) is compiled
        self.joint = joint
        self.segments = segments
        self.state = state
        self.groups = groups
        self.m = microbatches
        self.loss_group = loss_group
        self.timeout_s = timeout_s
        self.device_waits = device_waits(state.device)
        self.forward_only = forward_only
        self.rank = program.rank
        self.specs = {s.value: s for s in joint.inputs}
        if state.device.type == "cpu":
            keep_host_heap()  # once per process, when a program is about to run (not when only planning)
        self.grads = GradBuffers.for_program(program, joint, state.local_params()) if not forward_only else None
        self.stats = StepStats()
        self.rec = Recorder.from_env(program, forward_only)  # PIPER_TRACE=dir; a no-op otherwise
        self._sym_cache: dict[tuple[str, tuple[tuple[str, int], ...]], int] = {}
        self._handover: dict[str, tuple[str, ...]] = {}  # compute step -> inputs it reads last (``compute``)
        self.graph: Any = None  # options["cuda_graph"]: the recorded training step (runtime/graph.StepGraph)
        norm = next((i.node.op for i in program.instrs if isinstance(i.node.op, NormReduce)), None)
        self.max_norm = norm.max_norm if norm is not None else 0.0  # options["clip_grad_norm"]
        self.update = program.update_node()
        val = joint.gm.graph.find_nodes(op="output")[0].args[0][0].meta.get("val")
        computed = val.dtype if isinstance(val, torch.Tensor) else torch.float32
        self.tangent_dtype = computed  # the seed of each micro-batch's backward
        self.loss_dtype = state.precision.loss_dtype(computed)  # what the loss is summed and returned in
        # the reorderings the plan recorded (plan/reorder.py): overlap partners, and -- where waits block
        # the host (gloo) -- fillers, sink steps that run while a step's input is in flight
        self._needs = needs(program)
        at = program.positions()
        self._partner = {k: at[i.partner] for k, i in enumerate(program.instrs) if i.partner}
        self._side = side_stream_for(state.device, overlap_streams) if self._partner else None
        self._fillers = {k: tuple((at[f], tuple(at[a] for a in after)) for f, after in i.fillers)
                         for k, i in enumerate(program.instrs) if i.fillers} if state.device.type != "cuda" else {}

    def eval_sym(self, expr: Any, syms: dict[str, int]) -> int:
        """A SymInt expression at these symbol values (sympy once per expression and assignment)."""
        if isinstance(expr, int):
            return expr
        k = (expr, tuple(sorted(syms.items())))
        v = self._sym_cache.get(k)
        if v is None:
            v = self._sym_cache[k] = eval_sym(expr, syms)
        return v

    # -- waiting -----------------------------------------------------------------------------------
    @staticmethod
    def _blocked(names: tuple[str, ...], pending: Pending) -> bool:
        """Whether one of these communications is still in flight (never blocks)."""
        for w in names:
            item = pending.get(w)
            if item is not None and item[0] is not None and not item[0].is_completed():
                return True
        return False

    def _early(self, ins: Instr, j: int, step: Step) -> str | None:
        """How overlap partner ``j`` runs before ``ins``, if it does: ``"side"`` (CUDA: always, on the
        second stream, unless one of its waits has host work to do on completion -- a sequence-parallel
        result -- or, where waits block the host, its input is not here yet: waiting for it before ``ins``
        sends its output could deadlock with the peer), ``"host"`` (``ins``'s input is still in flight and
        ``j``'s has arrived) or None (program order)."""
        need, pending = self._needs[j], step.pending
        if self._side is not None and not any(w in step.finish for w in need) and (
                self.device_waits or not self._blocked(need, pending)):
            return "side"
        return "host" if self._blocked(ins.waits, pending) and not self._blocked(need, pending) else None

    def _run_early(self, step: Step, pos: int, j: int, how: str, ran_early: dict[int, bool]) -> None:
        """Run step ``j`` now, while the program is at ``pos``: an overlap partner (``how`` = "side" or
        "host") or a filler ("host"). On the side stream its waits are made there without retiring them:
        the main stream still waits for each where its own consumers are, and its frees wait for its own
        position (after the join). On the host what it frees (its results, its last-use inputs) is freed
        at once, except values an instruction it ran ahead of still reads."""
        partner = self.program.instrs[j]
        side = self._side if how == "side" else None
        if side is not None:
            side.fork()
        with side.context() if side is not None else contextlib.nullcontext():
            for w in self._needs[j]:
                item = step.pending.get(w)
                if side is None:
                    self._timed_wait(step, w)
                elif item is not None and item[0] is not None:
                    self._block(*item)
            self.rec.begin()
            t0 = time.perf_counter()
            self.compute(step, partner, False)
            self.stats.compute_s += time.perf_counter() - t0
            self.rec.end(j, partner, None)
        ran_early[j] = side is not None
        if side is None:
            keep = still_read(self.program, pos, j, ran_early)
            for v in partner.frees:
                if v not in keep:
                    step.free(v)

    def _fill(self, step: Step, pos: int, ran_early: dict[int, bool]) -> None:
        """While step ``pos``'s input is in flight, run later independent sink steps (deferred weight
        gradients) the plan recorded for it (``Instr.fillers``) whose communication has completed and whose
        recorded predecessors have run early, nearest first, one at a time, re-checking the wait in between."""
        waits, pending = self.program.instrs[pos].waits, step.pending
        while self._blocked(waits, pending):
            k = next((k for k, after in self._fillers[pos] if k not in ran_early
                      and all(a in ran_early for a in after) and not self._blocked(self._needs[k], pending)), None)
            if k is None:
                return
            self._run_early(step, pos, k, "host", ran_early)
            self.stats.filled += 1

    def _timed_wait(self, step: Step, name: str) -> None:
        """``wait``, its time recorded for the trace and counted as exposed communication (collectives)
        or as waiting for a peer (stage-to-stage messages)."""
        item = step.pending.get(name)
        tw, t0 = self.rec.now(), time.perf_counter()
        self.wait(step, name)
        self.rec.complete(name, tw)
        if item is not None:
            waited = time.perf_counter() - t0
            if item[1].node.kind in (Kind.SEND, Kind.RECV):
                self.stats.p2p_wait_s += waited
            else:
                self.stats.comm_wait_s += waited

    def wait(self, step: Step, name: str) -> None:
        """Wait for asynchronous instruction ``name`` (if in flight) and run what its completion does."""
        item = step.pending.pop(name, None)
        if item is None:
            return
        work, ins, pos = item
        step.done(name)
        finish = step.finish.pop(name, None)
        if work is not None:
            self._block(work, ins, pos)
        if finish is not None:
            finish()

    def _block(self, work: Any, ins: Instr, pos: int) -> None:
        if self.device_waits:
            # NCCL: wait() only makes the compute stream wait (no host block); the communicator's own
            # timeout (set from options["timeout"] when the group was created) aborts a stuck op.
            work.wait()
            return
        t0 = time.perf_counter()
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo raises a plain RuntimeError (timeout, peer gone)
            waited = time.perf_counter() - t0
            settle(work)
            raise self._timeout_error(ins, pos, e, waited) from None
        if ok is False:
            waited = time.perf_counter() - t0
            settle(work)
            raise self._timeout_error(ins, pos, None, waited)

    def _timeout_error(self, ins: Instr, pos: int, cause: Exception | None,
                       waited_s: float | None = None) -> PiperRuntimeError:
        """The step's failure at a communication wait: a peer that closed its connection (crashed or
        exited) is said to have done so, after the time it took; only a real timeout is called one."""
        peers = [ins.peer] if ins.peer is not None else [r for r in ins.node.devices if r != self.rank]
        what = describe_failure(cause, self.timeout_s if waited_s is None else waited_s, self.timeout_s,
                                peers or [self.rank])
        return PiperRuntimeError(
            f"piper: rank {self.rank}: {ins.short()} (instruction {pos} of {len(self.program.instrs)}, stream "
            f"{ins.node.stream!r}) {what}.")

    # -- one step --------------------------------------------------------------------------------
    def compute(self, step: Step, ins: Instr, release: bool = True) -> None:
        """Run a compute op: its inputs (handed over at their last use when ``release``), its outputs
        stored and counted, its loss and gradients accumulated."""
        n = ins.node
        step.mb = n.attr("mb", 0)  # whose loss seed a backward reads
        inputs = [step.get(v) for v in n.inputs]
        for v in self._handed_over(ins) if release else ():  # last use: the segment may free it once done with it
            if v in step.env:
                step.released[v] = _nbytes(step.env.pop(v))  # still counted live until the instruction ends
        outs = n.op.compute(step, ins, inputs)  # type: ignore[attr-defined]
        del inputs
        seg = isinstance(n.op, Segment)
        amap = self.aliases.get(n.op.segment, {}) if seg else {}  # type: ignore[attr-defined]
        for k, (v, t) in enumerate(zip(n.outputs, outs)):
            if seg:
                step.put_output(v, t, root_value(amap, k, n.inputs, n.outputs))
            else:
                step.put(v, t)
        transient, step.transient = step.transient, 0
        if transient:  # its outputs and inputs, and the intermediates it held while it ran, at once
            self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, step.live + transient)
        self.stats.compute += 1
        loss = getattr(n.op, "loss", None)
        if loss:
            weight = step.weights().loss_weight(step.mb)  # the micro-batch the tangent seed was read for
            if weight is None:
                step.loss_sum.add_(step.env[loss].detach())
            elif weight:  # a micro-batch without items adds nothing (its own mean is 0/0)
                step.loss_sum.add_(step.env[loss].detach(), alpha=weight)  # in the sum's dtype (fp32)
        grads = n.op.grad_outputs()
        if self.grads is not None and grads:
            for v, fqn in grads:
                if step.env[v] is not None:  # None: the step accumulated it itself
                    self.grads.accumulate(fqn, step.env[v])
            step.note_grad_bytes()
        step.sample(transient)  # with the gradient buffers it wrote into

    def _handed_over(self, ins: Instr) -> tuple[str, ...]:
        """The inputs of compute step ``ins`` read there for the last time (not also its outputs)."""
        got = self._handover.get(ins.node.name)
        if got is None:
            inputs, outputs = set(ins.node.inputs), set(ins.node.outputs)
            got = self._handover[ins.node.name] = tuple(v for v in ins.frees if v in inputs and v not in outputs)
        return got

    def run(self, args: list[Any], check: CallCheck) -> torch.Tensor:
        """One step on this rank. ``check`` (started by the caller) is resolved before the step's first
        communication, wait or loss seed, so ranks making different calls raise before any traffic pairs."""
        batch = check.record.batch
        if batch <= 0 or batch % self.m:
            check.resolve()  # raises on every rank
        self.rec.step_begin()
        self.stats = StepStats()
        if self.state.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():  # piper.stats's device time
            self.stats.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.stats.events[0].record()
        step = Step(self, args, check)
        updates = self.state.updates
        if self.grads is not None:
            self.grads.zero_()
        ran_early: dict[int, bool] = {}  # position -> whether it ran on the side stream
        for pos, ins in enumerate(self.program.instrs):
            self._step(step, pos, ins, ran_early)
        for name in list(step.pending):
            self._timed_wait(step, name)
        if self.state.updates != updates:  # the next step's compute copies, while the device runs the update
            self.state.refresh_compute_copies()
        loss = step.result.get("loss")
        if loss is None:  # single rank or loss computed here without a world reduce
            loss = step.loss_sum / step.weights().loss_divisor
        self.stats.samples, self.stats.symbols = step.check.global_batch(), step.syms
        if self.stats.events is not None:
            self.stats.events[1].record()
        self.stats.seconds = time.perf_counter() - step.t0
        self.rec.step_end()
        return loss

    def _retire_sends(self, step: Step) -> None:
        """Finish the sends that completed (nothing waits for a send before the step ends): the library
        drops the sent tensor only with its work, and the accounting counts it until then."""
        done = [name for name, (work, ins, _) in step.pending.items()
                if ins.node.kind is Kind.SEND and (work is None or work.is_completed())]
        for name in done:
            self._timed_wait(step, name)

    def _step(self, step: Step, pos: int, ins: Instr, ran_early: dict[int, bool]) -> None:
        """Instruction ``pos``: its reorderings, its waits, the op, the accounting and its frees."""
        n = ins.node
        self._retire_sends(step)
        if n.kind is not Kind.COMPUTE or ins.waits:  # the first traffic of the call: after the check
            step.weights()
        if pos in ran_early:  # an overlap partner or filler that ran while an earlier step waited
            if ran_early.pop(pos) and self._side is not None:
                self._side.join()
            for v in ins.frees:
                step.free(v)
            return
        j = self._partner.get(pos)
        how = self._early(ins, j, step) if j is not None and j not in ran_early else None
        if how is not None:  # e.g. DualPipeV's B of one micro-batch while F's activation arrives
            self._run_early(step, pos, j, how, ran_early)
            self.stats.reordered += 1
        if pos in self._fillers:
            self._fill(step, pos, ran_early)
        for w in ins.waits:
            self._timed_wait(step, w)
        self.rec.begin()
        t0 = time.perf_counter()
        if isinstance(n.op, Local):
            self.compute(step, ins)
            self.stats.compute_s += time.perf_counter() - t0
        else:
            n.op.start(step, ins, pos)
            if n.kind is Kind.UPDATE:
                self.stats.update_s += time.perf_counter() - t0
        self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, step.live)
        self.stats.peak_gathered_bytes = max(self.stats.peak_gathered_bytes, step.gathered)
        step.sample()
        for v in ins.frees:
            step.free(v)
        self.rec.end(pos, ins, step.pending.get(n.name))
