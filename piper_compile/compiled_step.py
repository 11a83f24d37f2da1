"""The step the ``piper`` backend returns (``backend.piper_backend``): one call = one training step.

Dynamo hands the backend its FX graph; the ``CompiledStep`` does the work at the first call (outside
Dynamo's compile, so a ``PiperError`` reaches the user as itself): capture the joint graph, cut segments,
run the directive and lowering passes, extract and verify every rank's program, compile this rank's
segments, create process groups, broadcast rank 0's weights, run. Its planned strategy is shared by every
model instance Dynamo runs the compiled code for (``bind``), each with its own training state.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from piper_compile.callmode import trained_loss, training
from piper_compile.runtime import local_call
from piper_compile.capture.joint import BUFFER, INPUT, PARAM, JointGraph, capture_joint, source_names
from piper_compile.capture.segments import Segment, extract_segments
from piper_compile.codegen import accumulate
from piper_compile.recompiles import ran_on_version
from piper_compile.capture.frame_versions import calling_module, release_with
from piper_compile.codegen.compile import CompiledSegment, precompile
from piper_compile.directives.spec import (
    Checkpoint, Replicate, activation_window, checkpoint_of, filter_matches, split_backward_filters,
)
from piper_compile import metrics
from piper_compile.gcwindow import young_only
from piper_compile.memory import check_budget, plan_memory
from piper_compile.errors import PiperError
from piper_compile.ir.dag import Kind, TrainingDAG
from piper_compile.ir.meta import PrecisionMeta
from piper_compile.ir.ops import Segment as SegmentOp
from piper_compile.ir.shard import ParamShard
from piper_compile.passes.build import build_dag
from piper_compile.passes.context import PassContext
from piper_compile.passes.driver import run_passes
from piper_compile.passes.graph import GraphContext, run_graph_passes
from piper_compile.plan import residency
from piper_compile.plan.program import Program, build_programs
from piper_compile.plan.residency import Reads
from piper_compile.plan.verifier import verify_programs
from piper_compile.capture.coupling import refuse_coupling
from piper_compile.capture.items import LossForm, guard_empty_counts, loss_form
from piper_compile.runtime.call_inputs import call_check
from piper_compile.runtime.consistency import CallCheck, CallLayout, call_layout, fingerprint, local_calls, post_failure
from piper_compile.runtime import graph as step_graph
from piper_compile.sim.segment_memory import all_alias_maps
from piper_compile.runtime.executor import Executor
from piper_compile.runtime.groups import GroupRegistry, group_keys, world_info
from piper_compile.capture.retrace import arg_order, retrace
from piper_compile.runtime.registry import ModelLink, check_shared_parameters, link_for, state_for
from piper_compile.runtime.state import TrainState
from piper_compile.runtime.zero import layout_of
from piper_compile.options import Options

@dataclass
class Plan:
    dag: TrainingDAG
    programs: list[Program]
    executor: Executor
    fingerprint: int = 0  # of the DAG's text: equal on every rank that planned the same strategy
    layout: CallLayout | None = None  # what the call check needs (runtime/consistency.py)
    reads: Reads = Reads()  # the parameters and buffers this rank's program reads (must be resident)


@dataclass
class Blueprint:
    """A planned strategy, shared by every model instance the compiled code runs for. What only a run
    needs (the fingerprint of the DAG's text, the call layout) is made on first use: planning alone
    (``piper.plan``, ``autoplan``'s candidates) never pays for them."""

    dag: TrainingDAG
    programs: Sequence[Program]
    world: int

    @functools.cached_property
    def fingerprint(self) -> int:
        return fingerprint(self.dag.to_text())

    @functools.cached_property
    def layout(self) -> CallLayout:
        return call_layout(self.dag, self.world)


_NULL = contextlib.nullcontext()
_TRAINING_CALLS = itertools.count(1)  # orders the training calls of every compiled variant (trained_step)


class CompiledStep:
    """What the backend returns: one call = one training step (or forward only under no_grad)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None,
                 world: tuple[int, int] | None = None, sources: list[str] | None = None,
                 link: ModelLink | None = None) -> None:
        self.gm = gm
        self.link = link if link is not None else link_for(options)  # piper.compile's link to the module
        self.recompile_reason: str | None = None  # set by piper_backend when Dynamo compiled the frame again
        self.frame_code: Any = None  # and the code object of that frame (where Dynamo says)
        self.reused_recompiles = 0  # Dynamo recompiles that traced this step's graph again (piper_backend)
        self.forward_how, self.forward_seconds = "dynamo", 0.0  # the forward's trace (capture/forward_route.py)
        self._arg_order: list[int] | None = None  # mixed precision: the re-traced graph's inputs
        # Read during Dynamo's compile (the backend call): its grapharg metadata is gone afterwards.
        self.sources = sources if sources is not None else source_names(gm)
        self.example_inputs = list(example_inputs)
        self._first_inputs = self.example_inputs  # also in Dynamo's wrapper of this step (a copy of __dict__)
        self.raw_options = options
        self._options: Options | None = None
        self.joint: JointGraph | None = None
        self.segments: dict[str, Segment] = {}
        self.compiled: dict[str, CompiledSegment] = {}
        self.plans: dict[bool, Plan] = {}
        self.tp_shards: dict[str, ParamShard] = {}  # tensor parallel: how capture split each layer
        self.tp_partial: frozenset[str] = frozenset()  # sequence parallel: gradients summed over the TP group
        self.graph_timings: dict[str, float] = {}  # seconds per graph pass (passes/graph.py)
        self.float_constants: dict[int, tuple[str, float]] = {}  # input -> (source, value) compiled as a constant
        self.trained_calls = 0  # training calls so far (options["log_stats"])
        self.last_trained = 0  # when this variant last trained, in the process's order of training calls
        self.flops: dict[tuple[str, tuple[tuple[str, int], ...]], int] = {}  # (segment, symbols) -> FLOPs (metrics.py)
        self.state: TrainState | None = None
        self.rank, self.world = world or world_info()
        # Shared by every model instance this compiled code runs for (see bind): planned strategies
        # by forward_only, and the steps of the other instances by their parameters' ids.
        self.blueprints: dict[bool, Blueprint] = {}
        self._bindings: dict[tuple[int, ...], list[CompiledStep]] = {}
        self._local: Executor | None = None  # piper.local(): forward-only, no communication (per model)
        self._loss_form: LossForm | None = None  # how the loss adds up over pieces (capture/items.py)

    @property
    def options(self) -> Options:
        # Parsed at the first call, not inside Dynamo's compile, so errors reach the user unwrapped.
        if self._options is None:
            self._options = Options.parse(self.raw_options)
        return self._options

    # -- planning ----------------------------------------------------------------------------
    def _graph_passes(self) -> tuple[Any, ...] | None:
        """The graph passes on Dynamo's graph (``passes/graph.py``: tensor-parallel sharding, sequence
        parallel); the local fake inputs when a pass changed parameter shapes."""
        from piper_compile.capture.tensor_parallel import local_fakes

        ctx = run_graph_passes(GraphContext(self.gm, self.sources, self.options.directives, self.world,
                                            list(self.example_inputs)))
        self.tp_shards, self.tp_partial, self.graph_timings = ctx.tp_shards, ctx.tp_partial, ctx.timings
        self.float_constants = ctx.float_constants
        return local_fakes(self.gm, ctx.local_shapes) if ctx.local_shapes is not None else None

    def _bucket_bytes(self, region: Any) -> float | None:
        """The gradient bucket size of a region: the smallest ``bucket_size`` of the ``replicate``
        directives that match it (of all of them for a region none matches; None: no replicate)."""
        reps = [d for d in self.options.directives if isinstance(d, Replicate)]
        caps = [d.bucket_size for d in reps if filter_matches(d.filter, dict(region))] or [d.bucket_size for d in reps]
        return min(caps) * 2**20 if caps else None

    def _in_compute_dtype(self) -> dict[int, torch.dtype]:
        """Mixed precision: Dynamo's graph again, traced with the parameters and forward inputs in the
        compute dtype (``capture/retrace.py``); the inputs the step must cast, by position."""
        if not self.options.precision.active:
            return {}
        module = self.link.module() if self.link is not None else None
        if module is None or self.link is None or self.link.call is None:
            raise PiperError(
                "piper: options['mixed_precision'] needs the model compiled with piper.compile(model, directives=..., "
                "mixed_precision=..., ...) (or planned with piper.plan), not torch.compile(model, backend='piper'): "
                "piper traces the model again with bf16 parameters, so that dtypes it reads from tensors "
                "(x.to(h.dtype)) follow the compute dtype, and Dynamo does not tell a backend which module it traced")
        traced = retrace(module, self.link.call, self.options.precision)
        order = arg_order(self.sources, traced.sources)
        first = self.example_inputs
        cast = {i: t.dtype for i, t in enumerate(traced.inputs) if isinstance(t, torch.Tensor)
                and not isinstance(t, torch.nn.Parameter) and t.dtype != first[order[i]].dtype}
        self.gm, self.example_inputs, self.sources, self._arg_order = traced.gm, traced.inputs, traced.sources, order
        return cast

    def _capture(self) -> None:
        cast = self._in_compute_dtype()
        if self.link is not None:
            self.link.captured()
        fakes = self._graph_passes()
        try:
            self.joint = capture_joint(self.gm, self.example_inputs, self.sources, fakes)
            guard_empty_counts(self.joint)
            for s in self.joint.inputs:
                s.cast_to = cast.get(s.arg_index) if s.kind == INPUT else None
        except PiperError as e:
            if fakes is None:
                raise
            raise PiperError(f"{e}\npiper: (shard_tensor) the graph was captured with each rank's shard of the split "
                             "layers, after capture/tp_shapes.py fitted its view/reshape/expand/split sizes to the "
                             "local shapes; an op it does not check failed on them: write -1 for a split dimension "
                             "(view(b, t, -1, head_dim)) and split fused outputs with chunk()") from e
        self._cut()
        self._drop_inputs()

    def share_capture(self, other: "CompiledStep", cuts: dict[Any, Any] | None = None, key: Any = None) -> None:
        """Plan on ``other``'s captured joint graph instead of capturing again: for steps of one model and
        batch whose directives differ only in what acts after capture (placement, micro-batches, schedule,
        ZeRO, checkpointing; not tensor parallelism or mixed precision, which change the capture).
        ``autoplan`` plans its candidates this way. ``cuts``: segments cut before, by ``key`` (the state of
        ``other``'s graph, e.g. its tags) and ``cut_inputs()``: a step whose cut would read the same reuses
        them (the segments are read-only to planning)."""
        if other.joint is None:
            other._capture()
        self.joint, self.tp_shards, self.tp_partial = other.joint, other.tp_shards, other.tp_partial
        self.graph_timings, self.float_constants = other.graph_timings, other.float_constants
        if cuts is None:
            self._cut()
        else:
            k = (id(other), key, self.cut_inputs())
            if k not in cuts:
                cuts[k] = self._cut_segments()
            self.segments = cuts[k]
            self._new_state()
        self._drop_inputs()

    def _drop_inputs(self) -> None:
        """Drop the references to the first call's parameters and batch, the one Dynamo's wrapper of the
        step shares included (it copied the step's ``__dict__``: the same list, cleared in place)."""
        self._first_inputs.clear()
        self.example_inputs = []

    def cut_inputs(self) -> str:
        """What cutting the joint graph reads of this step's directives and options (``_cut_segments``)."""
        ds = self.options.directives
        checkpoints = [d for d in ds if isinstance(d, Checkpoint)]
        window = activation_window(ds)  # its placement splits tied gradients into parts per device group
        return repr(([(d.filter, d.bucket_size, d.zero >= 3) for d in ds if isinstance(d, Replicate)],
                     split_backward_filters(ds), self.options.remat, checkpoints,
                     window if checkpoints else [(d.filter, d.devices) for d in window.places]))

    def _cut(self) -> None:
        """The joint graph cut into segments for this step's directives, and the training state."""
        self.segments = self._cut_segments()
        self._new_state()

    def _cut_segments(self) -> dict[str, Any]:
        assert self.joint is not None
        split = split_backward_filters(self.options.directives)
        zero3 = [d.filter for d in self.options.directives if isinstance(d, Replicate) and d.zero >= 3]

        def split_bw(region: Any) -> bool:
            return any(filter_matches(f, dict(region)) for f in split)

        def chunk_fw(region: Any) -> bool:
            return any(filter_matches(f, dict(region)) for f in zero3)

        checkpoints = [d for d in self.options.directives if isinstance(d, Checkpoint)]
        return {s.name: s for s in extract_segments(self.joint, self._bucket_bytes, split_bw if split else None,
                                                    chunk_fw if zero3 else None, self.options.remat,
                                                    self.graph_timings, checkpoint_of(checkpoints),
                                                    activation_window(self.options.directives))}

    def _new_state(self) -> None:
        assert self.joint is not None
        self.state = state_for(self.joint.params, self.options.optimizer, self.link and self.link.module(),
                               self.raw_options)
        if self.link is not None and self.link.deferred is not None:
            self.state.deferred = self.link.deferred
        self.state.adopt_precision(self.options.precision)
        self.state.steps.append(self)

    def context(self, forward_only: bool) -> PassContext:
        j = self.joint
        assert j is not None
        return PassContext(self.world, self.segments, **j.batch_facts(), forward_only=forward_only,
                           clip_grad_norm=self.options.clip_grad_norm,
                           loss_scaling=self.options.precision.scaling is not None, tp_partial=self.tp_partial)

    def initial_dag(self, forward_only: bool) -> tuple[TrainingDAG, PassContext]:
        """The DAG the passes start from (one unplaced COMPUTE node per segment) and their context."""
        if self.joint is None:
            self._capture()
        dag = build_dag(list(self.segments.values()), forward_only)
        dag.meta.precision = self._precision_meta()
        dag.meta.codegen = self.options.codegen
        return dag, self.context(forward_only)

    def _precision_meta(self) -> PrecisionMeta | None:
        """Mixed precision as the DAG records it for the simulator (None when nothing is cast)."""
        prec = self.options.precision
        assert self.joint is not None
        floating = [p for p in self.joint.params.values() if p.is_floating_point()]
        if not prec.active or not floating:
            return None
        master = floating[0].dtype
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        return PrecisionMeta(name(master), name(prec.compute(floating[0])), name(prec.reduce(master)))

    def build(self, forward_only: bool) -> tuple[TrainingDAG, list[Program]]:
        """The lowered DAG and every rank's verified program (no process group needed)."""
        bp = self.blueprint(forward_only)
        return bp.dag, bp.programs

    def blueprint(self, forward_only: bool) -> Blueprint:
        """The planned strategy (once per compiled code, whichever model instance asks first)."""
        if self.joint is None:
            self._capture()
        if forward_only not in self.blueprints:
            dag, ctx = self.initial_dag(forward_only)
            dag = run_passes(dag, self.options.directives, ctx)
            programs = build_programs(dag, self.world, self.options.reorder_window)
            verify_programs(programs)
            if self.options.memory_budget_mb is not None and not forward_only:  # before anything runs
                device = self.state.device.type if self.state is not None else "cpu"
                check_budget(plan_memory(dag, programs, self.options.optimizer, device), self.options.memory_budget_mb)
            bp = self.blueprints[forward_only] = Blueprint(dag, programs, self.world)
            if not self.options.local_batch_ops:
                refuse_coupling(self.joint, lambda: bp.layout)
        return self.blueprints[forward_only]

    def plan(self, forward_only: bool) -> Plan:
        """This rank's executable plan (process groups, shard layout, executor), once per model."""
        if forward_only in self.plans:
            return self.plans[forward_only]
        if not forward_only and self.state is not None and self.joint is not None:
            self.state.check_trained(frozenset(self.joint.grad_of.values()), self.options.directives)
        bp = self.blueprint(forward_only)
        dag, programs = bp.dag, bp.programs
        program = programs[self.rank]
        self._compile_segments(program)
        groups = None
        if self.world > 1:
            groups = GroupRegistry(self.options.timeout_s)
            groups.ensure(group_keys(dag, self.world))
        assert self.state is not None and self.joint is not None
        # other pipeline stages' weights and buffers
        unread = residency.unread(dag, programs, program, self.joint.buffers)
        self.state.ensure_zero(layout_of(program), self.joint.params, self.rank)
        self.state.ensure_shards({f: s for f, s in self._shard_specs(dag).items() if f not in unread.params},
                                 self.joint.params, self.rank)
        if not forward_only:  # a forward-only program reads no more than the training one
            self.state.release_unused(unread.params, {f: self.joint.buffers[f] for f in unread.buffers})
        check_shared_parameters(self.state)
        executor = self._executor(program, groups, dag, forward_only)
        self.plans[forward_only] = Plan(dag, programs, executor, bp.fingerprint, bp.layout,
                                    residency.reads_of(program))
        return self.plans[forward_only]

    def _compile_segments(self, program: Program) -> None:
        seg_names = {i.node.op.segment for i in program.instrs if isinstance(i.node.op, SegmentOp)}
        assert self.joint is not None and self.state is not None
        fused = accumulate.plan(program, {**self.joint.params, **self.state.local_params()})
        for name in seg_names:
            if name not in self.compiled:
                self.compiled[name] = CompiledSegment(name, self.segments[name].gm, self.options.codegen)
            self.compiled[name].fuse_gradients(fused.get(name, ()))

    def _local_executor(self) -> Executor:
        """The forward-only program without its loss all-reduce, for ``piper.local()`` calls: made on this
        rank alone, so it creates no process group (that would be collective)."""
        if self._local is None:
            bp = self.blueprint(True)
            program = local_call.alone(bp.programs[self.rank])
            self._compile_segments(program)
            self._local = self._executor(program, None, bp.dag, True)
        return self._local

    def _executor(self, program: Program, groups: GroupRegistry | None, dag: TrainingDAG,
                  forward_only: bool) -> Executor:
        assert self.state is not None and self.joint is not None
        return Executor(program, self.joint, self.compiled, self.state, groups, dag.meta.split or 1,
                        dag.meta.loss_group, self.options.timeout_s, forward_only,
                        self.options.overlap_streams, self.options.codegen, all_alias_maps(dag.segments.values()))

    def _shard_specs(self, dag: TrainingDAG) -> dict[str, tuple[ParamShard, tuple[int, ...], str, str]]:
        """Parameters split across ranks, with this rank's group: experts (``shard``) along the expert
        index, and the layers ``shard_tensor`` split at capture."""
        specs = {f: (ParamShard(f, 0, 1, len(s.group)), s.group, s.stream, "ep") for f, s in dag.meta.ep_params.items()}
        group = next((g for n in dag.of_kind(Kind.COMPUTE) for g in n.attr("tp_groups") or () if self.rank in g), None)
        if group is not None:
            specs.update({f: (spec, group, dag.meta.tp.stream if dag.meta.tp else "tp", "tp") for f, spec in self.tp_shards.items()})
        return specs

    # -- which model a call is for --------------------------------------------------------------
    def bind(self, args: tuple[Any, ...]) -> "CompiledStep":
        """The step of the model these call arguments belong to. Dynamo runs one compiled code for every
        instance of a model class whose guards pass (two models with equal options included), so the
        parameters a call passes, not the ones captured, say which model trains: each instance gets its
        own step (its own training state and executors) sharing this one's capture, plans and compiled
        segments."""
        if self.joint is None:
            self._capture()
        if self._is_mine(args):
            return self
        key = tuple(id(args[s.arg_index]) for s in self._slots())
        for other in self._bindings.get(key, ()):
            if other._is_mine(args):
                return other
        other = self._clone_for(args)
        self._bindings.setdefault(key, []).append(other)
        return other

    def _slots(self) -> list[Any]:
        assert self.joint is not None
        return [s for s in self.joint.inputs if s.kind in (PARAM, BUFFER)]

    def _is_mine(self, args: tuple[Any, ...]) -> bool:
        assert self.joint is not None
        own = {**self.joint.params, **self.joint.buffers}
        return all(args[s.arg_index] is own.get(s.name) for s in self._slots())

    def release(self) -> None:
        """The model this step was compiled for is gone (``capture/frame_versions.release_with``): drop its
        tensors and training state, which Dynamo's compiled version of the frame keeps alive otherwise (a
        sweep compiling model after model kept every one). Steps bound to other models keep theirs."""
        self._drop_inputs()
        self.plans.clear()  # in place: Dynamo's wrapper shares the dict
        self.state, self._local = None, None
        if self.joint is not None:
            self.joint = dataclasses.replace(self.joint, params={}, buffers={})

    def _clone_for(self, args: tuple[Any, ...]) -> "CompiledStep":
        assert self.joint is not None
        other = copy.copy(self)  # shares the capture, segments, compiled segments and blueprints
        params = {s.name: args[s.arg_index] for s in self.joint.inputs if s.kind == PARAM}
        buffers = {s.name: args[s.arg_index] for s in self.joint.inputs if s.kind == BUFFER}
        other.joint = dataclasses.replace(self.joint, params=params, buffers=buffers)
        other.plans = {}
        other._bindings = {}
        other._local = None
        other.state = state_for(params, self.options.optimizer, self.link and self.link.module())
        other.state.adopt_precision(self.options.precision)
        other.state.steps.append(other)
        owner = calling_module(list(params.values()))  # the model this call is for: release its state with it
        if owner is not None:
            release_with(owner, other)
            ran_on_version(owner, self.frame_code)
        return other

    # -- running -------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> tuple[torch.Tensor]:
        # a step whose model is gone (``release``: no state) only binds other models' calls: not fresh
        fresh = self.joint is None or self.state is not None and (
            not self.state.first_call_done or (not training()) not in self.plans)
        with young_only() if fresh else _NULL:  # capture, planning and loading code allocate heavily
            return self._enter(args)

    def _enter(self, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
        try:
            if self.joint is None:
                self._capture()
            if self._arg_order is not None:  # mixed precision: in the order of the graph traced in bf16
                args = tuple(args[i] for i in self._arg_order)
            step = self.bind(args)
            if not local_calls():
                step.blueprint(forward_only=not training())
        except Exception:
            if not local_calls():  # the other ranks must not wait for this one: tell them it failed
                post_failure(self.rank, self.world, _leading_size(args), len(args), not training(),
                             self.options.timeout_s if self._options is not None else 60.0)
            raise
        return step._call(args)

    def _call(self, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
        train = training()
        self._check_inputs(args)
        if local_calls():
            return (self._local_call(args, train),)
        assert self.state is not None and self.joint is not None
        bp = self.blueprint(forward_only=not train)
        check = call_check(self.joint, self._form(), args, (self.state.index, bp.fingerprint, self.state.calls),
                           not train, bp.layout, self.rank, self.world, self.options.timeout_s)
        record = check.record
        self.state.calls += 1
        if (not train) not in self.plans or not self.state.broadcast_done or self.state.pending:
            check.resolve()  # before this call creates process groups, broadcasts or loads anything
        plan = self.plan(forward_only=not train)
        first = not self.state.first_call_done
        with torch.profiler.record_function("piper::initialize") if first else _NULL:
            if not self.state.broadcast_done:
                self._first_values()
            self.state.shard()
            residency.check_resident(plan.reads, self.state, self.rank,
                                     "training program" if train else "forward-only program")
            self.state.ready(self)  # deferred checkpoint loads (piper_compile.checkpoint), before the step computes
            if first:  # every segment this rank runs, before it waits on a peer
                precompile(self.compiled, self.joint.symbol_values(args, record.batch // plan.executor.m),
                           self.state.device, self.rank)
        if first and self.state.deferred is not None:  # a meta model is initialized: its fallback values can go
            self.state.deferred.replayer.clear()
        loss = self._run(plan.executor, list(args), check, train)
        if train:
            self.last_trained = next(_TRAINING_CALLS)
            self._log_stats()
            loss = trained_loss(loss)
        return (loss,)

    def _run(self, executor: Any, args: list[Any], check: CallCheck, train: bool) -> torch.Tensor:
        """The step on this rank: as planned, or under ``options["cuda_graph"]`` recorded once and replayed."""
        if not (train and self.options.cuda_graph):
            with _NULL if train else torch.no_grad():  # callmode.forward_only calls come with grad mode on
                return executor.run(args, check)
        if executor.graph is None:
            assert self.state is not None and self.joint is not None
            step_graph.refuse(self.state.device, self.world, self.options.optimizer is not None, self.state.scaler is not None)
            inputs = frozenset(s.arg_index for s in self.joint.inputs if s.kind == INPUT and s.arg_index is not None)
            executor.graph = step_graph.StepGraph(executor, inputs)
        return executor.graph.run(args, check)

    def _first_values(self) -> None:
        """Every replica starts from the same weights: rank 0's, broadcast; or, for a model built on the
        meta device, each rank's own pieces initialized (``init/deferred.py``) and only its real
        tensors broadcast."""
        assert self.state is not None and self.joint is not None
        tensors = [self.joint.params[f] for f in sorted(self.joint.params)]
        tensors += [self.joint.buffers[f] for f in sorted(self.joint.buffers)]
        deferred = self.state.deferred
        if deferred is not None:
            from piper_compile.init.deferred import materialize_state

            materialize_state(self.state, self.joint.buffers, deferred)
            tensors = [t for t in tensors if deferred.key(t) is None]
        self.state.broadcast_from_rank0(tensors)

    def _log_stats(self) -> None:
        """``options["log_stats"] = N``: ``piper.stats``'s line at INFO every N training steps."""
        every = self.options.log_stats
        self.trained_calls += 1
        if every and self.trained_calls % every == 0 and metrics.LOG.isEnabledFor(logging.INFO):
            metrics.LOG.info("piper rank %d step %d: %s", self.rank, self.trained_calls, metrics.metrics_of(self).line())

    def _local_call(self, args: tuple[Any, ...], train: bool) -> torch.Tensor:
        """A call inside ``piper.local()``: this rank alone, forward-only, no communication."""
        assert self.state is not None
        local_call.check_local_call(train, self.state.broadcast_done)
        executor = self._local_executor()
        residency.check_resident(residency.reads_of(executor.program), self.state, self.rank, "piper.local() program")
        bp = self.blueprint(True)
        assert self.joint is not None
        layout = CallLayout(bp.layout.microbatches, (0,), 1, (0,))
        with torch.no_grad():  # callmode.forward_only calls come with grad mode on
            return executor.run(list(args), call_check(self.joint, self._form(), args,
                                                       (self.state.index, bp.fingerprint, -1), True, layout, 0, 1, 0.0))

    def _form(self) -> LossForm:
        """How the loss adds up over micro-batches and replicas (``capture/items.py``)."""
        if self._loss_form is None:
            assert self.joint is not None
            self._loss_form = loss_form(self.joint)
        return self._loss_form

    def _check_inputs(self, args: tuple[Any, ...]) -> None:
        if self.joint is None:
            self._capture()
        for s in self.joint.inputs:
            if s.kind == INPUT and s.arg_index is not None and not isinstance(args[s.arg_index], torch.Tensor):
                raise PiperError(f"piper: input {s.name!r} must be a tensor")
        for i, (src, value) in self.float_constants.items():
            now = float(args[i])
            if now != value:
                raise PiperError(
                    f"piper: {src} was {value!r} when this step was compiled and is {now!r} now: piper compiles the "
                    "model's float attributes as constants (as torch._dynamo.config.specialize_float does); keep it "
                    "constant, or call torch._dynamo.reset() and compile the model again")


def _leading_size(args: tuple[Any, ...]) -> int:
    """The leading size of the first tensor argument (what a failed call reports as its batch)."""
    return next((int(a.shape[0]) for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), 0)
