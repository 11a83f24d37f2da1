"""The state of one step being run on one rank, and the operations ops use to act on it.

``Executor.run`` makes one ``Step`` per call; each instruction's op runs against it (``Op.start`` for
communication and the update, ``Op.compute`` for compute steps, ``ir/ops``): reading and storing values
(with the live-bytes accounting), issuing asynchronous work, the process groups, the gradient buffers,
the training state and the loss. Nothing here knows what a particular op is.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from piper_compile.capture.joint import BUFFER, INPUT, PARAM, SYM, TANGENT, TANGENT_VALUE
from piper_compile.errors import PiperRuntimeError
from piper_compile.plan.program import Instr
from piper_compile.runtime import comm
from piper_compile.runtime.consistency import CallCheck, Weights
from piper_compile.runtime.zero import tensor_bytes
from piper_compile.sim.segment_memory import SharedStorage

Pending = dict[str, tuple[Any, Instr, int]]  # async instruction name -> (work, instruction, position)


@dataclass
class StepStats:
    """Counters from the last step (read by tests and benchmarks)."""

    collectives: dict[str, int] = field(default_factory=dict)
    p2p: int = 0
    compute: int = 0
    peak_live_bytes: int = 0  # most bytes of activation values live at once (a shared storage once)
    peak_gathered_bytes: int = 0  # ZeRO-3: most bytes of all-gathered parameters live at once
    peak_grad_bytes: int = 0  # most bytes of gradient buffers held at once (ZeRO-2/3 buckets are transient)
    peak_held_bytes: int = 0  # most bytes of activations, gathered parameters and gradient buffers at once
    reordered: int = 0  # overlap partners run ahead of (or beside) a predecessor still waiting for its input
    filled: int = 0  # later steps run while an earlier one waited for its input (the reorder window)
    seconds: float = 0.0
    # where the host's time went (piper.stats): compute steps, the optimizer update, blocked on collectives
    # (exposed communication) and on peers' stage-to-stage messages (waiting: pipeline bubbles, skew)
    compute_s: float = 0.0
    update_s: float = 0.0
    comm_wait_s: float = 0.0
    p2p_wait_s: float = 0.0
    samples: int = 0  # the global batch of the step (every replica's samples)
    expert_flops: int = 0  # expert-parallel experts steps (outside segment graphs: counted as they run)
    expert_load: float = 0.0  # the most rows an experts step received, over balanced routing's (check_load)
    symbols: dict[str, int] = field(default_factory=dict)  # the step's size symbols (FLOP counts read them)
    events: tuple[Any, Any] | None = None  # CUDA: events at the step's start and end (device step time)
    device_s: float | None = None  # the device time between them, once read (``device_seconds``)

    def device_seconds(self) -> float | None:
        """CUDA: the device's time for the step, between its start and end events (waits for the end
        event, then keeps the figure and drops the events); None on a host device."""
        if self.events is not None:
            self.events[1].synchronize()
            self.device_s = self.events[0].elapsed_time(self.events[1]) / 1e3
            self.events = None
        return self.device_s

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a test's rank returns it to the launcher): CUDA events are not, so their time is
        read first."""
        self.device_seconds()
        return dict(self.__dict__)


def split_mb(name: str) -> tuple[str, int | None]:
    if "@mb" in name:
        base, mb = name.rsplit("@mb", 1)
        return base, int(mb)
    return name, None


class Step:
    """One step of one rank's program: values, in-flight work, accounting. ``ex`` is the Executor (the
    program's static facts: joint graph, state, groups, compiled segments)."""

    def __init__(self, ex: Any, args: list[Any], check: CallCheck) -> None:
        self.ex, self.args, self.check = ex, args, check
        self.rank, self.state, self.grads, self.segments = ex.rank, ex.state, ex.grads, ex.segments
        self.device = ex.state.device
        self.update, self.max_norm, self.stats = ex.update, ex.max_norm, ex.stats
        self.params = ex.joint.params
        self.mb_size = check.record.batch // ex.m
        self.syms = self._symbols()
        self.key = (self.mb_size, *sorted(self.syms.items()))  # every input shape follows from the symbols
        self.loss_sum = torch.zeros((), dtype=ex.loss_dtype, device=self.device)
        self.env: dict[str, Any] = {}
        self.externals: dict[str, Any] = {}  # resolved once per step, not once per use
        self.pending: Pending = {}
        self.result: dict[str, torch.Tensor] = {}
        self.shared = SharedStorage()  # segment outputs by the storage they share
        self.released: dict[str, int] = {}  # values handed to a segment at their last use: bytes still counted
        self._keep: dict[str, torch.Tensor] = {}  # inputs of in-flight reduce-scatters whose owner let go
        self.finish: dict[str, Callable[[], None]] = {}  # what to do once a collective completes
        self._sending: dict[str, torch.Tensor] = {}  # what in-flight all-to-alls and TP collectives send
        self.sent_by: dict[str, str] = {}  # value -> the SEND in flight with it (freed there: counted until done)
        self._in_flight: dict[str, int] = {}  # SEND -> bytes of the freed value it still holds
        self.live = self.gathered = 0
        self.grad_held = 0  # gradient buffers and ZeRO shards held now (``note_grad_bytes``)
        if self.grads is not None:
            self.grad_held = self.grads.nbytes() + (self.state.zero.grad_shard_bytes() if self.state.zero else 0)
        self.transient = 0  # bytes the compute step just run held only while it ran (its intermediates)
        self.t0 = time.perf_counter()
        self.mb = 0  # the micro-batch of the compute step reading its inputs (executor.Executor)

    # -- values ----------------------------------------------------------------------------------
    def _symbols(self) -> dict[str, int]:
        return self.ex.joint.symbol_values(self.args, self.mb_size)

    def eval(self, expr: Any) -> int:
        """A SymInt expression (or int) at this step's symbol values."""
        return self.ex.eval_sym(expr, self.syms)

    def get(self, v: str) -> Any:
        x = self.env.get(v)
        if x is None:
            x = self.externals.get(v)
            if x is None:
                x = self._external(v)
                if v != TANGENT_VALUE or not self.weights().seeds:  # per micro-batch seeds: made at each read
                    self.externals[v] = x
        return x

    def _external(self, name: str) -> Any:
        base, mb = split_mb(name)
        if base.startswith("symexpr:"):
            return self.eval(base[len("symexpr:"):])
        spec = self.ex.specs.get(base)
        if spec is None:
            raise PiperRuntimeError(f"piper: internal: rank {self.rank} has no value {name}")
        args = self.args
        if spec.kind == PARAM:  # segments run under no_grad: no autograd graph is built
            # an expert / tensor-parallel shard, or under mixed precision its compute copy
            return self.state.compute_param(spec.name, args[spec.arg_index])
        if spec.kind == BUFFER:
            return args[spec.arg_index]
        if spec.kind == TANGENT:  # this rank's share of the global batch, per micro-batch loss
            seed = self.weights().seed_of(self.mb if mb is None else mb)
            scaler = self.state.scaler
            return torch.full((), seed if scaler is None else scaler.seed(seed), dtype=self.ex.tangent_dtype,
                              device=self.device)
        if spec.kind == SYM:
            return self.mb_size if spec.batched else int(args[spec.arg_index])
        assert spec.kind == INPUT
        x = args[spec.arg_index] if spec.cast_to is None else args[spec.arg_index].to(spec.cast_to)
        return x.narrow(0, mb * self.mb_size, self.mb_size) if spec.batched and mb is not None else x

    def put(self, v: str, t: Any, gathered: bool = False, count: bool = True) -> None:
        """Store value ``v`` (counted as live activation bytes, or as gathered parameter bytes)."""
        self.env[v] = t
        if not count:
            return
        if gathered:
            self.gathered += tensor_bytes(t)
        else:
            self.live += tensor_bytes(t)

    def put_output(self, v: str, t: Any, root: str | None) -> None:
        """Store a segment's output ``v``; ``root``: the value it is a view of (``sim/segment_memory``):
        its storage is counted once, until the last value sharing it is freed; a view of a parameter or
        batch input (``EXTERNAL``) counts none."""
        self.env[v] = t
        self.live += self.shared.add(v, tensor_bytes(t), root)

    def count_live(self, nbytes: int) -> None:
        self.live += nbytes

    def free(self, v: str) -> None:
        """Drop value ``v``; one an in-flight SEND sends stays counted live until the send completes (the
        communication library holds the tensor until then: ``done``)."""
        b = self.released.pop(v) if v in self.released else tensor_bytes(self.env.pop(v, None))
        shared = self.shared.remove(v)
        if shared is not None:
            b = shared[0]
        send = self.sent_by.pop(v, None)
        if send is not None and send in self.pending:
            self._in_flight[send] = self._in_flight.get(send, 0) + b
        elif v.startswith("param:"):
            self.gathered -= b
        else:
            self.live -= b

    def weights(self) -> Weights:
        """The call check's result (waited for here the first time): every rank makes this call, and how
        this rank's losses weigh in the global mean (``runtime/consistency.py``)."""
        return self.check.resolve()

    # -- asynchronous work --------------------------------------------------------------------------
    def issue(self, ins: Instr, pos: int, work: Any) -> None:
        """Asynchronous ``work`` of instruction ``ins`` is in flight (None: nothing to wait for)."""
        self.pending[ins.node.name] = (work, ins, pos)

    def count(self, purpose: str) -> None:
        self.stats.collectives[purpose] = self.stats.collectives.get(purpose, 0) + 1

    def group(self, stream: str, ranks: tuple[int, ...]) -> Any:
        return self.ex.groups.get(stream, ranks)

    def p2p_group(self, ins: Instr) -> Any:
        return self.ex.groups.get(ins.group_name(self.rank), tuple(range(dist.get_world_size())))

    def all_reduce(self, t: torch.Tensor, stream: str, ranks: tuple[int, ...]) -> Any:
        """Start a SUM all-reduce of ``t`` over ``ranks`` (None on a group of one)."""
        if len(ranks) == 1:
            return None
        return comm.all_reduce(t, self.group(stream, ranks))

    def keep(self, name: str, t: torch.Tensor) -> None:
        """Keep ``t`` alive until collective ``name`` completes."""
        self._keep[name] = t

    def retire_kept(self) -> None:
        """Wait for every in-flight collective holding a kept tensor (at most one full bucket in flight)."""
        for name in list(self._keep):
            self.ex.wait(self, name)

    def send_buffer(self, name: str, t: torch.Tensor) -> None:
        self._sending[name] = t  # alive until collective ``name`` completes

    def on_finish(self, name: str, fn: Callable[[], None]) -> None:
        self.finish[name] = fn

    def done(self, name: str) -> None:
        """Collective ``name`` completed: drop what it kept alive."""
        self._keep.pop(name, None)
        self._sending.pop(name, None)
        self.live -= self._in_flight.pop(name, 0)

    def note_grad_bytes(self, extra: torch.Tensor | None = None) -> None:
        """Gradient buffers changed (``extra``: a full bucket a reduce-scatter still sends, held now)."""
        if self.grads is None:
            return
        self.grad_held = self.grads.nbytes()
        if self.state.zero is not None:
            self.grad_held += self.state.zero.grad_shard_bytes()
        sending = tensor_bytes(extra)
        self.stats.peak_grad_bytes = max(self.stats.peak_grad_bytes, self.grad_held + sending)
        self.sample(sending)

    def sample(self, transient: int = 0) -> None:
        """The peak of everything the step holds together (``StepStats.peak_held_bytes``), now."""
        total = self.live + transient + self.gathered + self.grad_held
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, total)
