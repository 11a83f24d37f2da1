"""Invariants every lowered DAG keeps (listed in passes/README.md); violations are internal errors."""
from __future__ import annotations

from collections import Counter

from piper_compile.errors import PiperError
from piper_compile.ir.dag import Kind, TrainingDAG
from piper_compile.passes.context import PassContext


def check_invariants(dag: TrainingDAG, ctx: PassContext) -> None:
    def fail(msg: str) -> None:
        raise PiperError(f"piper: internal: the lowered DAG breaks an invariant: {msg}")

    cycle = dag.find_cycle()
    if cycle:
        fail(f"cycle {' -> '.join(cycle)}")
    prod = dag.producers()  # raises on a value with two producers
    for n in dag:
        if not n.devices:
            fail(f"{n.name} is not placed")
        for v in n.inputs:
            p = dag.nodes.get(prod.get(v, ""))
            if p is not None and p.devices is not n.devices and p.devices != n.devices:
                fail(f"{n.name} reads {v} from {p.name} on other ranks without a SEND/RECV")
    sends = Counter(n.op.msg for n in dag.of_kind(Kind.SEND))  # type: ignore[attr-defined]
    recvs = Counter(n.op.msg for n in dag.of_kind(Kind.RECV))  # type: ignore[attr-defined]
    if sends != recvs:
        fail(f"unmatched SEND/RECV messages {sorted((sends - recvs) + (recvs - sends))}")
    if not ctx.forward_only:
        updated: set[str] = set()
        for n in dag.of_kind(Kind.UPDATE):
            params = list(n.op.params)  # type: ignore[attr-defined]
            dup = sorted({p for p in params if params.count(p) > 1})
            if dup:
                fail(f"{n.name} updates {dup} twice")
            updated.update(params)
        written = {fqn for n in dag.of_kind(Kind.COMPUTE) for _, fqn in n.op.grad_outputs()}
        if written - updated:
            fail(f"parameters {sorted(written - updated)} get gradients but no UPDATE")
    for group, z in (dag.meta.zero or {}).items():
        if z.level < 3:
            continue
        sharded = {f"param:{f}" for _, fqns in z.buckets for f in fqns}
        for n in dag.of_kind(Kind.COMPUTE):
            if n.devices == group and sharded & set(n.inputs):
                fail(f"{n.name} reads sharded parameters {sorted(sharded & set(n.inputs))[:3]} without an all-gather")
