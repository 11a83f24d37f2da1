"""Execute one rank's program: compute in order on the host thread, communication asynchronous on
its stream's process group, waits placed just before the first consumer, values freed at last use.

A collective or receive that does not finish within ``timeout_s`` raises ``PiperRuntimeError`` naming
the rank, the instruction, the peer and its position in the program instead of hanging.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from piper_compile.capture.joint import BUFFER, INPUT, PARAM, SYM, TANGENT, JointGraph, eval_sym
from piper_compile.errors import PiperRuntimeError
from piper_compile.ir.dag import Kind, param_fqn
from piper_compile.plan.program import Instr, Program
from piper_compile.runtime import expert, tensor_parallel
from piper_compile.runtime.consistency import CallCheck, Weights
from piper_compile.runtime.groups import GroupRegistry, describe_failure, settle
from piper_compile.runtime.reorder import Fillers, needs, overlap_partners, still_read
from piper_compile.runtime.state import GradBuffers, TrainState, keep_host_heap
from piper_compile.runtime.trace import Recorder
from piper_compile.runtime.zero import reduce_scatter
from piper_compile.runtime.zero import tensor_bytes as _nbytes


@dataclass
class StepStats:
    """Counters from the last step (read by tests and benchmarks)."""

    collectives: dict[str, int] = field(default_factory=dict)
    p2p: int = 0
    compute: int = 0
    peak_live_bytes: int = 0  # most bytes of activation values live at once (views counted separately)
    peak_gathered_bytes: int = 0  # ZeRO-3: most bytes of all-gathered parameters live at once
    peak_grad_bytes: int = 0  # most bytes of gradient buffers held at once (ZeRO-2/3 buckets are transient)
    reordered: int = 0  # overlap partners run ahead of (or beside) a predecessor still waiting for its input
    filled: int = 0  # later steps run while an earlier one waited for its input (the reorder window)
    seconds: float = 0.0


def _split_mb(name: str) -> tuple[str, int | None]:
    if "@mb" in name:
        base, mb = name.rsplit("@mb", 1)
        return base, int(mb)
    return name, None


class SideStream:
    """CUDA: the second compute stream of an overlap slot. The partner step of a pair (see
    ``overlap_partners``) is launched on it after the main stream's work so far (``fork``), waits for its
    own communication there only, and the main stream waits for it at the partner's program position
    (``join``): a late input of one step then delays that step alone, not the other on the GPU."""

    async_waits = True  # a wait made on the stream does not block the host (NCCL work)

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def fork(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def context(self) -> Any:
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def side_stream_for(device: torch.device, enabled: bool) -> SideStream | None:
    """The overlap slots' second stream: CUDA only (on CPU one host thread computes; the communication
    of one step is in flight while the other runs)."""
    return SideStream(device) if enabled and device.type == "cuda" else None


class Executor:
    """Runs a rank's program for one step at a time."""

    def __init__(self, program: Program, joint: JointGraph, segments: dict[str, Callable[[list[Any]], list[Any]]],
                 state: TrainState, groups: GroupRegistry | None, microbatches: int,
                 loss_group: tuple[int, ...], timeout_s: float, forward_only: bool,
                 overlap_streams: bool = True, reorder_window: int = 8) -> None:
        self.program = program
        self.joint = joint
        self.segments = segments
        self.state = state
        self.groups = groups
        self.m = microbatches
        self._check: CallCheck | None = None  # this call's (runtime/consistency.py): weights, agreement
        self.loss_group = loss_group
        self.timeout_s = timeout_s
        self.forward_only = forward_only
        self.rank = program.rank
        self.specs = {s.value: s for s in joint.inputs}
        if state.device.type == "cpu":
            keep_host_heap()  # once per process, when a program is about to run (not when only planning)
        local = state.local_params()
        self.grads = GradBuffers.for_program(program, joint, local) if not forward_only else None
        self.stats = StepStats()
        self.rec = Recorder.from_env(program, forward_only)  # PIPER_TRACE=dir; a no-op otherwise
        self._sym_cache: dict[tuple[str, tuple[tuple[str, int], ...]], int] = {}
        self._keep: dict[str, torch.Tensor] = {}  # inputs of in-flight collectives whose owner let go
        self._finish: dict[str, Callable[[], None]] = {}  # what to do once a collective completes
        self._sending: dict[str, torch.Tensor] = {}  # what in-flight all-to-alls and TP collectives send
        norm = next((i.node for i in program.instrs if i.node.attr("purpose") == "gradnorm"), None)
        self._max_norm = float(norm.attr("max_norm")) if norm is not None else 0.0  # options["clip_grad_norm"]
        self._needs = needs(program)
        self._partner = overlap_partners(program, self._needs)
        self._side = side_stream_for(state.device, overlap_streams) if self._partner else None
        # where waits block the host (gloo): later sink steps run while a step's input is in flight
        fillers = Fillers(program, reorder_window, self._needs) if state.device.type != "cuda" and reorder_window \
            else None
        self._fillers = fillers if fillers is not None and fillers.sinks else None
        self._update = program.update_node()

    # -- externals -------------------------------------------------------------------------------
    def _symbols(self, args: list[Any], mb_size: int) -> dict[str, int]:
        vals: dict[str, int] = {}
        for s in self.joint.inputs:
            if s.kind == SYM and s.symbol is not None:
                vals[str(s.symbol)] = mb_size if s.batched else int(args[s.arg_index])
        return vals

    def _external(self, name: str, args: list[Any], mb_size: int, syms: dict[str, int], dtype: torch.dtype) -> Any:
        base, mb = _split_mb(name)
        if base.startswith("symexpr:"):
            return self._eval(base[len("symexpr:"):], syms)
        spec = self.specs.get(base)
        if spec is None:
            raise PiperRuntimeError(f"piper: internal: rank {self.rank} has no value {name}")
        if spec.kind == PARAM:  # segments run under no_grad: no autograd graph is built
            return self.state.local_param(spec.name, args[spec.arg_index])  # an expert shard under EP
        if spec.kind == BUFFER:
            return args[spec.arg_index]
        if spec.kind == TANGENT:  # this rank's share of the global batch, per micro-batch loss
            return torch.full((), self._weights().seed, dtype=dtype, device=self.state.device)
        if spec.kind == SYM:
            return mb_size if spec.batched else int(args[spec.arg_index])
        assert spec.kind == INPUT
        x = args[spec.arg_index]
        if spec.batched and mb is not None:
            return x.narrow(0, mb * mb_size, mb_size)
        return x

    def _eval(self, expr: str, syms: dict[str, int]) -> int:
        """A SymInt expression at these symbol values (sympy once per expression and assignment)."""
        k = (expr, tuple(sorted(syms.items())))
        v = self._sym_cache.get(k)
        if v is None:
            v = self._sym_cache[k] = eval_sym(expr, syms)
        return v

    # -- waiting -----------------------------------------------------------------------------------
    @staticmethod
    def _blocked(names: tuple[str, ...], pending: dict[str, tuple[Any, Instr, int]]) -> bool:
        """Whether one of these communications is still in flight (never blocks)."""
        for w in names:
            item = pending.get(w)
            if item is not None and item[0] is not None and not item[0].is_completed():
                return True
        return False

    def _early(self, ins: Instr, j: int, pending: dict[str, tuple[Any, Instr, int]]) -> str | None:
        """How overlap partner ``j`` runs before ``ins``, if it does: ``"side"`` (CUDA: always, on the
        second stream, unless one of its waits has host work to do on completion -- a sequence-parallel
        result -- or, where waits block the host, its input is not here yet: waiting for it before ``ins``
        sends its output could deadlock with the peer), ``"host"`` (``ins``'s input is still in flight and
        ``j``'s has arrived) or None (program order)."""
        need = self._needs[j]
        if self._side is not None and not any(w in self._finish for w in need) and (
                self._side.async_waits or not self._blocked(need, pending)):
            return "side"
        return "host" if self._blocked(ins.waits, pending) and not self._blocked(need, pending) else None

    def _run_early(self, pos: int, j: int, how: str, pending: dict[str, tuple[Any, Instr, int]],
                   compute: Callable[[Instr, bool], None], free: Callable[[str], None],
                   ran_early: dict[int, bool]) -> None:
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
                item = pending.get(w)
                if side is None:
                    self._wait(pending, w)
                elif item is not None and item[0] is not None:
                    self._block(*item)
            self.rec.begin()
            compute(partner, False)
            self.rec.end(j, partner, None)
        ran_early[j] = side is not None
        if side is None:
            keep = still_read(self.program, pos, j, ran_early)
            for v in partner.frees:
                if v not in keep:
                    free(v)

    def _fill(self, pos: int, pending: dict[str, tuple[Any, Instr, int]], compute: Callable[[Instr, bool], None],
              free: Callable[[str], None], ran_early: dict[int, bool]) -> None:
        """While step ``pos``'s input is in flight, run later independent sink steps (deferred weight
        gradients) whose communication has completed (``reorder.Fillers``), nearest first, one at a time,
        re-checking the wait in between."""
        assert self._fillers is not None
        waits = self.program.instrs[pos].waits
        while self._blocked(waits, pending):
            k = next((k for k in self._fillers.candidates(pos, ran_early)
                      if not self._blocked(self._needs[k], pending)), None)
            if k is None:
                return
            self._run_early(pos, k, "host", pending, compute, free, ran_early)
            self.stats.filled += 1

    def _wait(self, pending: dict[str, tuple[Any, Instr, int]], name: str) -> None:
        item = pending.pop(name, None)
        if item is None:
            return
        work, ins, pos = item
        self._keep.pop(name, None)
        self._sending.pop(name, None)
        finish = self._finish.pop(name, None)
        if work is not None:
            self._block(work, ins, pos)
        if finish is not None:
            finish()

    def _block(self, work: Any, ins: Instr, pos: int) -> None:
        if self.state.device.type == "cuda":
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

    def _weights(self) -> Weights:
        """The call check's result (waited for here the first time): every rank makes this call, and how
        this rank's losses weigh in the global mean."""
        assert self._check is not None
        return self._check.resolve()

    # -- one step --------------------------------------------------------------------------------
    def run(self, args: list[Any], check: CallCheck) -> torch.Tensor:
        """One step on this rank. ``check`` (started by the caller) is resolved before the step's first
        communication, wait or loss seed, so ranks making different calls raise before any traffic pairs."""
        t0 = time.perf_counter()
        rec = self.rec
        rec.step_begin()
        self._check = check
        batch = check.record.batch
        if batch <= 0 or batch % self.m:
            check.resolve()  # raises on every rank
        mb_size = batch // self.m
        syms = self._symbols(args, mb_size)
        dtype = self._loss_dtype(args)
        env: dict[str, Any] = {}
        pending: dict[str, tuple[Any, Instr, int]] = {}
        loss_sum = torch.zeros((), dtype=dtype, device=self.state.device)
        result: dict[str, torch.Tensor] = {}
        self.stats = StepStats()
        if self.grads is not None:
            self.grads.zero_()

        externals: dict[str, Any] = {}  # resolved once per step, not once per use
        key = (mb_size, *sorted(syms.items()))  # every input shape follows from the symbol values
        live = 0
        gathered = 0

        def get(v: str) -> Any:
            x = env.get(v)
            if x is None:
                x = externals.get(v)
                if x is None:
                    x = externals[v] = self._external(v, args, mb_size, syms, dtype)
            return x

        released: dict[str, int] = {}

        def free(v: str) -> None:
            nonlocal live, gathered
            b = released.pop(v) if v in released else _nbytes(env.pop(v, None))
            if v.startswith("param:"):
                gathered -= b
            else:
                live -= b

        def compute(ins: Instr, release: bool = True) -> None:
            nonlocal live
            n = ins.node
            inputs = [get(v) for v in n.inputs]
            for v in ins.frees if release else ():  # last use: the segment may free it once done with it
                if v in env and v in n.inputs and v not in n.outputs:
                    released[v] = _nbytes(env.pop(v))  # still counted live until the instruction ends
            if n.attr("tp_role") == "scatter":  # sequence parallel: this rank's chunk of a whole activation
                index = self._subgroup(n).index(self.rank)
                outs = (tensor_parallel.chunk(inputs[0], n.attr("dim"), n.attr("size"), index),)
            elif n.attr("ep_role"):
                acc, overwrite = None, False
                if n.attr("accumulate_grads") and self.grads is not None:  # w_gate, w_up, w_down in order
                    acc, overwrite = self.grads.claim(f for _, f in n.attr("grads"))
                with torch.no_grad():  # the runtime computes gradients itself: build no autograd graph
                    outs = expert.compute(n, inputs, acc, overwrite)
            else:
                outs = self.segments[n.attr("segment")](inputs, key)
            del inputs
            env.update(zip(n.outputs, outs))
            live += sum(_nbytes(t) for t in outs)
            self.stats.compute += 1
            if n.attr("loss"):
                loss_sum.add_(env[n.attr("loss")].detach())
            if self.grads is not None and n.attr("grads"):
                for v, fqn in n.attr("grads"):
                    if env[v] is not None:  # None: the step accumulated it itself
                        self.grads.accumulate(fqn, env[v])
                self._note_grad_bytes()

        ran_early: dict[int, bool] = {}  # position -> whether it ran on the side stream
        for pos, ins in enumerate(self.program.instrs):
            n = ins.node
            if n.kind is not Kind.COMPUTE or ins.waits:  # the first traffic of the call: after the check
                self._weights()
            if pos in ran_early:  # an overlap partner or filler that ran while an earlier step waited
                if ran_early.pop(pos) and self._side is not None:
                    self._side.join()
                for v in ins.frees:
                    free(v)
                continue
            j = self._partner.get(pos)
            how = self._early(ins, j, pending) if j is not None and j not in ran_early else None
            if how is not None:  # e.g. DualPipeV's B of one micro-batch while F's activation arrives
                self._run_early(pos, j, how, pending, compute, free, ran_early)
                self.stats.reordered += 1
            if self._fillers is not None and n.kind is Kind.COMPUTE and ins.waits:
                self._fill(pos, pending, compute, free, ran_early)
            for w in ins.waits:
                tw = rec.now()
                self._wait(pending, w)
                rec.complete(w, tw)
            rec.begin()
            if n.kind is Kind.COMPUTE:
                compute(ins)
            elif n.kind is Kind.SEND:
                t = self.grads.view(n.attr("state")) if n.attr("state") else get(n.inputs[0])
                t = t.contiguous()
                pending[n.name] = (dist.isend(t, dst=ins.peer, group=self._group(ins)), ins, pos)
                self.stats.p2p += 1
            elif n.kind is Kind.RECV:
                if n.attr("state"):
                    buf = self.grads.view(n.attr("state"))
                else:
                    shape = [self._eval(d, syms) for d in n.attr("shape")]
                    buf = torch.empty(shape, dtype=getattr(torch, n.attr("dtype")), device=self.state.device)
                    env[n.outputs[0]] = buf
                    live += _nbytes(buf)
                pending[n.name] = (dist.irecv(buf, src=ins.peer, group=self._group(ins)), ins, pos)
                self.stats.p2p += 1
            elif n.kind is Kind.ALL_REDUCE and n.attr("purpose") == "tp":  # tensor parallel: partial sums
                t = get(n.inputs[0])
                t = t if n.inputs[0] in ins.frees else t.clone()  # reduced in place at its last use
                env[n.outputs[0]] = t
                live += _nbytes(t)
                self._count("tp")
                pending[n.name] = (dist.all_reduce(t, group=self.groups.get(n.stream, self._subgroup(n)),
                                                   async_op=True), ins, pos)
            elif n.kind is Kind.ALL_REDUCE:
                pending[n.name] = (self._all_reduce(ins, loss_sum, result), ins, pos)
            elif n.kind in (Kind.ALL_GATHER, Kind.REDUCE_SCATTER) and n.attr("purpose") == "tp":  # along the sequence
                work, self._sending[n.name], done = self._sequence_collective(n, get(n.inputs[0]))
                self._finish[n.name] = _store(env, n.outputs[0], done)
                nbytes = _nbytes(self._sending[n.name])
                live += nbytes * n.attr("size") if n.kind is Kind.ALL_GATHER else nbytes // n.attr("size")
                pending[n.name] = (work, ins, pos)
            elif n.kind is Kind.REDUCE_SCATTER:
                pending[n.name] = (self._reduce_scatter(ins, pending), ins, pos)
                self._note_grad_bytes(extra=self._keep[n.name])
            elif n.kind is Kind.ALL_GATHER:
                work, views = self._all_gather(ins)
                env.update(views)
                gathered += sum(_nbytes(t) for t in views.values())
                pending[n.name] = (work, ins, pos)
            elif n.kind is Kind.ALL_TO_ALL:
                with torch.no_grad():
                    work, outs, sending = expert.all_to_all(n, [get(v) for v in n.inputs],
                                                            self.groups.get(n.stream, n.devices), len(n.devices))
                self._count("ep_counts" if n.attr("ep_role") == "counts" else "ep")
                env.update(zip(n.outputs, outs))
                live += sum(_nbytes(t) for t in outs)
                self._sending[n.name] = sending  # alive until the all-to-all completes
                pending[n.name] = (work, ins, pos)
            elif n.kind is Kind.UPDATE:
                grad_sq = result.get("gradnorm")
                self.state.apply_update(n, self.grads, self.joint, grad_sq, self._max_norm)
                if self.state.zero is not None:
                    self.state.zero.release_grad_shards()
            else:
                raise PiperRuntimeError(f"piper: internal: no runtime for {n.kind}")
            self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, live)
            self.stats.peak_gathered_bytes = max(self.stats.peak_gathered_bytes, gathered)
            for v in ins.frees:
                free(v)
            rec.end(pos, ins, pending.get(n.name))
        for name in list(pending):
            tw = rec.now()
            self._wait(pending, name)
            rec.complete(name, tw)
        loss = result.get("loss")
        if loss is None:  # single rank or loss computed here without a world reduce
            loss = loss_sum / self._weights().loss_divisor
        self.stats.seconds = time.perf_counter() - t0
        rec.step_end()
        return loss

    def _all_reduce(self, ins: Instr, loss_sum: torch.Tensor, result: dict[str, torch.Tensor]) -> Any:
        n = ins.node
        self._count(n.attr("purpose"))
        if n.attr("purpose") == "loss":  # holders add their share of the global mean, the others zero
            holders = n.attr("holders")
            t = loss_sum / self._weights().loss_divisor if self.rank in holders else torch.zeros_like(loss_sum)
            result["loss"] = t
        elif n.attr("purpose") == "gradnorm":
            assert self._update is not None and self.grads is not None
            t = result["gradnorm"] = self.state.local_grad_sq(self._update, self.grads, self.rank)
        else:
            t = self.grads.bucket(n.attr("bucket"))
        if len(n.devices) == 1:
            return None
        return dist.all_reduce(t, group=self.groups.get(n.stream, self._subgroup(n)), async_op=True)

    def _sequence_collective(self, n: Any, x: torch.Tensor) -> tensor_parallel.Started:
        """Start a sequence-parallel all-gather or reduce-scatter along the sequence dimension."""
        self._count("tp")
        group = self.groups.get(n.stream, self._subgroup(n))
        start = tensor_parallel.gather if n.kind is Kind.ALL_GATHER else tensor_parallel.reduce_scatter_dim
        return start(x, n.attr("dim"), n.attr("size"), group)

    def _count(self, purpose: str) -> None:
        self.stats.collectives[purpose] = self.stats.collectives.get(purpose, 0) + 1

    def _subgroup(self, n: Any) -> tuple[int, ...]:
        """The ranks this rank runs collective ``n`` with: its own subgroup under tensor parallelism."""
        for g in n.attr("subgroups") or ():
            if self.rank in g:
                return tuple(g)
        return n.devices

    def _note_grad_bytes(self, extra: torch.Tensor | None = None) -> None:
        assert self.grads is not None
        held = self.grads.nbytes() + _nbytes(extra)
        if self.state.zero is not None:
            held += self.state.zero.grad_shard_bytes()
        self.stats.peak_grad_bytes = max(self.stats.peak_grad_bytes, held)

    def _reduce_scatter(self, ins: Instr, pending: dict[str, tuple[Any, Instr, int]]) -> Any:
        """ZeRO-2/3: the bucket's summed gradient, this rank's shard only; the full buffer is released.
        The previous reduce-scatters are retired first (as FSDP does), so at most one full bucket is in
        flight: polling cannot do it, gloo's reduce-scatter only reports completion once waited on."""
        for name in list(self._keep):
            self._wait(pending, name)
        n = ins.node
        self._count("grad")
        assert self.state.zero is not None and self.grads is not None
        b = n.attr("bucket")
        full = self.grads.bucket(b)
        if n.attr("accumulate"):  # one of several per step: summed into the shard when it finishes
            out = self.state.zero.partial_shard(b, n.attr("mb"))
            self._finish[n.name] = functools.partial(self.state.zero.fold, b, n.attr("mb"))
        else:
            out = self.state.zero.shard_grad(b, None)
        self._keep[n.name] = full  # alive until the reduce-scatter completes
        self.grads.release(b)
        return reduce_scatter(out, full, self.groups.get(n.stream, n.devices))

    def _all_gather(self, ins: Instr) -> tuple[Any, dict[str, torch.Tensor]]:
        """ZeRO parameter all-gather: before a compute step (ZeRO-3; its parameters become values of
        that step) or after the update (ZeRO-1/2; into the full flat parameters)."""
        n = ins.node
        self._count("param")
        zero = self.state.zero
        assert zero is not None
        group = self.groups.get(n.stream, n.devices)
        if not n.attr("for"):
            return zero.post_update_gather(n.attr("bucket"), group), {}
        flat, work = zero.gather(n.attr("bucket"), group)
        views = zero.buckets[n.attr("bucket")].views(flat)
        return work, {v: views[param_fqn(v)] for v in n.outputs}

    def _group(self, ins: Instr) -> Any:
        return self.groups.get(ins.group_name(self.rank), tuple(range(dist.get_world_size())))

    def _loss_dtype(self, args: list[Any]) -> torch.dtype:
        val = self.joint.gm.graph.find_nodes(op="output")[0].args[0][0].meta.get("val")
        return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def _store(env: dict[str, Any], name: str, done: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """Once a collective completes: its result becomes value ``name``."""
    def finish() -> None:
        env[name] = done()
    return finish
