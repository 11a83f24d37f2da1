"""The ``piper`` torch.compile backend.

Dynamo hands us its FX graph; the backend returns a ``CompiledStep`` at once and does the work at the
first call (outside Dynamo's compile, so a ``PiperError`` reaches the user as itself): capture the
joint graph, cut segments, run the directive and lowering passes, extract and verify every rank's
program, compile this rank's segments, create process groups, broadcast rank 0's weights, run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx, nn

from piper_compile.capture.joint import INPUT, JointGraph, capture_joint, find_batch_constant, source_names
from piper_compile.capture.segments import Segment, extract_segments
from piper_compile.codegen.compile import CompiledSegment
from piper_compile.directives.spec import (
    Directive, Place, Replicate, ShardTensor, filter_matches, parse_directives, split_backward_filters,
)
from piper_compile.errors import PiperDirectiveError, PiperError
from piper_compile.ir.dag import Kind, TrainingDAG, param_fqn
from piper_compile.ir.shard import ParamShard
from piper_compile.passes.build import build_dag
from piper_compile.passes.context import PassContext
from piper_compile.passes.driver import run_passes
from piper_compile.plan.program import Program, build_programs
from piper_compile.plan.verifier import verify_programs
from piper_compile.runtime.executor import Executor
from piper_compile.runtime.groups import GroupRegistry, group_keys, world_info
from piper_compile.runtime.state import TrainState
from piper_compile.runtime.zero import layout_of

_OPTION_KEYS = {"directives", "optimizer", "codegen", "timeout", "clip_grad_norm", "remat", "overlap_streams",
                "reorder_window"}


@dataclass
class Options:
    directives: list[Directive]
    optimizer: Callable[..., torch.optim.Optimizer] | None
    codegen: str
    timeout_s: float
    clip_grad_norm: float | None = None
    remat: bool = True  # recompute cheap activations in the backward instead of keeping them (capture/remat.py)
    overlap_streams: bool = True  # CUDA: an overlap slot's two compute steps on two streams (runtime/executor.py)
    reorder_window: int = 8  # gloo: compute steps ahead a waiting step may let run first (runtime/reorder.py)

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> "Options":
        options = dict(options or {})
        unknown = set(options) - _OPTION_KEYS
        if unknown:
            raise PiperError(f"piper: unknown option(s) {sorted(unknown)}; the piper backend takes {sorted(_OPTION_KEYS)}")
        codegen = options.get("codegen", os.environ.get("PIPER_CODEGEN", "inductor"))
        if codegen not in ("inductor", "eager"):
            raise PiperError(f"piper: options['codegen'] must be 'inductor' or 'eager', got {codegen!r}")
        opt = options.get("optimizer")
        if opt is not None and not callable(opt):
            raise PiperError("piper: options['optimizer'] must be a callable params -> torch.optim.Optimizer, e.g. "
                             f"functools.partial(torch.optim.AdamW, lr=3e-4); got {type(opt).__name__}")
        raw_timeout = options.get("timeout", os.environ.get("PIPER_TIMEOUT", 300))
        try:
            timeout = float(raw_timeout)
        except (TypeError, ValueError):
            raise PiperError(f"piper: options['timeout'] must be a number of seconds, got {raw_timeout!r}") from None
        if timeout <= 0:
            raise PiperError(f"piper: options['timeout'] must be > 0 seconds, got {timeout}")
        clip = options.get("clip_grad_norm")
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0:
                raise PiperError(f"piper: options['clip_grad_norm'] must be a positive number (the max global "
                                 f"gradient norm), got {clip!r}")
            if opt is None:
                raise PiperError("piper: options['clip_grad_norm'] clips before piper's optimizer step, so it needs "
                                 "options['optimizer']; without one, clip param.grad yourself after the call")
        remat = _flag(options, "remat", "PIPER_REMAT", "recompute cheap activations such as GELU and layer-norm "
                      "outputs in the backward instead of keeping them")
        overlap = _flag(options, "overlap_streams", "PIPER_OVERLAP_STREAMS",
                        "on CUDA, run the two compute steps of an overlap slot on two streams")
        window = options.get("reorder_window", os.environ.get("PIPER_REORDER_WINDOW", "8"))
        if isinstance(window, str) and window.isdigit():
            window = int(window)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            where = "options['reorder_window']" if "reorder_window" in options else "PIPER_REORDER_WINDOW"
            raise PiperError(f"piper: {where} must be a whole number >= 0 (how many compute steps "
                             "ahead the runtime may run while a step waits for its input; 0 keeps program order "
                             f"except for overlap slots), got {window!r}")
        directives = parse_directives(options.get("directives"))
        for d in directives:
            if isinstance(d, Replicate) and d.zero > 0 and opt is None:
                raise d.error(f"zero={d.zero} shards optimizer state, so piper must run the optimizer",
                              "pass options['optimizer'], e.g. functools.partial(torch.optim.AdamW, lr=3e-4)")
        return cls(directives, opt, codegen, timeout, None if clip is None else float(clip), remat, overlap, window)


def _flag(options: dict[str, Any], key: str, env: str, meaning: str) -> bool:
    """A boolean option, on unless the option or its environment variable (``=0``) turns it off."""
    value = options.get(key, os.environ.get(env, "1") != "0")
    if not isinstance(value, bool):
        raise PiperError(f"piper: options[{key!r}] must be True ({meaning}) or False, got {value!r}")
    return value


# One TrainState per model, found through any of its parameters (shared by the grad/no-grad programs).
_STATES: dict[int, TrainState] = {}


def find_state(params: list[nn.Parameter]) -> TrainState | None:
    """The TrainState that holds any of ``params`` (ids are checked against the objects: ids get reused)."""
    for p in params:
        st = _STATES.get(id(p))
        if st is not None and any(q is p for q in st.params):
            return st
    return None


def state_for(params: list[nn.Parameter], factory: Callable[..., torch.optim.Optimizer] | None) -> TrainState:
    st = find_state(params)
    if st is not None:
        if st.factory is None:
            st.factory = factory
        return st
    st = TrainState(params, factory)
    for p in params:
        _STATES[id(p)] = st
    return st


@dataclass
class Plan:
    dag: TrainingDAG
    programs: list[Program]
    executor: Executor


class _NoopBackward(torch.autograd.Function):
    """Lets ``loss.backward()`` on the returned loss run and do nothing (the step already did it)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        return None, None


_ANCHOR = torch.zeros((), requires_grad=True)


class CompiledStep:
    """What the backend returns: one call = one training step (or forward only under no_grad)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None,
                 world: tuple[int, int] | None = None, sources: list[str] | None = None) -> None:
        self.gm = gm
        # Read during Dynamo's compile (the backend call): its grapharg metadata is gone afterwards.
        self.sources = sources if sources is not None else source_names(gm)
        self.example_inputs = list(example_inputs)
        self.raw_options = options
        self._options: Options | None = None
        self.joint: JointGraph | None = None
        self.segments: dict[str, Segment] = {}
        self.compiled: dict[str, CompiledSegment] = {}
        self.plans: dict[bool, Plan] = {}
        self.tp_shards: dict[str, ParamShard] = {}  # tensor parallel: how capture split each layer
        self.tp_partial: frozenset[str] = frozenset()  # sequence parallel: gradients summed over the TP group
        self.state: TrainState | None = None
        self.rank, self.world = world or world_info()

    @property
    def options(self) -> Options:
        # Parsed at the first call, not inside Dynamo's compile, so errors reach the user unwrapped.
        if self._options is None:
            self._options = Options.parse(self.raw_options)
        return self._options

    # -- planning ----------------------------------------------------------------------------
    def _tensor_parallel(self) -> tuple[Any, ...] | None:
        """``shard_tensor``: mark and split the linear layers in Dynamo's graph; the local fake inputs."""
        from piper_compile.capture.tensor_parallel import local_fakes, shard_linears

        dirs = [d for d in self.options.directives if isinstance(d, ShardTensor)]
        if not dirs:
            return None
        if len(dirs) > 1:
            raise dirs[1].error("a second shard_tensor directive", "list every layer in one shard_tensor's params")
        d = dirs[0]
        if d.devices is not None:
            size = len(d.devices[0])
        elif any(isinstance(x, Place) for x in self.options.directives):
            raise d.error("with place directives, shard_tensor needs 'devices' (its tensor-parallel groups)",
                          'add "devices": [[0, 1], [2, 3]] (ranks of one group see the same batch)')
        else:
            size = self.world
        self.tp_shards, shapes = shard_linears(self.gm, self.sources, d.params, size)
        if d.sequence_parallel:
            from piper_compile.capture.sequence_parallel import split_sequence

            self.tp_partial = split_sequence(self.gm, self.sources, d.seq_dim, size)
        return local_fakes(self.gm, shapes)

    def _capture(self) -> None:
        fakes = self._tensor_parallel()
        try:
            self.joint = capture_joint(self.gm, self.example_inputs, self.sources, fakes)
        except PiperError as e:
            if fakes is None:
                raise
            raise PiperError(f"{e}\npiper: (shard_tensor) the graph was captured with each rank's shard of the split "
                             "layers, after capture/tp_shapes.py fitted its view/reshape/expand/split sizes to the "
                             "local shapes; an op it does not check failed on them: write -1 for a split dimension "
                             "(view(b, t, -1, head_dim)) and split fused outputs with chunk()") from e
        caps = [d.bucket_size for d in self.options.directives if isinstance(d, Replicate)]
        bucket_bytes = min(caps) * 2**20 if caps else None
        split = split_backward_filters(self.options.directives)
        zero3 = [d.filter for d in self.options.directives if isinstance(d, Replicate) and d.zero >= 3]

        def split_bw(region: Any) -> bool:
            return any(filter_matches(f, dict(region)) for f in split)

        def chunk_fw(region: Any) -> bool:
            return any(filter_matches(f, dict(region)) for f in zero3)

        self.segments = {s.name: s for s in extract_segments(self.joint, bucket_bytes, split_bw if split else None,
                                                             chunk_fw if zero3 else None, self.options.remat)}
        self.state = state_for(list(self.joint.params.values()), self.options.optimizer)
        self.state.steps.append(self)
        self.example_inputs = []  # drop references to the first batch

    def context(self, forward_only: bool) -> PassContext:
        j = self.joint
        assert j is not None
        batched = {s.value for s in j.inputs if s.batched}
        static_op = find_batch_constant(j.dynamo_gm, j.batch_size, j.batch_symbols)
        return PassContext(self.world, self.segments, batched, {str(x) for x in j.batch_symbols},
                           j.batch_size, forward_only, static_op, clip_grad_norm=self.options.clip_grad_norm,
                           tp_partial=self.tp_partial)

    def build(self, forward_only: bool) -> tuple[TrainingDAG, list[Program]]:
        """The lowered DAG and every rank's verified program (no process group needed)."""
        if self.joint is None:
            self._capture()
        ctx = self.context(forward_only)
        dag = run_passes(build_dag(list(self.segments.values()), forward_only), self.options.directives, ctx)
        programs = build_programs(dag, self.world)
        verify_programs(programs)
        return dag, programs

    def plan(self, forward_only: bool) -> Plan:
        if forward_only in self.plans:
            return self.plans[forward_only]
        dag, programs = self.build(forward_only)
        program = programs[self.rank]
        seg_names = {i.node.attr("segment") for i in program.instrs
                     if i.node.attr("segment") and not i.node.attr("ep_role") and not i.node.attr("tp_role")}
        for name in seg_names:
            if name not in self.compiled:
                self.compiled[name] = CompiledSegment(name, self.segments[name].gm, self.options.codegen)
        groups = None
        if self.world > 1:
            groups = GroupRegistry(self.options.timeout_s)
            groups.ensure(group_keys(dag, self.world))
        assert self.state is not None and self.joint is not None
        self.state.ensure_zero(layout_of(program), self.joint.params, self.rank)
        self.state.ensure_shards(self._shard_specs(dag), self.joint.params, self.rank)
        if dag.meta.get("zero") and not forward_only:
            self.state.release_unused(_unread_params(dag, program))
        dp = len(dag.meta["loss_group"]) // dag.meta.get("tp_size", 1)  # ranks of a TP group share a batch
        executor = Executor(program, self.joint, self.compiled, self.state, groups, dag.meta["split"],
                            dp, dag.meta["loss_group"], self.options.timeout_s,
                            forward_only, self.options.overlap_streams, self.options.reorder_window)
        self.plans[forward_only] = Plan(dag, programs, executor)
        return self.plans[forward_only]

    def _shard_specs(self, dag: TrainingDAG) -> dict[str, tuple[ParamShard, tuple[int, ...], str, str]]:
        """Parameters split across ranks, with this rank's group: experts (``shard``) along the expert
        index, and the layers ``shard_tensor`` split at capture."""
        specs = {f: (ParamShard(f, 0, 1, len(g)), g, stream, "ep")
                 for f, (g, _, stream) in dag.meta.get("ep_params", {}).items()}
        group = next((g for n in dag.of_kind(Kind.COMPUTE) for g in n.attr("tp_groups") or () if self.rank in g), None)
        if group is not None:
            specs.update({f: (spec, group, dag.meta["tp"][2], "tp") for f, spec in self.tp_shards.items()})
        return specs

    # -- running -------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> tuple[torch.Tensor]:
        train = torch.is_grad_enabled()
        plan = self.plan(forward_only=not train)
        assert self.state is not None and self.joint is not None
        if not self.state.broadcast_done:
            tensors = [self.joint.params[f] for f in sorted(self.joint.params)]
            tensors += [self.joint.buffers[f] for f in sorted(self.joint.buffers)]
            self.state.broadcast_from_rank0(tensors)
        self.state.shard()
        self.state.ready(self)  # deferred checkpoint loads (piper_compile.checkpoint), before the step computes
        self._check_inputs(args)
        loss = plan.executor.run(list(args))
        if train:
            loss = _NoopBackward.apply(loss, _ANCHOR)
        return (loss,)

    def _check_inputs(self, args: tuple[Any, ...]) -> None:
        assert self.joint is not None
        for s in self.joint.inputs:
            if s.kind == INPUT and s.arg_index is not None and not isinstance(args[s.arg_index], torch.Tensor):
                raise PiperError(f"piper: input {s.name!r} must be a tensor")


def _unread_params(dag: TrainingDAG, program: Program) -> set[str]:
    """Trained parameters that no instruction of ``program`` reads or updates (other stages' weights)."""
    trained = {f for n in dag.of_kind(Kind.UPDATE) for f in n.attr("params")}
    mine = {param_fqn(v) for i in program.instrs for v in i.node.inputs} - {None}
    upd = program.update_node()
    mine |= set(upd.attr("params")) if upd is not None else set()
    mine |= {f for i in program.instrs if i.node.kind is Kind.ALL_GATHER for f in i.node.attr("params") or ()}
    return trained - mine  # type: ignore[return-value]


def piper_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                  **kwargs: Any) -> CompiledStep:
    """The ``torch_dynamo_backends`` entry point ``piper``."""
    if kwargs:
        raise PiperError(f"piper: unexpected backend arguments {sorted(kwargs)}; pass settings in options={{...}}")
    return CompiledStep(gm, example_inputs, options)


__all__ = ["CompiledStep", "Options", "PiperDirectiveError", "find_state", "piper_backend", "state_for"]
