"""``piper.autoplan``: plan every strategy of the search space (``space.py``) for a model, a world and a
memory budget without launching anything, predict each one's step time (the simulator under a FLOP /
network cost model) and per-rank peak memory (``memory.plan_memory``), and rank the ones that fit.

Each candidate is a real plan: captured, cut, lowered and verified exactly as ``piper.plan`` does
(candidates that differ only in what acts after capture share one captured graph), so a returned
strategy is one the verifier accepted. Activation checkpointing is tried only where a strategy does
not fit without it, cheapest policy first; strategies whose weights, gradients and optimizer state
alone exceed the budget on average are pruned before planning."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

import torch
from torch import nn

from piper_compile.autoplan.space import (
    BLOCK_TAG, CHECKPOINT_POLICIES, SCHEDULES, STAGE_TAG, Candidate, candidates, with_checkpoint,
)
from piper_compile.autoplan.parallel import default_workers, evaluate_groups
from piper_compile.autoplan.stages import BlockCosts, block_costs, tagged
from piper_compile.errors import PiperError, PiperPlanError
from piper_compile.runtime.registry import plain_tensors

MiB = 2**20
# link bandwidth (bytes/s) and latency (s) per traffic class
NETWORKS: dict[str, dict[str, tuple[float, float]]] = {
    "nvlink": {c: (150e9, 3e-6) for c in ("pp", "dp", "ep", "tp", "loss")},
    "ib": {c: (50e9, 5e-6) for c in ("pp", "dp", "ep", "tp", "loss")},  # 400 Gb/s NDR
    "ethernet": {c: (12.5e9, 20e-6) for c in ("pp", "dp", "ep", "tp", "loss")},  # 100 GbE
    "loopback": {c: (2e9, 50e-6) for c in ("pp", "dp", "ep", "tp", "loss")},  # gloo over 127.0.0.1, one host
}


@dataclass
class Choice:
    """One ranked strategy: its directives (for ``piper.compile`` / ``piper.plan`` after ``annotate``),
    the predicted step time, bubble and per-rank peak memory, and why it ranks above the next one."""

    candidate: Candidate
    directives: list[dict[str, Any]]
    step_time: float
    bubble: float
    peak_mb: dict[int, float]
    block_stages: tuple[int, ...]  # the stage of each block
    blocks_path: str
    dag_text: str = field(default="", repr=False)  # the planned DAG (what piper.plan of the directives gives)
    why: str = ""

    @property
    def max_peak_mb(self) -> float:
        return max(self.peak_mb.values())

    @property
    def local_batch_divisor(self) -> int:
        """The global batch is split over this many replicas (each rank's batch: global / dp)."""
        return self.candidate.dp

    def replica(self, rank: int) -> int:
        """The slice (of ``local_batch_divisor``) of the global batch ``rank`` trains on."""
        return self.candidate.replica(rank)

    def annotate(self, model: nn.Module) -> nn.Module:
        """Tag ``model``'s blocks as this strategy needs (``PP`` = stage, ``AC`` = block with checkpointing)."""
        from piper_compile.capture.annotate import annotate

        for tags in _block_tags(self.candidate, self.block_stages):
            annotate(model.get_submodule(f"{self.blocks_path}.{tags[0]}"), **tags[1])
        return model

    def line(self) -> str:
        return (f"{self.candidate.label():<44} step {self.step_time * 1e3:9.3f} ms  bubble {self.bubble:6.1%}  "
                f"peak {self.max_peak_mb:9.2f} MiB")


@dataclass
class AutoPlan:
    """The ranked strategies that fit (best first), the ones rejected with the reason, and the search."""

    ranked: list[Choice]
    rejected: list[tuple[str, str]]  # (candidate label, why)
    planned: int
    pruned: int
    seconds: float
    stage_flops: dict[int, list[int]] = field(default_factory=dict)  # stages -> FLOPs per stage
    workers: int = 1  # processes that planned side by side

    @property
    def best(self) -> Choice:
        return self.ranked[0]

    def __str__(self) -> str:
        head = (f"# autoplan: {self.planned} plans verified and simulated, {self.pruned} pruned by memory, "
                f"{len(self.rejected)} rejected, in {self.seconds:.1f}s"
                + (f" ({self.workers} processes)" if self.workers > 1 else ""))
        rows = [f"{i + 1:>3}. {c.line()}\n     {c.why}" for i, c in enumerate(self.ranked)]
        return "\n".join([head, *rows])


@plain_tensors
def autoplan(model: nn.Module, *example_batch: Any, world_size: int, memory_mb: float | None = None,
             network: str | dict[str, tuple[float, float]] = "ethernet", flops_per_s: float = 1e12,
             cost: Any = None, optimizer: Any = None, top: int = 5,
             schedules: Iterable[str] = tuple(SCHEDULES), zero_levels: Iterable[int] = (0, 1, 2, 3),
             checkpoint: Iterable[str] = CHECKPOINT_POLICIES, tp_plan: dict[str, str] | None = None,
             options: dict[str, Any] | None = None, time_limit_s: float | None = None,
             workers: int | None = None, expert_load: float = 1.0) -> AutoPlan:
    """Search the strategies piper can build for ``model`` on ``world_size`` ranks and rank them.

    ``example_batch``: one *global* batch (dim 0 is split over data-parallel replicas and micro-batches).
    ``memory_mb``: per-rank budget (MiB) every returned plan's predicted peak fits. ``network``: a preset
    (``NETWORKS``: nvlink, ib, ethernet, loopback), ``"measured"`` (this machine's link between two local
    ranks, ``measure_link``) or ``{"pp"|"dp"|"ep"|"tp": (bytes_per_s, latency_s)}``;
    ``flops_per_s``: the device's compute rate; ``cost``: any ``sim`` cost model instead of both.
    ``optimizer``: counted in memory (default AdamW; ZeRO needs one). ``tp_plan``: the model's
    tensor-parallel layers as ``shard_tensor`` takes them (``{"blocks.*.qkv": "colwise:3", ...}``); with it,
    TP degrees are searched too. ``options``: more ``piper.compile`` options every candidate is planned with
    (e.g. ``mixed_precision``). ``workers``: processes planning side by side, one captured graph each
    (``parallel.py``; default one per core where forking is safe, 1 plans in this process).
    ``expert_load``: an MoE model's expert-parallel candidates are planned with ``shard(load=...)`` (the
    busiest rank's rows over balanced routing; ``piper.stats(step).expert_load`` measures it). Returns
    ``top`` choices (all that fit if ``top`` is None); a budget nothing fits is a ``piper:`` error naming the
    closest strategy."""
    from piper_compile.init.deferred import planning

    with planning(model, example_batch):  # a model built on the meta device: stand-ins while planning
        return _autoplan(model, example_batch, world_size, memory_mb, network, flops_per_s, cost, optimizer, top,
                         schedules, zero_levels, checkpoint, tp_plan, options, time_limit_s, workers, expert_load)


def _autoplan(model: nn.Module, example_batch: tuple[Any, ...], world_size: int, memory_mb: float | None,
              network: Any, flops_per_s: float, cost: Any, optimizer: Any, top: int, schedules: Iterable[str],
              zero_levels: Iterable[int], checkpoint: Iterable[str], tp_plan: dict[str, str] | None,
              options: dict[str, Any] | None, time_limit_s: float | None, workers: int | None,
              expert_load: float) -> AutoPlan:
    t0 = time.perf_counter()
    optimizer = optimizer if optimizer is not None else _default_optimizer()
    cost_model = cost if cost is not None else network_cost(network, flops_per_s)
    costs = block_costs(model, example_batch)
    batch = _batch_size(example_batch)
    space = list(candidates(world_size, len(costs.blocks), batch, _has_experts(model), tuple(schedules),
                            tuple(zero_levels), tensor_parallel=bool(tp_plan)))
    search = _Search(model, example_batch, world_size, costs, {**(options or {}), "optimizer": optimizer},
                     cost_model, memory_mb, [p for p in CHECKPOINT_POLICIES if p in set(checkpoint)],
                     dict(tp_plan or {}), expert_load)
    groups: dict[tuple[int, int], list[tuple[int, Candidate]]] = {}  # one per captured graph
    for i, cand in enumerate(space):
        groups.setdefault(_Search.capture_key(cand), []).append((i, cand))
    n = default_workers(len(groups)) if workers is None else workers
    evaluate_groups(search, list(groups.values()), n, t0, time_limit_s)
    ranked = sorted(search.fits, key=lambda c: (c.step_time, c.max_peak_mb))
    if not ranked:
        raise search.nothing_fits(len(space))
    _explain(ranked)
    return AutoPlan(ranked[:top] if top else ranked, search.rejected, search.planned, search.pruned,
                    time.perf_counter() - t0, {s: costs.stage_flops(s) for s in sorted(search.stage_counts)},
                    min(n, len(groups)))


def _default_optimizer() -> Any:
    import functools

    return functools.partial(torch.optim.AdamW, lr=1e-3)


def network_cost(network: str | dict[str, tuple[float, float]], flops_per_s: float = 1e12) -> Any:
    """The ``FlopCost`` autoplan predicts with: ``flops_per_s`` of compute, links per traffic class."""
    from piper_compile.sim import FlopCost

    if network == "measured":  # this machine's link, every traffic class on it
        from piper_compile.autoplan.profile import measure_link

        link = measure_link()
        network = {c: link for c in ("pp", "dp", "ep", "tp", "loss")}
    if isinstance(network, str):
        if network not in NETWORKS:
            raise PiperError(f"piper: autoplan: unknown network {network!r}; use one of {sorted(NETWORKS)}, "
                             '"measured" or a dict {"pp": (bytes_per_s, latency_s), "dp": ..., "ep": ..., "tp": ...}')
        network = NETWORKS[network]
    links = {k: (float(v[0]), float(v[1])) for k, v in network.items()}
    bw, lat = links.get("dp", next(iter(links.values()), (10e9, 0.0)))
    return FlopCost(flops_per_s=flops_per_s, bytes_per_s=bw, latency_s=lat, links=links)


def _batch_size(batch: tuple[Any, ...]) -> int:
    sizes = {t.shape[0] for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise PiperError(f"piper: autoplan: the example batch's tensors must share dim 0 (the global batch); got "
                         f"sizes {sorted(sizes)}")
    return sizes.pop()


def _has_experts(model: nn.Module) -> bool:
    from piper_compile.nn.moe import MoE

    return any(isinstance(m, MoE) and "EP" in getattr(m, "_piper_tags", {}) for m in model.modules())


def _block_tags(c: Candidate, stages: tuple[int, ...]) -> list[tuple[int, dict[str, int]]]:
    out = []
    for i, s in enumerate(stages):
        tags = {STAGE_TAG: s} if c.pp > 1 else {}
        if c.checkpoint != "none":
            tags[BLOCK_TAG] = i
        if tags:
            out.append((i, tags))
    return out


def _block_nodes(gm: Any) -> list[tuple[Any, dict[str, Any], int]]:
    """The joint graph's nodes inside a block: (node, its other tags, the block's index)."""
    out = []
    for n in gm.graph.nodes:
        custom = n.meta.get("custom") or {}
        if BLOCK_TAG in custom:
            out.append((n, {k: v for k, v in custom.items() if k not in (BLOCK_TAG, STAGE_TAG)}, custom[BLOCK_TAG]))
    return out


def _retag(nodes: list[tuple[Any, dict[str, Any], int]], tags: dict[int, dict[str, int]]) -> None:
    """Give each block's nodes the tags a candidate puts on that block (what tagging the modules before
    capture gives: tags live only in ``meta["custom"]``, and regions are read from there at the cut).
    Each node gets a new dict: segments cut for earlier candidates keep theirs."""
    for node, other, block in nodes:
        node.meta["custom"] = {**other, **tags.get(block, {})}


class _Search:
    """The evaluation of candidates: one captured graph per capture key, one plan per candidate."""

    def __init__(self, model: nn.Module, batch: tuple[Any, ...], world: int, costs: BlockCosts,
                 options: dict[str, Any], cost: Any, memory_mb: float | None, policies: list[str],
                 tp_plan: dict[str, str], expert_load: float) -> None:
        self.model, self.batch, self.world, self.costs, self.tp_plan = model, batch, world, costs, tp_plan
        self.expert_load = expert_load
        self.options, self.optimizer = {k: v for k, v in options.items() if k != "directives"}, options["optimizer"]
        self.cost, self.memory_mb, self.policies = cost, memory_mb, policies
        self.bases: dict[tuple[int, int], tuple[Any, list[tuple[Any, dict[str, Any], int]]]] = {}  # by (dp, tp)
        self.cuts: dict[Any, Any] = {}  # segments cut from a base, shared by candidates that cut it alike
        self.fits: list[Choice] = []
        self.rejected: list[tuple[str, str]] = []
        self.closest: tuple[float, str] | None = None  # smallest peak seen over the budget
        self.planned = self.pruned = 0
        self.stage_counts: set[int] = set()
        self.state_floor = self._state_floor()

    def _state_floor(self) -> tuple[int, int]:
        """Bytes of the trained parameters (``parameters()`` yields a tied weight once) and the optimizer's
        state tensors per parameter element."""
        from piper_compile.memory import optimizer_state_factor

        total = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        return total, optimizer_state_factor(self.optimizer)

    def floor_mb(self, c: Candidate) -> float:
        """A lower bound of the largest rank's persistent bytes: the average over ranks (experts uncounted)."""
        if c.ep or c.tp > 1:  # experts and TP pieces: not modelled here
            return 0.0
        total, factor = self.state_floor
        params = total / c.pp / (c.dp if c.zero >= 3 else 1)
        grads = total / c.pp / (c.dp if c.zero >= 2 else 1)
        state = factor * total / c.pp / (c.dp if c.zero >= 1 else 1)
        return (params + grads + state) / MiB

    def evaluate(self, cand: Candidate) -> None:
        """Plan ``cand``; over the budget, again with each checkpoint policy until one fits."""
        if self.memory_mb is not None and self.floor_mb(cand) > self.memory_mb:
            self.pruned += 1
            self.rejected.append((cand.label(), f"pruned: weights, gradients and optimizer state alone average "
                                                f"{self.floor_mb(cand):.2f} MiB per rank"))
            return
        for policy in self.policies:
            c = with_checkpoint(cand, policy)
            choice = self._plan(c)
            if choice is None:
                return
            if self.memory_mb is None or choice.max_peak_mb <= self.memory_mb:
                self.fits.append(choice)
                return
            if self.closest is None or choice.max_peak_mb < self.closest[0]:
                self.closest = (choice.max_peak_mb, c.label())
        self.rejected.append((cand.label(), f"over memory_mb={self.memory_mb:g} with every checkpoint policy tried"))

    def _plan(self, c: Candidate) -> Choice | None:
        from piper_compile.api import StaticPlan
        from piper_compile.compiled_step import CompiledStep
        from piper_compile.sim import simulate_plan

        stages = self.costs.split(c.stages)
        try:
            directives = c.directives(self.tp_plan, self.expert_load)
            base = self._base(c, stages, directives)
            opts = {**self.options, "directives": directives}
            cs = CompiledStep(base.gm, [], opts, world=(0, self.world), sources=base.sources)
            cs.share_capture(base, self.cuts, repr(_block_tags(c, stages)))
            dag, programs = cs.build(False)
        except PiperError as e:
            self.rejected.append((c.label(), str(e).splitlines()[0]))
            return None
        finally:
            self.planned += 1
        plan = StaticPlan(dag, programs, cs.segments, self.optimizer)
        cs.state.steps.remove(cs)  # a candidate, not a step of the model: nothing keeps it alive
        sim = simulate_plan(plan, self.cost)
        peak = {r: b / MiB for r, b in plan.memory.peaks().items()}
        self.stage_counts.add(c.stages)
        return Choice(c, directives, sim.step_time, sim.bubble, peak, stages, self.costs.path, dag.to_text())

    def _base(self, c: Candidate, stages: tuple[int, ...], directives: list[dict[str, Any]]) -> Any:
        """The captured graph of ``c``'s local batch (captured at the first candidate with it, every block
        tagged with its index), its nodes retagged for ``c``'s stages and checkpoint regions."""
        if self.capture_key(c) not in self.bases:
            from piper_compile.api import capture_step

            local = tuple(t[: t.shape[0] // c.dp] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
                          for t in self.batch)
            with tagged([(b, {BLOCK_TAG: i}) for i, b in enumerate(self.costs.blocks)]):
                base = capture_step(self.model, *local, directives=directives if c.tp > 1 else [],
                                    world_size=self.world, options=self.options)
                base._capture()
            base.state.steps.remove(base)
            self.bases[self.capture_key(c)] = (base, _block_nodes(base.joint.gm))
        base, nodes = self.bases[self.capture_key(c)]
        _retag(nodes, dict(_block_tags(c, stages)))
        return base

    @staticmethod
    def capture_key(c: Candidate) -> tuple[int, int]:
        """Candidates with one key plan on one captured graph: the local batch (``dp``) and tensor
        parallelism (each rank's pieces) change what is captured."""
        return (c.dp, c.tp)

    def close(self) -> None:
        self.bases.clear()
        self.cuts.clear()
        gc.collect()

    def nothing_fits(self, total: int) -> PiperPlanError:
        near = (f"; the smallest predicted peak is {self.closest[0]:.2f} MiB ({self.closest[1]})"
                if self.closest else "")
        return PiperPlanError(f"piper: autoplan: none of the {total} strategies for {self.world} ranks fits "
                              f"memory_mb={self.memory_mb}{near}. Fix: raise memory_mb, use more ranks, or a smaller "
                              "model or batch")


def _explain(ranked: list[Choice]) -> None:
    """Each choice's ``why``: how it compares with the next one down."""
    for i, (a, b) in enumerate(zip(ranked, ranked[1:])):
        diff = ", ".join(f"{f.name} {getattr(a.candidate, f.name)} vs {getattr(b.candidate, f.name)}"
                         for f in fields(Candidate) if getattr(a.candidate, f.name) != getattr(b.candidate, f.name))
        gain = (b.step_time - a.step_time) / b.step_time if b.step_time else 0.0
        if gain >= 5e-4:
            lead = f"{gain:.1%} faster than #{i + 2}"
        elif a.max_peak_mb < b.max_peak_mb:
            lead = f"as fast as #{i + 2} with less memory"
        else:
            lead = f"as fast as #{i + 2} and as large (kept in search order)"
        a.why = (f"{lead} ({diff}): bubble {a.bubble:.1%} vs {b.bubble:.1%}, peak {a.max_peak_mb:.2f} vs "
                 f"{b.max_peak_mb:.2f} MiB")
    if ranked:
        ranked[-1].why = "the slowest strategy that fits"
