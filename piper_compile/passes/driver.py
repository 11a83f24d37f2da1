"""The pass driver: build the DAG, apply each directive's pass in list order, then the lowering
passes. Times every pass, checks what each returns, can dump the DAG after each (``PIPER_DEBUG=1``)
and skip a lowering pass by name (``PIPER_SKIP_PASSES=a,b``, for debugging only)."""
from __future__ import annotations

from typing import Callable

from piper_compile.pass_runner import run_pass, skipped_passes
from piper_compile.directives.spec import Directive, Split
from piper_compile.ir.dag import TrainingDAG
from piper_compile.passes.context import PassContext
from piper_compile.directives.spec import Shard, ShardTensor
from piper_compile.passes.directive_passes import DIRECTIVE_PASSES
from piper_compile.passes.expert import apply_shard
from piper_compile.passes.tensor_parallel import apply_shard_tensor
from piper_compile.passes.invariants import check_invariants
from piper_compile.passes.lower import LOWERING_PASSES

DIRECTIVE_PASSES[Shard] = apply_shard  # type: ignore[assignment]
DIRECTIVE_PASSES[ShardTensor] = apply_shard_tensor  # type: ignore[assignment]


def _run(name: str, fn: Callable[[], TrainingDAG], ctx: PassContext) -> TrainingDAG:
    def checked() -> TrainingDAG:
        dag = fn()
        if not isinstance(dag, TrainingDAG):
            raise TypeError(f"piper: internal: pass {name} returned {type(dag).__name__}, not a TrainingDAG")
        return dag
    return run_pass(name, checked, ctx.timings, "DAG", lambda dag: f"{dag.summary()}\n{dag.to_text()}")


Step = Callable[[TrainingDAG], TrainingDAG]


def pass_steps(directives: list[Directive], ctx: PassContext) -> list[tuple[str, Step]]:
    """The passes ``run_passes`` applies, in order, by name: the implicit ``split(implicit)`` when no
    directive splits, one ``<directive>#<index>`` per directive, then the lowering passes not skipped with
    ``PIPER_SKIP_PASSES``. Each step takes and returns a DAG, so any one of them runs on a DAG read
    from text (the golden pass tests do)."""
    skip = skipped_passes()
    ctx.directives = list(directives)
    steps: list[tuple[str, Step]] = []
    if not any(isinstance(d, Split) for d in directives):
        steps.append(("split(implicit)", lambda g: DIRECTIVE_PASSES[Split](g, Split(num_microbatches=1), ctx)))
    for d in directives:
        fn = DIRECTIVE_PASSES[type(d)]
        steps.append((f"{type(d).__name__.lower()}#{d.index}", lambda g, fn=fn, d=d: fn(g, d, ctx)))
    steps += [(p.__name__, lambda g, p=p: p(g, ctx)) for p in LOWERING_PASSES if p.__name__ not in skip]
    return steps


def run_passes(dag: TrainingDAG, directives: list[Directive], ctx: PassContext) -> TrainingDAG:
    """Apply ``directives`` then lowering; returns the final, invariant-checked DAG."""
    for name, step in pass_steps(directives, ctx):
        dag = _run(name, lambda step=step, g=dag: step(g), ctx)
    check_invariants(dag, ctx)
    return dag
