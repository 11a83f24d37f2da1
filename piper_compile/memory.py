"""Memory per rank: ``piper_compile.memory_report(step)`` gives the bytes of parameters (in their own dtype:
under mixed precision the fp32 master weights), mixed precision's compute copies, gradients, optimizer state
and peak activations (in the dtype the step computes in), measured from the runtime's own buffers, beside
the simulator's prediction for the same programs. ``plan_memory`` is that prediction alone, for a plan
that has not run (``piper.plan(...).memory``, ``explain``), with the step where the peak happens and the
values live there; ``check_budget`` rejects a plan over ``options["memory_budget_mb"]`` before it runs."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch


# optimizer state tensors per parameter element (torch.optim defaults); others count as Adam-like
_STATE_PER_PARAM = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                    "RMSprop": 1, "Adadelta": 2, "Rprop": 2, "ASGD": 2}
MiB = 2**20
# Which step runs when decides what is live: while a step waits for a peer, the executor runs its overlap
# partner or fillers first (runtime/executor.py). The memory simulation lets communication take 10 forward
# steps, so every such step whose own inputs are local runs ahead, as it does whenever peers are late
# (measured on gloo: 14 strategies within 6%, most exact, tests/dist/test_memory_matrix.py). With fast links
# (UniformCost(comm=0)) GPipe's last stage runs its backward in order and peaks higher (0.59 vs 0.47 MiB).
MEMORY_COMM_S = 10.0


@dataclass
class MemoryFigures:
    """Bytes on one rank. ``params``/``grads``/``optimizer`` persist between steps (ZeRO shards count as
    shards); ``peak_*`` are the most bytes held at once during the last step."""

    params: int = 0
    compute_copies: int = 0  # mixed precision: the param_dtype copies kept between steps
    grads: int = 0
    optimizer: int = 0
    peak_activations: int = 0
    peak_gathered_params: int = 0  # ZeRO-3 all-gathered parameters
    peak_grad_buckets: int = 0  # gradient buffers during the step (ZeRO-2/3 full buckets are transient)
    optimizer_step: int = 0  # temporaries the optimizer step holds (runtime/optimizer_memory.py)
    peak_held: int = 0  # activations, gathered parameters and gradient buffers held at once

    @property
    def persistent(self) -> int:
        return self.params + self.compute_copies + self.grads + self.optimizer

    @property
    def peak_total(self) -> int:
        """Persistent state plus the most the step holds at once: activations, ZeRO-3 gathered parameters
        and gradient buffers together (``peak_held``) -- or the optimizer step's temporaries beside the
        gradients, where larger: the update runs after the backward freed the rest."""
        grads = max(self.grads, self.peak_grad_buckets)
        return (self.params + self.compute_copies + self.optimizer
                + max(self.peak_held, grads + self.optimizer_step))

    def line(self) -> str:
        return "  ".join(f"{f.name} {getattr(self, f.name) / MiB:.3f}" for f in fields(self))


@dataclass
class MemoryReport:
    """This rank's measured figures and the simulator's prediction for the same program."""

    rank: int
    measured: MemoryFigures
    predicted: MemoryFigures

    def format(self) -> str:
        return (f"rank {self.rank} memory (MiB)\n  measured   {self.measured.line()}\n"
                f"  predicted  {self.predicted.line()}")

    def __str__(self) -> str:
        return self.format()


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _measured(cs: Any) -> MemoryFigures:
    plan = cs.plans[False]
    ex = plan.executor
    st = cs.state
    # every parameter storage the process holds (another stage's weights are released, ZeRO-3 keeps shards)
    tensors = [cs.joint.params[f] for f in sorted(cs.joint.params)]
    zero = st.zero
    if zero is not None:
        tensors += [b.shard for b in zero.buckets.values() if b.shard is not None]
    tensors += list(st.local_params().values())  # expert / tensor-parallel pieces (the full weights hold none)
    grads = ex.grads.nbytes() if ex.grads is not None else 0
    if zero is not None:
        grads += zero.grad_shard_bytes()  # 0 between steps: shards are dropped after the update
    opt = st.optimizer
    opt_tensors = [t for s in (opt.state.values() if opt is not None else ()) for t in s.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
    s = ex.stats
    copies = sum(t.numel() * t.element_size() for t in st.compute_copies())
    return MemoryFigures(_storage_bytes(tensors), copies, grads, _storage_bytes(opt_tensors), s.peak_live_bytes,
                         s.peak_gathered_bytes, s.peak_grad_bytes, st.optimizer_step_bytes, s.peak_held_bytes)


def optimizer_state_factor(opt: Any) -> int:
    """Optimizer state tensors per parameter element of ``opt``: an optimizer, its class, or a
    ``functools.partial`` of it (plain SGD without momentum keeps none; unknown ones count as Adam-like)."""
    if opt is None:
        return 0
    kind = getattr(opt, "func", opt)
    name = kind.__name__ if isinstance(kind, type) else type(opt).__name__
    if name == "SGD":
        momentum = (opt.param_groups[0].get("momentum") if hasattr(opt, "param_groups")
                    else getattr(opt, "keywords", {}).get("momentum"))
        return 1 if momentum else 0
    return _STATE_PER_PARAM.get(name, 2)


@dataclass
class RankMemory:
    """One rank's predicted memory: the figures, the step at its activation peak (program position and
    label) and the values live there with their bytes, largest first."""

    rank: int
    figures: MemoryFigures
    peak_pos: int
    peak_instr: Any  # the instruction at ``peak_pos`` (its class representative's, for a folded plan) or None
    live_at_peak: list[tuple[str, int]]

    @property
    def peak_step(self) -> str:
        """The label of the step at the activation peak, naming this rank's own peer."""
        ins = self.peak_instr
        if ins is None:
            return "-"
        return ins.node.short(ins.node.op.peer(ins.node, self.rank)) if ins.peer is not None else ins.short()

    def contributors(self, n: int = 5) -> list[tuple[str, int]]:
        """The ``n`` largest parts of the peak: state by kind and the largest activations live at it."""
        from piper_compile.sim.memory_walk import INSIDE, TEMP

        f = self.figures
        parts = [("parameters", f.params), ("compute copies", f.compute_copies),
                 ("gradients", max(f.grads, f.peak_grad_buckets)), ("optimizer state", f.optimizer),
                 ("gathered ZeRO-3 parameters", f.peak_gathered_params)]
        if f.optimizer_step > f.peak_activations + f.peak_gathered_params:  # the peak is the update
            return sorted([p for p in parts[:4] if p[1] > 0] + [("optimizer step temporaries", f.optimizer_step)],
                          key=lambda p: -p[1])[:n]
        parts += [(_label(v, TEMP, INSIDE), b) for v, b in self.live_at_peak]
        return sorted((p for p in parts if p[1] > 0), key=lambda p: -p[1])[:n]

    def format(self) -> str:
        top = ", ".join(f"{name} {b / MiB:.3f}" for name, b in self.contributors())
        return (f"rank {self.rank}: peak {self.figures.peak_total / MiB:.3f} MiB (activations peak at step "
                f"#{self.peak_pos} {self.peak_step})\n  {self.figures.line()}\n  largest (MiB): {top}")

    def __str__(self) -> str:
        return self.format()


def _label(v: str, temp: str, inside: str) -> str:
    if v.startswith(temp):
        return f"gradient {v[len(temp):]} while written"
    if v.startswith(inside):
        return f"intermediates of {v[len(inside):]} while it runs"
    return f"activation {v}"


class RankMemories(Mapping[int, RankMemory]):
    """Every rank's predicted memory (rank -> ``RankMemory``, ascending), kept once per class of identical
    programs: ``reps`` (representative -> its memory) and ``classes`` (representative -> its ranks)."""

    def __init__(self, reps: dict[int, RankMemory], classes: dict[int, tuple[int, ...]]) -> None:
        self.reps, self.classes = reps, classes
        self._rep_of: dict[int, int] | None = None

    def _reps(self) -> dict[int, int]:
        if self._rep_of is None:
            self._rep_of = dict(sorted((r, rep) for rep, ranks in self.classes.items() for r in ranks))
        return self._rep_of

    def __getitem__(self, rank: int) -> RankMemory:
        rep = self._reps()[rank]
        m = self.reps[rep]
        return m if rep == rank else dataclasses.replace(m, rank=rank)

    def __iter__(self) -> Iterator[int]:
        return iter(self._reps())

    def __len__(self) -> int:
        return sum(len(ranks) for ranks in self.classes.values())

    def peaks(self) -> dict[int, int]:
        """Rank -> predicted peak bytes, without making every rank's ``RankMemory``."""
        return {r: self.reps[rep].figures.peak_total for r, rep in self._reps().items()}


def plan_memory(dag: Any, programs: Sequence[Any], optimizer: Any = None, device_type: str = "cpu") -> RankMemories:
    """Every rank's predicted memory for planned ``programs`` (``optimizer``: the optimizer, its class or a
    partial of it, for the state it keeps per parameter element and the temporaries its step holds on
    ``device_type``, where its default implementation differs)."""
    from piper_compile.runtime.optimizer_memory import step_transient
    from piper_compile.sim.cost import UniformCost
    from piper_compile.sim.shapes import Sizes
    from piper_compile.sim.simulate import copy_bytes, simulate, trained_tensors

    res = simulate(programs, UniformCost(comm=MEMORY_COMM_S), dag)
    sizes = Sizes.from_dag(dag)
    factor = optimizer_state_factor(optimizer)
    reps: dict[int, RankMemory] = {}
    # a quotient simulation: each class's figures once, from its representative's program
    classes = res.classes or {p.rank: (p.rank,) for p in programs}
    for rep in classes:
        p = programs[rep]
        trained = trained_tensors(p, sizes)
        figures = MemoryFigures(res.param_bytes[rep], copy_bytes(p, sizes), res.grad_bytes[rep],
                                factor * sum(trained), res.peak_activation_bytes[rep],
                                res.peak_gathered_bytes.get(rep, 0), res.peak_grad_bytes.get(rep, 0),
                                step_transient(optimizer, trained, device_type), res.peak_held_bytes.get(rep, 0))
        pos = res.peak_activation_pos.get(rep, -1)
        ins = p.instrs[pos] if 0 <= pos < len(p.instrs) else None
        reps[rep] = RankMemory(rep, figures, pos, ins, res.live_at_peak.get(rep, []))
    return RankMemories(reps, classes)


def check_budget(memory: dict[int, RankMemory], budget_mb: float) -> None:
    """A ``piper:`` error when some rank's predicted peak exceeds ``budget_mb`` MiB: the worst rank, the step
    where its activations peak and the largest contributors."""
    from piper_compile.errors import PiperPlanError

    over = [m for m in memory.values() if m.figures.peak_total > budget_mb * MiB]
    if not over:
        return
    worst = max(over, key=lambda m: m.figures.peak_total)
    top = ", ".join(f"{name} {b / MiB:.2f} MiB" for name, b in worst.contributors())
    raise PiperPlanError(
        f"piper: the plan needs {worst.figures.peak_total / MiB:.2f} MiB on rank {worst.rank} (ranks over the budget: "
        f"{[m.rank for m in over]}), above options['memory_budget_mb']={budget_mb:g}; its activations peak at step "
        f"#{worst.peak_pos} {worst.peak_step}; largest: {top}. Fix: shard more (replicate(zero=2 or 3)), use more "
        "pipeline stages or micro-batches, checkpoint activations (piper.checkpoint), or raise the budget")


def _predicted(cs: Any) -> MemoryFigures:
    plan = cs.plans[False]
    return plan_memory(plan.dag, plan.programs, cs.state.optimizer, cs.state.device.type)[cs.rank].figures


def report_of(cs: Any) -> MemoryReport:
    """Memory of this rank for the training variant ``cs`` (``compiled_step.CompiledStep``, after at least one
    training call): ``piper.memory_report``."""
    from piper_compile.runtime.registry import plain_tensors

    return plain_tensors(lambda: MemoryReport(cs.rank, _measured(cs), _predicted(cs)))()
