"""Hypothesis: random pipeline strategies are planned for a whole world in this process (no processes,
no process group: the captured model is planned with any world size) and must verify; invalid ones must
raise a piper error -- never crash, never hang; planning is deterministic; DAG text round-trips."""
from __future__ import annotations

import contextlib
import functools
import itertools
import signal
from collections import Counter
from typing import Any, Iterator

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import piper_compile as piper
from piper_compile import PiperDirectiveError, PiperError, PiperPlanError
from piper_compile.compiled_step import CompiledStep
from piper_compile.directives.spec import Replicate, parse_directives
from piper_compile.ir.dag import Kind, TrainingDAG, parse_dag
from piper_compile.ir.ops import GradReduce
from piper_compile.plan.program import Program, build_program, build_programs
from piper_compile.plan.verifier import verify_programs
from piper_compile.sim import UniformCost
from piper_compile.sim.simulate import simulate
from piper_compile.schedules.builders import stage_sequence as _stage_sequence
from piper_compile.testing.models import build_model


def stage_sequence(kind: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """``(PASS, MB)`` steps of one stage from the library's builder (steps are (pass, stage, mb))."""
    return [(p, mb) for p, _, mb in _stage_sequence(kind, stage, stages, microbatches)]


MAX_STAGES = 6
DEPTH = 6  # one Linear per stage at 6 stages
BATCH = 2520  # divisible by every micro-batch count 1..10
TINY_BUCKET_MB = 0.0002  # ~210 bytes: every 8x8 weight fills a bucket, so backward is cut into chunks
SCHEDULES = {"gpipe": piper.schedules.gpipe, "1f1b": piper.schedules.one_f_one_b}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@pytest.fixture(autouse=True, scope="module")
def _drop_captures() -> Iterator[None]:
    yield
    _captured.cache_clear()
    torch._dynamo.reset()


@functools.cache
def _captured(model_name: str, stages: int, bucket_mb: float | None) -> CompiledStep:
    """A model annotated with ``stages`` stages, captured once per backward bucket size: Dynamo graph ->
    joint graph -> segments (what ``piper.plan`` does on every call; cached here to keep examples fast)."""
    if model_name == "gpt":
        model = build_model("gpt", layers=3, dim=16, heads=2, seq=8)
    else:
        model = build_model(model_name, dim=8, depth=DEPTH)
    model.annotate_stages(stages)  # type: ignore[operator]
    options = {"directives": [] if bucket_mb is None else [piper.replicate(bucket_mb=bucket_mb)]}
    box: dict[str, CompiledStep] = {}
    torch._dynamo.reset()  # many models share MLPChain.forward: stay under Dynamo's recompile limit

    def stash(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        box["step"] = CompiledStep(gm, example_inputs, options, world=(0, 1))  # reads Dynamo's sources now
        return gm.forward

    torch.compile(model, backend=stash, fullgraph=True, dynamic=True)(
        *model.make_batch(BATCH, torch.Generator().manual_seed(0)))  # type: ignore[operator]
    step = box["step"]
    step._capture()
    return step


def plan(stages: int, world: int, directives: list[Any], forward_only: bool = False, model: str = "mlp"
         ) -> tuple[TrainingDAG, list[Program]]:
    """The global DAG and every rank's verified program for ``world`` ranks, as each rank builds them at its
    first call (``CompiledStep.build``), without processes or a process group."""
    caps = [d.bucket_size for d in parse_directives(directives) if isinstance(d, Replicate)]
    base = _captured(model, stages, min(caps) if caps else None)
    step = CompiledStep(base.gm, [], {"directives": directives, "codegen": "eager"}, world=(0, world))
    step.sources, step.joint, step.segments = base.sources, base.joint, base.segments
    return step.build(forward_only)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Turn a hang into a failure."""
    def boom(*_: Any) -> None:
        raise TimeoutError(f"planning took more than {seconds}s (hang?)")

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def strategy(stages: int, microbatches: int, kind: str, dp: int, bucket_mb: float = 25.0) -> list[Any]:
    ranks = [[s + r * stages for r in range(dp)] for s in range(stages)]
    out = [*piper.pipeline(stages, ranks), piper.split(microbatches), *SCHEDULES[kind](stages, microbatches)]
    if dp > 1:
        out.append(piper.replicate({"PP": "*"}, bucket_mb=bucket_mb))
    return out


def _stage_of(rank: int, stages: int) -> int:
    return rank % stages


def _compute_steps(program: Program) -> list[tuple[str, int]]:
    """(PASS, MB) of the rank's compute steps in program order; the chunks of one cut backward count once."""
    steps = [(i.node.tag("PASS"), i.node.tag("MB")) for i in program.instrs if i.node.kind is Kind.COMPUTE]
    return [k for k, _ in itertools.groupby(steps)]


Case = tuple[int, int, str, int, float]  # stages, micro-batches, schedule, data-parallel degree, bucket MB
_buckets = st.sampled_from([25.0, TINY_BUCKET_MB])
plans = st.tuples(st.integers(1, MAX_STAGES), st.integers(1, 10), st.sampled_from(sorted(SCHEDULES)),
                  st.sampled_from([1, 2]), _buckets)


def check_symmetry(dag: TrainingDAG, programs: Any, stages: int) -> None:
    """Data-parallel replicas of a pipeline form one class per stage; each rank's program made from its
    class's equals the one built for it, and the quotient simulation equals the rank-by-rank one."""
    assert len(programs.symmetry.classes) == stages, programs.symmetry
    for r in range(len(programs)):
        assert programs[r].to_text() == build_program(dag, r, programs.reorder_window).to_text(), r
    cost = UniformCost(comm=0.25, update=0.5)
    whole, folded = simulate(list(programs), cost, dag), simulate(programs, cost, dag)
    assert folded.classes and not whole.classes
    for f in ("step_time", "rank_end", "busy", "peak_activation_bytes", "param_bytes", "grad_bytes"):
        assert getattr(folded, f) == getattr(whole, f), f


def check_pipeline_plan(model: str, stages: int, m: int, kind: str, dp: int, bucket_mb: float) -> None:
    """Plan ``model`` with ``stages`` x ``dp`` ranks and check the plan verifies and has the expected shape."""
    world = stages * dp
    with time_limit(20):
        dag, programs = plan(stages, world, strategy(stages, m, kind, dp, bucket_mb), model=model)
        verify_programs(programs)
    assert [prog.rank for prog in programs] == list(range(world))
    if dp > 1:
        check_symmetry(dag, programs, stages)
    all_params = {f for n in dag if n.kind is Kind.COMPUTE for _, f in n.op.grad_outputs()}
    updated: Counter[str] = Counter()
    for prog in programs:
        s = _stage_of(prog.rank, stages)
        # the rank runs exactly its stage's schedule, in the scheduled order
        assert _compute_steps(prog) == stage_sequence(kind, s, stages, m), prog.to_text()
        assert all(i.node.tag("PP") == s for i in prog.instrs if i.node.kind is Kind.COMPUTE)
        upd = [i for i in prog.instrs if i.node.kind is Kind.UPDATE]
        assert len(upd) == 1, prog.to_text()
        if prog.rank < stages:  # one replica of each stage
            updated.update(upd[0].node.op.params)
            assert len(set(upd[0].node.op.params)) == len(upd[0].node.op.params)
        # every value a rank reads was produced on that rank or is external
        local_out = {v for i in prog.instrs for v in i.node.outputs}
        external = dag.external_values()
        for i in prog.instrs:
            assert all(v in local_out or v in external for v in i.node.inputs), (prog.rank, i.name)
    # every parameter is updated once per step on each stage that holds it (a tied weight on each holder)
    holders = {f: {n.tag("PP") for n in dag if n.kind is Kind.COMPUTE and f"param:{f}" in n.inputs}
               for f in all_params}
    assert updated == Counter({f: len(h) for f, h in holders.items()})
    sends = [n for n in dag if n.kind is Kind.SEND and not n.op.state]
    if model == "mlp":  # per boundary and micro-batch: activation forward, gradient back
        assert len(sends) == 2 * m * (stages - 1)
    elif model == "skip" and stages > 2:  # the residual jumps from the first stage straight to the last one
        last = tuple(stages - 1 + r * stages for r in range(dp))
        assert any(n.tag("PP") == 0 and n.tag("PASS") == "F" and n.op.dst == last for n in sends)
    tied = [n for n in dag if n.kind is Kind.SEND and n.op.state]
    assert bool(tied) == (model == "gpt" and stages > 1)  # tied embedding/head gradient travels once
    grad_ars = [n for n in dag if n.kind is Kind.ALL_REDUCE and isinstance(n.op, GradReduce)]
    assert (len(grad_ars) > 0) == (dp > 1)
    assert all(len(n.devices) == dp for n in grad_ars)
    if dp > 1:
        # gradients are reduced once per step: every parameter in exactly one bucket of its group ...
        reduced = Counter(f for n in grad_ars for f in n.op.params)
        assert set(reduced) == all_params and set(reduced.values()) == {1}
        if bucket_mb == TINY_BUCKET_MB and model == "mlp":
            assert len(grad_ars) > stages  # several buckets per stage: backward was cut into chunks
        # ... and only after the last micro-batch's backward that writes the bucket
        for prog in programs:
            for k, ins in enumerate(prog.instrs):
                if ins.node.kind is Kind.ALL_REDUCE and isinstance(ins.node.op, GradReduce):
                    bucket = set(ins.node.op.params)
                    later = [j.name for j in prog.instrs[k + 1:] if j.node.kind is Kind.COMPUTE
                             and bucket & {f for _, f in j.node.op.grad_outputs()}]
                    assert not later, (prog.rank, ins.name, later)


# -- valid strategies verify ---------------------------------------------------------------------------
@pytest.mark.slow  # slow: keeps the fast subset under 5 min
@settings(max_examples=40, **SETTINGS)
@given(plans)
def test_random_pipeline_plans_verify(p: Case) -> None:
    check_pipeline_plan("mlp", *p)


@pytest.mark.slow  # slow: keeps the fast subset under 5 min
@settings(max_examples=25, **SETTINGS)
@given(st.integers(2, 4), st.integers(1, 10), st.sampled_from(sorted(SCHEDULES)), st.sampled_from([1, 2]), _buckets)
def test_random_pipeline_plans_with_skip_connection_verify(stages: int, m: int, kind: str, dp: int,
                                                            bucket_mb: float) -> None:
    check_pipeline_plan("skip", stages, m, kind, dp, bucket_mb)


@pytest.mark.slow
@settings(max_examples=10, **SETTINGS)
@given(st.sampled_from([1, 2, 3]), st.integers(1, 4), st.sampled_from(sorted(SCHEDULES)), st.sampled_from([1, 2]))
def test_random_pipeline_plans_with_tied_weights_verify(stages: int, m: int, kind: str, dp: int) -> None:
    check_pipeline_plan("gpt", stages, m, kind, dp, 25.0)


@pytest.mark.slow  # ~4.5 s: keeps the fast subset under 5 min
@settings(max_examples=20, **SETTINGS)
@given(plans)
def test_forward_only_plans_verify(p: Case) -> None:
    stages, m, kind, dp, bucket_mb = p
    with time_limit(20):
        dag, programs = plan(stages, stages * dp, strategy(stages, m, kind, dp, bucket_mb), forward_only=True)
        verify_programs(programs)
    assert not any(n.tag("PASS") == "B" or n.kind is Kind.UPDATE for n in dag)
    for prog in programs:
        assert _compute_steps(prog) == [("F", k) for k in range(m)]


# -- determinism and text round trip ------------------------------------------------------------------------
@settings(max_examples=15, **SETTINGS)
@given(plans)
def test_plans_are_deterministic(p: Case) -> None:
    stages, m, kind, dp, bucket_mb = p
    directives = strategy(stages, m, kind, dp, bucket_mb)
    dag1, progs1 = plan(stages, stages * dp, directives)
    dag2, progs2 = plan(stages, stages * dp, directives)
    assert dag1.to_text() == dag2.to_text()
    assert [q.to_text() for q in progs1] == [q.to_text() for q in progs2]
    assert [[(i.name, i.peer, i.waits, i.frees) for i in q.instrs] for q in progs1] == \
        [[(i.name, i.peer, i.waits, i.frees) for i in q.instrs] for q in progs2]


@settings(max_examples=15, **SETTINGS)
@given(plans)
def test_plan_dag_text_round_trips(p: Case) -> None:
    stages, m, kind, dp, bucket_mb = p
    dag, programs = plan(stages, stages * dp, strategy(stages, m, kind, dp, bucket_mb))
    text = dag.to_text()
    back = parse_dag(text)
    assert list(back.nodes) == list(dag.nodes)
    assert back.nodes == dag.nodes
    assert back.order_edges == dag.order_edges
    assert back.to_text() == text
    # the parsed DAG plans to the same programs
    assert [q.to_text() for q in build_programs(back, stages * dp)] == [q.to_text() for q in programs]


# -- invalid orders ----------------------------------------------------------------------------------------
@st.composite
def shuffled_orders(draw: st.DrawFn) -> tuple[int, int, list[list[tuple[str, int]]]]:
    stages = draw(st.integers(1, 4))
    m = draw(st.integers(1, 5))
    seqs = [draw(st.permutations([(p, k) for k in range(m) for p in ("F", "B")])) for _ in range(stages)]
    return stages, m, seqs


def _locally_backwards(seqs: list[list[tuple[str, int]]], m: int) -> bool:
    return any(seq.index(("B", k)) < seq.index(("F", k)) for seq in seqs for k in range(m))


@settings(max_examples=60, **SETTINGS)
@given(shuffled_orders())
def test_random_orders_error_or_verify_never_crash(case: tuple[int, int, list[list[tuple[str, int]]]]) -> None:
    stages, m, seqs = case
    orders = [piper.order(*[{"PP": s, "MB": k, "PASS": p} for p, k in seq]) for s, seq in enumerate(seqs)]
    directives = [*piper.pipeline(stages), piper.split(m), *orders]
    with time_limit(20):
        try:
            _, programs = plan(stages, stages, directives)
            verify_programs(programs)
        except PiperDirectiveError as e:
            event("directive error")
            msg = str(e)
            assert msg.startswith("piper: directive #") and "cycle" in msg and "Fix:" in msg
            return
        except PiperPlanError as e:
            event("plan error")
            # consistent per stage, but stages disagree on the micro-batch order: rejected before running
            assert not _locally_backwards(seqs, m)
            assert "deadlock" in str(e)
            return
    event("verified")
    assert not _locally_backwards(seqs, m), "a B ordered before its own F was accepted"
    for prog in programs:
        assert _compute_steps(prog) == seqs[prog.rank]


def test_stages_may_run_microbatches_in_different_orders() -> None:
    """Stage 0 runs micro-batch 1 first, stage 1 micro-batch 0 first: the receiver posts its RECVs in the
    order the peer sends them, so the plan verifies (and no message can be paired with the wrong RECV)."""
    s0 = piper.order(*[{"PP": 0, "MB": k, "PASS": p} for p, k in [("F", 1), ("F", 0), ("B", 0), ("B", 1)]])
    s1 = piper.order(*[{"PP": 1, "MB": k, "PASS": p} for p, k in [("F", 0), ("B", 0), ("F", 1), ("B", 1)]])
    dag, programs = plan(2, 2, [*piper.pipeline(2), piper.split(2), s0, s1])
    verify_programs(programs)
    sent = [i.node.op.msg for i in programs[0].instrs if i.node.kind is Kind.SEND]
    received = [i.node.op.msg for i in programs[1].instrs if i.node.kind is Kind.RECV]
    assert [m for m in sent if m in received] == received
    assert _compute_steps(programs[0]) == [("F", 1), ("F", 0), ("B", 0), ("B", 1)]
    assert _compute_steps(programs[1]) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@settings(max_examples=30, **SETTINGS)
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_order_with_b_before_its_f_is_a_directive_error(stages: int, m: int, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(sorted(SCHEDULES)))
    orders = SCHEDULES[kind](stages, m)
    s = data.draw(st.integers(0, stages - 1))
    k = data.draw(st.integers(0, m - 1))
    groups = orders[s]["filters"]
    f = groups.index([{"PP": s, "MB": k, "PASS": "F"}])
    b = groups.index([{"PP": s, "MB": k, "PASS": "B"}])
    groups[f], groups[b] = groups[b], groups[f]  # swap F and B of micro-batch k on stage s
    with time_limit(20), pytest.raises(PiperDirectiveError) as ei:
        plan(stages, stages, [*piper.pipeline(stages), piper.split(m), *orders])
    msg = str(ei.value)
    assert msg.startswith("piper: directive #") and "cycle" in msg and "Fix:" in msg
    assert ei.value.index == stages + 1 + s  # the order directive of stage s


# -- random directive sets on a real model ------------------------------------------------------------------
_tag_index = st.sampled_from([0, 1, 2, 5, "*"])
_filters = st.fixed_dictionaries({}, optional={"PP": _tag_index, "MB": _tag_index,
                                              "PASS": st.sampled_from(["F", "B", "BI", "*"]),
                                              "XX": _tag_index})
_ranks = st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True)
_directive = st.one_of(
    st.builds(piper.place, _filters, _ranks),
    st.builds(piper.split, st.integers(1, 5), st.none() | _filters),
    st.builds(piper.replicate, st.none() | _filters, st.none() | _ranks),
    st.lists(_filters, min_size=1, max_size=4).map(lambda fs: piper.order(*fs)),
    st.builds(lambda s, m, k: SCHEDULES[k](s, m), st.integers(1, 3), st.integers(1, 4),
              st.sampled_from(sorted(SCHEDULES))),
)


@settings(max_examples=80, **SETTINGS)
@given(st.integers(1, 3), st.integers(1, 4), st.lists(_directive, max_size=5))
def test_random_directive_sets_verify_or_raise_piper_errors(stages: int, world: int, directives: list[Any]) -> None:
    with time_limit(20):
        try:
            _, programs = plan(stages, world, directives)
            verify_programs(programs)
            event("verified")
        except PiperError as e:
            event(type(e).__name__)
            msg = str(e)
            assert msg.startswith("piper:")
            assert "internal" not in msg, msg  # a user mistake must never look like a compiler bug
            if isinstance(e, PiperDirectiveError):
                assert "Fix:" in msg


_json_leaf = (st.none() | st.booleans() | st.integers(-3, 5) | st.floats(allow_nan=False, width=16)
              | st.sampled_from(["F", "B", "*", "PP", "0", "x", "place"]))
_json = st.recursive(_json_leaf, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.sampled_from(["PP", "MB", "PASS", "x"]), c, max_size=3), max_leaves=6)
_fields = st.sampled_from(["filter", "devices", "device", "stream", "num_microbatches", "dim_name", "dim",
                           "reduce_stream", "gather_stream", "bucket_size", "bucket_mb", "zero", "shard_grads",
                           "shard_params", "filters", "x"])
_json_directive = st.builds(lambda op, rest: {"op": op, **rest},
                            st.sampled_from(["place", "split", "replicate", "order", "shard", "bogus"]) | _json,
                            st.dictionaries(_fields, _json, max_size=4))


@settings(max_examples=300, **SETTINGS)
@given(st.lists(_json_directive | _json, max_size=3))
def test_random_json_directives_parse_or_raise_directive_errors(raw: list[Any]) -> None:
    try:
        parse_directives(raw)
    except PiperDirectiveError as e:
        msg = str(e)
        assert msg.startswith("piper: directive") and "Fix:" in msg
