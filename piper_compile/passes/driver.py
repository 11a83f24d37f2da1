"""The pass driver: build the DAG, apply each directive's pass in list order, then the lowering
passes. Times every pass, checks what each returns, can dump the DAG after each (``PIPER_DEBUG=1``)
and skip a lowering pass by name (``PIPER_SKIP_PASSES=a,b``, for debugging only)."""
from __future__ import annotations

import sys
import time
from typing import Callable

from piper_compile.directives.spec import Directive, Split
from piper_compile.ir.dag import TrainingDAG
from piper_compile.passes.context import PassContext
from piper_compile.directives.spec import Shard, ShardTensor
from piper_compile.passes.directive_passes import DIRECTIVE_PASSES
from piper_compile.passes.expert import apply_shard
from piper_compile.passes.tensor_parallel import apply_shard_tensor
from piper_compile.passes.invariants import check_invariants
from piper_compile.passes.lower import LOWERING_PASSES
from piper_compile.knobs import knob

Pass = Callable[[TrainingDAG, PassContext], TrainingDAG]
DIRECTIVE_PASSES[Shard] = apply_shard  # type: ignore[assignment]
DIRECTIVE_PASSES[ShardTensor] = apply_shard_tensor  # type: ignore[assignment]


def _run(name: str, fn: Callable[[], TrainingDAG], ctx: PassContext) -> TrainingDAG:
    t0 = time.perf_counter()
    dag = fn()
    ctx.timings[name] = ctx.timings.get(name, 0.0) + time.perf_counter() - t0
    if not isinstance(dag, TrainingDAG):
        raise TypeError(f"piper: internal: pass {name} returned {type(dag).__name__}, not a TrainingDAG")
    if knob("PIPER_DEBUG"):
        print(f"--- piper: DAG after {name}: {dag.summary()}\n{dag.to_text()}", file=sys.stderr)
    return dag


def run_passes(dag: TrainingDAG, directives: list[Directive], ctx: PassContext) -> TrainingDAG:
    """Apply ``directives`` then lowering; returns the final, invariant-checked DAG."""
    skip = set(filter(None, knob("PIPER_SKIP_PASSES").split(",")))
    ctx.directives = list(directives)
    if not any(isinstance(d, Split) for d in directives):
        dag = _run("split(implicit)", lambda: DIRECTIVE_PASSES[Split](dag, Split(num_microbatches=1), ctx), ctx)
    for d in directives:
        fn = DIRECTIVE_PASSES[type(d)]
        dag = _run(f"{type(d).__name__.lower()}#{d.index}", lambda fn=fn, d=d, g=dag: fn(g, d, ctx), ctx)
    for p in LOWERING_PASSES:
        if p.__name__ in skip:
            continue
        dag = _run(p.__name__, lambda p=p, g=dag: p(g, ctx), ctx)
    check_invariants(dag, ctx)
    return dag
