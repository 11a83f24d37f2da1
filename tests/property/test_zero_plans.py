"""Hypothesis: random PP x DP strategies with ZeRO 1/2/3 plan, verify (no deadlock, collectives in one
order per group) and keep ZeRO's invariants: every sharded parameter in exactly one shard bucket of
its group, reductions after the bucket's last backward, and (ZeRO-3) no compute step reads a sharded
parameter it did not all-gather, each gathered copy freed by the step that reads it."""
from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piper_compile as piper
from piper_compile.compiled_step import CompiledStep
from piper_compile.ir.dag import Kind, TrainingDAG
from piper_compile.ir.ops import GradReduce
from piper_compile.plan.program import Program
from piper_compile.plan.verifier import verify_programs
from piper_compile.testing.models import build_model
from tests.property.test_plans import BATCH, SCHEDULES, SETTINGS, check_symmetry, time_limit

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


@pytest.fixture(autouse=True, scope="module")
def _drop_captures() -> Iterator[None]:
    yield
    _captured.cache_clear()
    torch._dynamo.reset()


def _directives(stages: int, m: int, kind: str, zero: int, bucket_mb: float, prefetch: int) -> list[Any]:
    ranks = [[s, s + stages] for s in range(stages)]
    return [*piper.pipeline(stages, ranks), piper.split(m), *SCHEDULES[kind](stages, m),
            piper.replicate({"PP": "*"}, zero=zero, bucket_mb=bucket_mb, prefetch=prefetch)]


@functools.cache
def _captured(model_name: str, stages: int, zero: int, bucket_mb: float) -> CompiledStep:
    if model_name == "gpt":
        model = build_model("gpt", layers=4, dim=16, heads=2, seq=8)
    else:
        model = build_model(model_name, dim=8, depth=6)
    model.annotate_stages(stages)  # type: ignore[operator]
    options = {"directives": _directives(stages, 1, "gpipe", zero, bucket_mb, 1), "optimizer": ADAMW}
    box: dict[str, CompiledStep] = {}
    torch._dynamo.reset()

    def stash(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        box["step"] = CompiledStep(gm, example_inputs, options, world=(0, 1))
        return gm.forward

    torch.compile(model, backend=stash, fullgraph=True, dynamic=True)(
        *model.make_batch(BATCH, torch.Generator().manual_seed(0)))  # type: ignore[operator]
    box["step"]._capture()
    return box["step"]


def _plan(model: str, stages: int, m: int, kind: str, zero: int, bucket_mb: float, prefetch: int,
          forward_only: bool = False) -> tuple[TrainingDAG, list[Program]]:
    base = _captured(model, stages, zero, bucket_mb)
    d = _directives(stages, m, kind, zero, bucket_mb, prefetch)
    step = CompiledStep(base.gm, [], {"directives": d, "codegen": "eager", "optimizer": ADAMW}, world=(0, 2 * stages))
    step.sources, step.joint, step.segments = base.sources, base.joint, base.segments
    return step.build(forward_only)


def check_zero_plan(model: str, stages: int, m: int, kind: str, zero: int, bucket_mb: float, prefetch: int) -> None:
    with time_limit(30):
        dag, programs = _plan(model, stages, m, kind, zero, bucket_mb, prefetch)
        verify_programs(programs)
    check_symmetry(dag, programs, stages)  # ZeRO collectives and gathers keep one class per stage
    layout = dag.meta.zero
    sharded: Counter[str] = Counter(f for z in layout.values() for _, fqns in z.buckets for f in fqns)
    assert sharded and set(sharded.values()) == {1}  # each sharded parameter in one bucket
    for z in layout.values():
        assert z.level == zero and len(z.devices) == 2
    for prog in programs:
        instrs = prog.instrs
        reductions = [i for i in instrs if isinstance(i.node.op, GradReduce)]
        kinds = {i.node.kind for i in reductions if i.node.op.level}
        assert kinds == ({Kind.REDUCE_SCATTER} if zero >= 2 else {Kind.ALL_REDUCE})
        for k, ins in enumerate(instrs):  # a bucket is reduced after its last backward on this rank
            if ins in reductions:
                bucket = set(ins.node.op.params)
                later = [j.name for j in instrs[k + 1:] if j.node.kind is Kind.COMPUTE
                         and bucket & {f for _, f in j.node.op.grad_outputs()}]
                assert not later, (prog.rank, ins.name, later)
        gathers = [i for i in instrs if i.node.kind is Kind.ALL_GATHER]
        if zero < 3:  # one post-update all-gather per bucket of the rank's group
            upd = next(k for k, i in enumerate(instrs) if i.node.kind is Kind.UPDATE)
            assert gathers and all(instrs.index(g) > upd for g in gathers)
            continue
        produced_at = {v: k for k, i in enumerate(instrs) for v in i.node.outputs}
        computes = [k for k, i in enumerate(instrs) if i.node.kind is Kind.COMPUTE]
        readers: dict[str, list[int]] = {}
        by_gather: dict[int, set[int]] = {}
        for k in computes:
            ins = instrs[k]
            for v in ins.node.inputs:
                if v.startswith("param:") and v[len("param:"):] in sharded:
                    raise AssertionError(f"rank {prog.rank}: {ins.name} reads sharded {v} without a gather")
                if v.startswith("param:") and "#" in v:
                    assert produced_at[v] < k
                    readers.setdefault(v, []).append(computes.index(k))
                    by_gather.setdefault(produced_at[v], set()).add(computes.index(k))
        for rs in by_gather.values():  # a gather serves consecutive compute steps ...
            assert sorted(rs) == list(range(min(rs), max(rs) + 1)), rs
        for v, rs in readers.items():  # ... and each gathered parameter is freed after its last reader
            assert v in instrs[computes[rs[-1]]].frees


@settings(max_examples=12, **SETTINGS)
@given(st.integers(1, 3), st.integers(1, 6), st.sampled_from(sorted(SCHEDULES)), st.sampled_from([1, 2, 3]),
       st.sampled_from([25.0, 0.0005]), st.integers(0, 3))
def test_random_zero_pipeline_plans_verify(stages: int, m: int, kind: str, zero: int, bucket_mb: float,
                                           prefetch: int) -> None:
    check_zero_plan("mlp", stages, m, kind, zero, bucket_mb, prefetch)


@pytest.mark.parametrize("zero", [1, 3])
def test_tied_gpt_zero_plan_keeps_the_tied_weight_whole(zero: int) -> None:
    check_zero_plan("gpt", 2, 4, "1f1b", zero, 0.002, 1)
    dag, _ = _plan("gpt", 2, 4, "1f1b", zero, 0.002, 1)
    layout = dag.meta.zero.values()
    assert any("wte.weight" in z.whole for z in layout)  # in the group that finishes its gradient
    assert not any("wte.weight" in fqns for z in layout for _, fqns in z.buckets)


def test_forward_only_zero3_plan_gathers_with_the_training_layout() -> None:
    dag, programs = _plan("mlp", 2, 2, "1f1b", 3, 0.0005, 1)
    fdag, fprograms = _plan("mlp", 2, 2, "1f1b", 3, 0.0005, 1, forward_only=True)
    verify_programs(fprograms)
    assert {g: z.buckets for g, z in dag.meta.zero.items()} == {g: z.buckets for g, z in fdag.meta.zero.items()}
    assert any(i.node.kind is Kind.ALL_GATHER for i in fprograms[0].instrs)


def test_prefetch_distance_orders_the_gather() -> None:
    """prefetch=k: the gather for a compute step is issued right after the step k+1 places earlier."""
    for k in (0, 2):
        _, programs = _plan("mlp", 1, 1, "gpipe", 3, 0.0005, k)
        instrs = programs[0].instrs
        computes = [i for i in instrs if i.node.kind is Kind.COMPUTE]
        for ins in instrs:
            if ins.node.kind is Kind.ALL_GATHER:
                target = next(c for c in computes if c.name == ins.node.op.for_step)  # its first reader
                at = computes.index(target) - 1 - k
                if at >= 0:
                    assert instrs.index(ins) > instrs.index(computes[at])


@pytest.mark.parametrize("bucket_mb", [0.002, 0.02])
def test_zero3_steps_read_one_bucket_each(bucket_mb: float) -> None:
    """Forward and backward pieces are cut where they start reading another bucket's parameters (the
    input gradient through a layer of the previous bucket is its own piece), so no step holds two
    gathered buckets of its own and the prefetched one is the only extra."""
    from piper_compile.ir.dag import param_fqn

    dag, programs = _plan("gpt", 1, 2, "1f1b", 3, bucket_mb, 1)
    bucket_of = {f: b for z in dag.meta.zero.values() for b, fqns in z.buckets for f in fqns}
    for ins in programs[0].instrs:
        if ins.node.kind is Kind.COMPUTE:
            read = {bucket_of[param_fqn(v)] for v in ins.node.inputs if v.startswith("param:") and "#" in v
                    and param_fqn(v) in bucket_of}
            assert len(read) <= 1, (ins.name, read)
