"""User-facing helpers that act on a compiled step (``torch.compile(model, backend="piper")``)."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
from torch import nn

from piper_compile.backend import piper_backend
from piper_compile.compiled_step import CompiledStep
from piper_compile.callmode import forward_only, wants_forward_only
from piper_compile.memory import MemoryReport, report_of
from piper_compile.metrics import StepMetrics, metrics_of
from piper_compile.options import Options
from piper_compile.capture.blocks import flat_on_failure
from piper_compile.capture.dynamo import capture_settings, give_own_forward, one_graph_errors, trace
from piper_compile.capture.forward_route import ForwardRoute
from piper_compile.gcwindow import young_only
from piper_compile.errors import PiperDirectiveError, PiperError, some
from piper_compile.ir.dag import TrainingDAG
from piper_compile.plan.program import Program
from piper_compile.runtime.registry import link, state_of_module
from piper_compile.steps import compiled_steps, trained_step, training_state


def optimizer(step: Any) -> torch.optim.Optimizer:
    """The optimizer piper runs for ``step`` (a real ``torch.optim.Optimizer``: ``param_groups`` work with
    ``torch.optim.lr_scheduler``). Raises if no ``options["optimizer"]`` was given."""
    st = training_state(step, create=True)
    opt = st.get_optimizer()
    if opt is None:
        raise PiperError("piper: this step has no optimizer: pass options={'optimizer': "
                         "functools.partial(torch.optim.AdamW, lr=...)} to torch.compile, or step your own optimizer "
                         "on param.grad after each call")
    return opt


def loss_scaler(step: Any) -> Any:
    """fp16 loss scaling (``runtime/loss_scale.LossScaler``): ``.scale`` the next step seeds its backward
    with, ``.skipped`` steps so far, ``.last_skipped``; None when the step does not scale its loss."""
    st = training_state(step, create=False)
    return st.scaler if st is not None else None


def explain(step: Any, forward_only: bool = False) -> str:
    """Text of every rank's program for ``step`` (after its first call)."""
    for cs in compiled_steps(step):
        if forward_only in cs.plans:
            return "\n".join(p.to_text() for p in cs.plans[forward_only].programs)
    raise PiperError("piper: no plan of that kind yet; run the step once (under no_grad for forward_only)")


def last_stats(step: Any) -> Any:
    """Counters of the most recent training step on this rank (collectives, P2P, peak live bytes)."""
    return trained_step(step).plans[False].executor.stats


def stats(step: Any) -> StepMetrics:
    """The last training step's metrics on this rank (``metrics.StepMetrics``; ``.line()`` for a log line)."""
    return metrics_of(trained_step(step))


def memory_report(step: Any) -> MemoryReport:
    """Memory of this rank for ``step`` (after at least one training call): measured from the runtime's
    buffers (parameter storage actually held, gradient buffers, optimizer state tensors, and the last
    step's peaks) and predicted by the simulator from the same programs (optimizer state as the
    optimizer's state tensors per parameter, e.g. 2 for AdamW). Under expert parallelism expert weights
    count as this rank's shards (parameters, gradients and optimizer state of ``E/G`` experts)."""
    return report_of(trained_step(step))


def trained_parameters(step: Any) -> dict[str, torch.Tensor]:
    """Full current values (copies) of the parameters this rank's device group updates, by FQN. ZeRO
    shards are all-gathered, so every rank of a ZeRO group must call this together."""
    cs = trained_step(step)
    upd = cs.plans[False].programs[cs.rank].update_node()
    names = list(upd.op.params) if upd is not None else []  # type: ignore[attr-defined]
    zero = cs.state.zero if cs.state is not None else None
    groups = cs.plans[False].executor.groups
    gathered = zero.gather_full(groups) if zero is not None else {}
    shards = cs.state.shards
    gathered.update({f: shards[f].gather(groups) for f in sorted(set(names) & set(shards))})  # EP / TP pieces
    return {f: gathered[f] if f in gathered else cs.joint.params[f].detach().clone() for f in names}


class StaticPlan:
    """A strategy planned for ``world_size`` ranks in this process: the DAG and every rank's program."""

    def __init__(self, dag: TrainingDAG, programs: list[Program], segments: dict[str, Any] | None = None,
                 optimizer: Any = None, device_type: str = "cpu") -> None:
        self.dag = dag
        self.programs = programs
        self.segments = segments or {}  # name -> capture.segments.Segment (the compiled units)
        self.optimizer = optimizer  # options["optimizer"]: its state and its step's temporaries count in ``memory``
        self.device_type = device_type  # the example batch's: which optimizer implementation torch defaults to
        self._memory: dict[int, Any] | None = None

    @property
    def memory(self) -> Any:
        """Every rank's predicted memory (``memory.RankMemories``: rank -> ``memory.RankMemory``): parameters, compute copies, gradients,
        optimizer state, peak activations, ZeRO-3 gathered parameters and gradient buffers, the step where
        the activations peak and the values live there. ``str()`` of one rank's entry is a short report."""
        if self._memory is None:
            from piper_compile.memory import plan_memory

            self._memory = plan_memory(self.dag, self.programs, self.optimizer, self.device_type)
        return self._memory

    def text(self) -> str:
        return "\n".join(p.to_text() for p in self.programs)


def plan(model: nn.Module, *example_args: Any, directives: Any, world_size: int, forward_only: bool = False,
         options: dict[str, Any] | None = None) -> StaticPlan:
    """Capture ``model`` on ``example_args`` (one local replica's batch) and plan ``directives`` for
    ``world_size`` ranks without launching anything; the programs are verified together. Planning leaves
    no Dynamo cache entry on the model's code: call it in a loop, then compile the model yourself."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PiperDirectiveError(None, {"world_size": world_size},
                                  f"world_size must be a whole number of ranks, at least 1; got {world_size!r}",
                                  "pass world_size=N, the number of processes the plan is for (for a pipeline "
                                  "of S stages replicated D times, S * D)")
    from piper_compile.init.deferred import planning

    with planning(model, example_args):  # a model built on the meta device: stand-ins while planning
        cs = capture_step(model, *example_args, directives=directives, world_size=world_size, options=options)
        device = next((a.device.type for a in example_args if isinstance(a, torch.Tensor)), "cpu")
        return StaticPlan(*cs.build(forward_only), cs.segments, cs.options.optimizer, device)


def capture_step(model: nn.Module, *example_args: Any, directives: Any, world_size: int,
                 options: dict[str, Any] | None = None) -> CompiledStep:
    """Capture ``model`` on ``example_args`` into a ``CompiledStep`` for ``world_size`` ranks: the joint
    graph cut into segments, not yet planned (``plan`` builds on it; the golden pass tests run its
    passes one by one). Leaves no Dynamo cache entry on the model's code."""
    _check_materialized(model)
    opts = {**(options or {}), "directives": directives}
    _mark_blocks(model, opts)  # traced as piper.compile traces it: repeated blocks once
    linked = link(model, opts)
    linked.call = (example_args, {})
    traced = flat_on_failure(model, lambda: trace(model, example_args))
    return CompiledStep(traced.gm, traced.inputs, opts, world=(0, world_size), sources=traced.sources, link=linked)


def _check_materialized(model: nn.Module) -> None:
    """Refuse a model whose lazy modules (``nn.LazyLinear``) have not made their parameters yet: piper
    plans, shards and registers the parameters before the first step runs."""
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    lazy += [n for n, b in model.named_buffers() if isinstance(b, nn.parameter.UninitializedBuffer)]
    if lazy:
        raise PiperError(f"piper: {type(model).__name__} has lazy modules whose parameters are not made yet "
                         f"({some(lazy)}): piper plans and shards the parameters before the first step. Run the "
                         "model once on an example batch before compiling it (`with torch.no_grad(): model(*batch)`), "
                         "which gives each lazy module its shapes")


def _mark_blocks(model: nn.Module, opts: dict[str, Any]) -> bool:
    """Repeated blocks become nested compile regions (``capture/blocks.py``) unless the directives rule it
    out; directives that do not parse are left for the first call to report. Whether any were marked."""
    from piper_compile.capture.blocks import mark_repeated_blocks, wanted

    try:
        directives = Options.parse(opts).directives
    except PiperError:
        return False
    return wanted(directives) and bool(mark_repeated_blocks(model))


def _compiled_forward(traced: Callable[..., Any], model: nn.Module, marked: bool,
                      opts: dict[str, Any]) -> Callable[..., Any]:
    """``traced`` (the compiled forward), or piper's own trace of it (``capture/forward_route.py``: kept on
    disk, so that a warm run skips Dynamo's trace), whose first call with and without gradients (the trace,
    capture, planning, loading code) runs in a garbage-collector window (``gcwindow.young_only``); with
    ``marked`` blocks, a Dynamo failure on them traces the blocks one by one (``capture/blocks.py``).
    Every call runs under piper's Dynamo settings (``capture/dynamo.capture_settings``): a recompile
    traces as the first trace did. Every call ends by marking the weights this rank released (reading
    one is a ``piper:`` error until the next call, ``runtime/released.py``), and the next call starts by
    taking the marks off, before Dynamo's guards read the parameters' classes."""
    done: set[bool] = set()
    route = ForwardRoute(model, traced, functools.partial(piper_backend, options=opts), marked)

    @functools.wraps(traced)
    def forward(*args: Any, **kwargs: Any) -> Any:
        def run() -> Any:
            st = state_of_module(model) if done else None
            if st is not None:
                st.unmark_released()  # before Dynamo's guards read the parameters' classes
            try:
                with capture_settings(args, kwargs), one_graph_errors(model):
                    return route(args, kwargs)
            finally:
                st = st or state_of_module(model)
                if st is not None:
                    st.marks_on = True
                    st.mark_released()  # reading a parameter piper released is an error until the next call

        mode = not wants_forward_only()
        with contextlib.nullcontext() if mode else forward_only():  # callmode.py: the training version
            if mode in done:
                return run()
            with young_only():
                out = run()
        done.add(mode)
        return out

    return forward


def compile(model: nn.Module, *, directives: Any = (), **options: Any) -> nn.Module:  # noqa: A001 - piper.compile
    """``torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options={"directives": ..., **options})``
    plus an explicit link from the compiled step to ``model`` (``runtime/registry.ModelLink``): what
    ``options["mixed_precision"]`` needs (piper traces the model again in the compute dtype), and how
    ``piper.optimizer(step)`` and ``model.state_dict()`` find the step's training state."""
    _check_materialized(model)
    opts = {**options, "directives": list(directives)}
    marked = _mark_blocks(model, opts)
    # Dynamo keeps at most recompile_limit (8) compiled entries per code object, and each piper.compile
    # adds one (its backend is new): the 9th model of a class compiled in one process raised
    # FailOnRecompileLimitHit. A forward of its own takes this model's entries, and they go with it.
    give_own_forward(model)
    compiled = torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options=opts)
    compiled.forward = _compiled_forward(compiled.forward, model, marked, opts)
    linked = link(model, opts)
    linked.handle = compiled.register_forward_pre_hook(linked.record, with_kwargs=True)
    compiled._piper_link = linked  # keeps the link (and so the registry entry) alive with the compiled module
    return compiled
