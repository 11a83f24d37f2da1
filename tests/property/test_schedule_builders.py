"""Hypothesis over schedule builders: random rank counts, micro-batch counts, virtual stages and
builders give plans the verifier accepts (and, on real gloo ranks, eager numerics); random invalid
orders are rejected with PiperDirectiveError, never a hang."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import piper_compile as piper
from piper_compile.errors import PiperDirectiveError
from piper_compile.ir.dag import Kind
from piper_compile.testing.models import build_model
from piper_compile.testing.parity import RunConfig, run_parity

S = piper.schedules
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _strategy(kind: str, ranks: int, m: int, virtual: int) -> tuple[int, list]:
    """(number of stages, directives) for one builder."""
    if kind == "gpipe":
        return ranks, [*piper.pipeline(ranks), *S.gpipe(ranks, m)]
    if kind == "1f1b":
        return ranks, [*piper.pipeline(ranks), *S.one_f_one_b(ranks, m)]
    if kind == "zb_h1":
        return ranks, [*piper.pipeline(ranks), *S.zb_h1(ranks, m)]
    if kind == "interleaved":
        return ranks * virtual, [*S.round_robin(ranks, virtual), *S.interleaved_1f1b(ranks, virtual, m)]
    if kind == "zbv":
        return 2 * ranks, S.zbv(ranks, m)
    return 2 * ranks, S.dualpipe_v(ranks, m)


def _split_stages(directives: list) -> set[int]:
    """Stages whose backward some order step names as BI or BW (so it is split for every micro-batch;
    DualPipeV splits only where its zero-bubble phases need it)."""
    return {f["PP"] for d in directives if d["op"] == "order" for g in d["filters"] for f in g
            if f.get("PASS") in ("BI", "BW")}


@st.composite
def schedules(draw: st.DrawFn) -> tuple[str, int, int, int]:
    kind = draw(st.sampled_from(["gpipe", "1f1b", "zb_h1", "interleaved", "zbv", "dualpipe_v"]))
    ranks = draw(st.integers(1, 4))
    virtual = draw(st.integers(2, 3))
    m = draw(st.integers(1, 6))
    if kind == "interleaved":
        m = ranks * draw(st.integers(1, 3))
    if kind in ("zbv", "dualpipe_v"):
        m = max(m + draw(st.integers(0, 3)), ranks)  # DualPipeV's phase structure from 2 * ranks on
    return kind, ranks, m, virtual


def _plan(kind: str, ranks: int, m: int, virtual: int):
    stages, directives = _strategy(kind, ranks, m, virtual)
    model = build_model("mlp", dim=8, depth=stages)
    model.annotate_stages(stages)
    batch = model.make_batch(m * 2, torch.Generator().manual_seed(0))
    return piper.plan(model, *batch, directives=[piper.split(m), *directives], world_size=ranks), stages


@pytest.mark.slow
@settings(max_examples=25, **SETTINGS)
@given(schedules())
def test_random_builder_plans_verify(args):
    kind, ranks, m, virtual = args
    torch._dynamo.reset()
    plan, stages = _plan(kind, ranks, m, virtual)  # verify_programs ran inside and accepted it
    split = _split_stages(_strategy(kind, ranks, m, virtual)[1])
    if kind in ("zb_h1", "zbv"):
        assert split == set(range(stages))
    seen = [(i.node.tag("PASS"), i.node.tag("PP"), i.node.tag("MB"))
            for p in plan.programs for i in p.instrs if i.node.kind is Kind.COMPUTE]
    expected = {(p, s, mb) for s in range(stages) for p in (("F", "BI", "BW") if s in split else ("F", "B"))
                for mb in range(m)}
    assert set(seen) == expected  # (an empty BI of a first stage is still scheduled, once)
    assert len(seen) == len(set(seen))  # every step exactly once


@pytest.mark.slow
@settings(max_examples=12, **SETTINGS)
@given(schedules(), st.integers(0, 10**6))
def test_random_invalid_orders_are_rejected(args, seed):
    kind, ranks, m, virtual = args
    stages, directives = _strategy(kind, ranks, m, virtual)
    rng = random.Random(seed)
    orders = [d for d in directives if d["op"] == "order"]
    victim = rng.choice(orders)
    groups = victim["filters"]
    # move the backward (weight part for split schedules: BI of a first stage can be empty) of some
    # micro-batch to before its forward on that rank
    bwd = [i for i, g in enumerate(groups) if g[0]["PASS"] in ("B", "BW")]
    i = rng.choice(bwd)
    f = next(j for j, g in enumerate(groups) if any(x["PASS"] == "F" and x["PP"] == groups[i][0]["PP"]
                                                     and x["MB"] == groups[i][0]["MB"] for x in g))
    groups.insert(f, groups.pop(i))
    model = build_model("mlp", dim=8, depth=stages)
    model.annotate_stages(stages)
    torch._dynamo.reset()
    with pytest.raises(PiperDirectiveError, match="cycle"):
        piper.plan(model, *model.make_batch(2 * m, torch.Generator().manual_seed(0)),
                   directives=[piper.split(m), *directives], world_size=ranks)


@pytest.mark.slow
@settings(max_examples=4, **SETTINGS)
@given(st.sampled_from(["1f1b", "zb_h1", "interleaved", "zbv", "dualpipe_v"]), st.sampled_from([2, 4]))
def test_random_builder_matches_eager_on_two_ranks(kind, m):
    stages, directives = _strategy(kind, 2, m, 2)
    cfg = RunConfig(model="skip", model_kwargs={"dim": 16, "depth": stages}, stages=stages, local_batch=8,
                    directives=[piper.split(m), *directives], steps=2)
    run_parity(cfg, 2)
