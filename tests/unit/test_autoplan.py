"""piper.autoplan (planning only): stages balanced by FLOPs, every returned strategy verified and within the
memory budget, checkpointing only where memory needs it, the network model steering the choice, the
model left as it was, and a choice that re-plans from scratch to the same prediction."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import piper_compile as piper
from piper_compile.autoplan import network_cost
from piper_compile.autoplan.stages import balanced_split, block_costs
from piper_compile.sim import simulate_plan
from piper_compile.testing.models import Block, build_model

pytestmark = pytest.mark.slow


def _gpt(layers: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = build_model("gpt", layers=layers)
    return model, model.make_batch(8, torch.Generator().manual_seed(0))


class Funnel(nn.Module):
    """Blocks of very different cost: a contiguous split by layer count is far from balanced."""

    def __init__(self) -> None:
        super().__init__()
        widths = [16] * 7 + [32, 32]  # six cheap layers, then two 2x and 4x as dear
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(x, y)


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1, 1, 1, 1, 4], 2) == (0, 0, 0, 0, 1)
    assert balanced_split([1, 1, 1, 1], 2) == (0, 0, 1, 1)
    assert balanced_split([1, 1, 1, 1], 2, before=0, after=3) == (0, 0, 0, 1)  # the head weighs on the last
    assert balanced_split([5, 1, 1, 1], 4) == (0, 1, 2, 3)
    with pytest.raises(piper.PiperError, match="5 stages do not fit 4 blocks"):
        balanced_split([1, 1, 1, 1], 5)


def test_stages_are_balanced_by_flops_not_layer_count():
    model = Funnel()
    batch = (torch.randn(16, 16), torch.randn(16, 32))
    costs = block_costs(model, batch)
    assert costs.path == "layers" and costs.flops[7] > 3 * costs.flops[1]
    assert costs.split(2) == (0, 0, 0, 0, 0, 0, 1, 1)  # layer counts would give (0, 0, 0, 0, 1, 1, 1, 1)
    per_stage = costs.stage_flops(2)
    assert max(per_stage) < 0.6 * sum(per_stage), per_stage
    assert all(p.grad is None for p in model.parameters())


def test_autoplan_ranks_verified_plans_within_the_budget_and_leaves_the_model_alone():
    model, batch = _gpt()
    kw = dict(world_size=4, top=None, schedules=("1f1b", "zbv"), zero_levels=(0, 3))
    free = piper.autoplan(model, *batch, **kw)
    budget = sorted(c.max_peak_mb for c in free.ranked)[len(free.ranked) // 2]  # about half of them fit
    res = piper.autoplan(model, *batch, memory_mb=budget, checkpoint=("none",), **kw)
    fit = [c.candidate for c in free.ranked if c.max_peak_mb <= budget]
    assert [c.candidate for c in res.ranked] == fit and len(res.rejected) == len(free.ranked) - len(fit)
    times = [c.step_time for c in res.ranked]
    assert times == sorted(times) and res.planned >= len(res.ranked)
    assert all(c.why for c in res.ranked)
    assert "faster than #2" in res.ranked[0].why or "as fast as #2" in res.ranked[0].why
    assert str(res).startswith("# autoplan:")
    for block in model.blocks:  # no tags left behind, no gradients
        assert type(block) is Block and not hasattr(block, "_piper_tags")
    assert all(p.grad is None for p in model.parameters())


def test_a_choice_replans_from_scratch_to_the_same_prediction():
    """The shared capture autoplan plans on (and the segments it cuts once for candidates that cut alike,
    e.g. ZeRO-1 and ZeRO-2 of one pipeline, not an interleaved and a V placement of one stage count, whose
    tied gradients split differently) gives what piper.plan on the annotated model gives."""
    model, batch = _gpt()
    res = piper.autoplan(model, *batch, world_size=4, top=None, schedules=("1f1b", "interleaved", "dualpipev"),
                         zero_levels=(1, 2), memory_mb=0.66)  # some need checkpointing
    firsts: dict = {}
    for c in res.ranked:  # the best of each pipeline degree, schedule and ZeRO level
        firsts.setdefault((c.candidate.pp, c.candidate.schedule, c.candidate.zero), c)
    picks = list(firsts.values()) + [c for c in res.ranked if c.candidate.checkpoint != "none"][:1]
    assert {k[1] for k in firsts} >= {"1f1b", "interleaved", "dualpipev"} and {k[2] for k in firsts} >= {1, 2}, str(res)
    for choice in picks:
        fresh, _ = _gpt()
        choice.annotate(fresh)
        local = tuple(t[: t.shape[0] // choice.local_batch_divisor] for t in batch)
        plan = piper.plan(fresh, *local, directives=choice.directives, world_size=4,
                          options={"optimizer": torch.optim.AdamW})
        assert plan.dag.to_text() == choice.dag_text, choice.candidate
        sim = simulate_plan(plan, network_cost("ethernet", 1e12))
        assert sim.step_time == pytest.approx(choice.step_time, rel=1e-9), choice.candidate
        peak = max(m.figures.peak_total for m in plan.memory.values()) / 2**20
        assert peak == pytest.approx(choice.max_peak_mb, rel=1e-9), choice.candidate


def test_checkpointing_is_chosen_only_when_memory_needs_it():
    model, batch = _gpt(layers=2)
    kw = dict(world_size=2, top=None, schedules=("1f1b",), zero_levels=(0,))
    free = piper.autoplan(model, *batch, **kw)
    assert all(c.candidate.checkpoint == "none" for c in free.ranked)
    budget = min(c.max_peak_mb for c in free.ranked) * 0.99
    tight = piper.autoplan(model, *batch, memory_mb=budget, **kw)
    assert tight.ranked and all(c.candidate.checkpoint in ("selective", "full") for c in tight.ranked)
    assert all(c.max_peak_mb <= budget for c in tight.ranked)
    assert {"AC": "*"} in [d.get("filter") for d in tight.best.directives if d["op"] == "checkpoint"]


def test_a_budget_nothing_fits_names_the_closest_strategy():
    model, batch = _gpt(layers=2)
    with pytest.raises(piper.PiperPlanError, match=r"none of the \d+ strategies for 2 ranks fits memory_mb=0.01"):
        piper.autoplan(model, *batch, world_size=2, memory_mb=0.01, schedules=("1f1b",), zero_levels=(0,))
    with pytest.raises(piper.PiperError, match="unknown network 'carrier-pigeon'"):
        piper.autoplan(model, *batch, world_size=2, network="carrier-pigeon")


def test_the_network_steers_the_choice():
    model, batch = _gpt(layers=2)
    kw = dict(world_size=2, schedules=("1f1b",), zero_levels=(0,))
    slow_pp = piper.autoplan(model, *batch, network={"pp": (1e6, 1e-3), "dp": (1e12, 0.0), "loss": (1e12, 0.0)}, **kw)
    slow_dp = piper.autoplan(model, *batch, network={"pp": (1e12, 0.0), "dp": (1e6, 1e-3), "loss": (1e6, 1e-3)}, **kw)
    assert slow_pp.best.candidate.pp == 1 and slow_dp.best.candidate.dp == 1, (slow_pp, slow_dp)


def test_expert_parallel_is_searched_for_models_with_experts():
    model = build_model("moegpt", layers=2)
    batch = model.make_batch(8, torch.Generator().manual_seed(0))
    res = piper.autoplan(model, *batch, world_size=2, top=None, schedules=("1f1b",), zero_levels=(0,))
    assert any(c.candidate.ep for c in res.ranked) and any(not c.candidate.ep for c in res.ranked)
    ep = next(c for c in res.ranked if c.candidate.ep)
    assert {"op": "shard", "filter": {"EP": "*"}, "stream": "ep"} in ep.directives
    # a skewed router, planned for: the same expert-parallel strategy holds more and takes longer
    skew = piper.autoplan(model, *batch, world_size=2, top=None, schedules=("1f1b",), zero_levels=(0,),
                          expert_load=1.5)
    same = next(c for c in skew.ranked if c.candidate == ep.candidate)
    assert {"op": "shard", "filter": {"EP": "*"}, "stream": "ep", "load": 1.5} in same.directives
    assert same.max_peak_mb > ep.max_peak_mb and same.step_time > ep.step_time, (same, ep)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(world=st.sampled_from([1, 2, 3, 4]), squeeze=st.floats(0.6, 1.4))
def test_no_returned_plan_is_rejected_or_over_budget(world: int, squeeze: float):
    """Hypothesis over world sizes and budgets (planning only): each returned choice fits the budget, and the
    best, planned again from scratch on the annotated model, verifies and fits it too."""
    model, batch = _gpt(2)
    batch = tuple(t[:6] for t in batch) if world == 3 else batch
    kw = dict(world_size=world, schedules=("1f1b",), zero_levels=(0, 2), top=None)
    free = piper.autoplan(model, *batch, **kw)
    budget = min(c.max_peak_mb for c in free.ranked) * squeeze
    try:
        res = piper.autoplan(model, *batch, memory_mb=budget, **kw)
    except piper.PiperPlanError as e:
        assert squeeze < 1 and "none of the" in str(e)
        return
    assert all(c.max_peak_mb <= budget for c in res.ranked)
    assert {c.candidate for c in free.ranked if c.max_peak_mb <= budget} <= {c.candidate for c in res.ranked}
    fresh, _ = _gpt(2)
    res.best.annotate(fresh)
    local = tuple(t[: t.shape[0] // res.best.local_batch_divisor] for t in batch)
    plan = piper.plan(fresh, *local, directives=res.best.directives, world_size=world,
                      options={"optimizer": torch.optim.AdamW})  # verifies every rank's program
    assert max(m.figures.peak_total for m in plan.memory.values()) <= budget * 2**20


def test_cli_autoplan_and_explain_take_the_users_model(capsys, tmp_path):
    from piper_compile.cli import main

    out = tmp_path / "ranked.json"
    assert main(["autoplan", "--model", "piper_compile.testing.models:GPT", "--world-size", "2", "--schedules",
                 "1f1b", "--zero", "0", "--top", "2", "--memory-mb", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# autoplan:") and "  1. " in text and "  2. " in text, text
    import json

    ranked = json.loads(out.read_text())
    assert len(ranked) == 2 and ranked[0]["directives"] and ranked[0]["peak_mb"] <= 64
    assert main(["explain", "--model", "piper_compile.testing.models:GPT", "--stages", "2"]) == 0
    assert "verified in" in capsys.readouterr().out
    assert main(["autoplan", "--model", "no_such_pkg.mod:make", "--world-size", "2"]) == 2
    assert "cannot load it" in capsys.readouterr().err


def test_profile_measures_this_models_flop_rate_and_autoplan_uses_it():
    model, batch = _gpt(layers=2)
    prof = piper.profile(model, *batch, steps=3, warmup=1)
    assert prof.flops == block_costs(model, batch).stage_flops(1)[0] and prof.step_s > 0
    assert 1e6 < prof.flops_per_s < 1e13 and "GFLOP/s achieved" in str(prof)
    assert all(p.grad is None for p in model.parameters())
    kw = dict(world_size=1, top=1)
    slow = piper.autoplan(model, *batch, flops_per_s=prof.flops_per_s, **kw).best
    fast = piper.autoplan(model, *batch, flops_per_s=100 * prof.flops_per_s, **kw).best
    assert slow.step_time == pytest.approx(prof.step_s, rel=0.5)  # one rank: the step is the model's compute
    assert fast.step_time < slow.step_time / 50
    with pytest.raises(piper.PiperError, match="steps must be >= 1"):
        piper.profile(model, *batch, steps=0)


TP_PLAN = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


def test_tensor_parallel_degrees_are_searched_with_a_tp_plan():
    """TP changes the capture (each rank's pieces): its candidates capture per (DP, TP) degree, and a TP
    choice re-plans from scratch to the same DAG."""
    model, batch = _gpt(layers=2)
    res = piper.autoplan(model, *batch, world_size=4, top=None, schedules=("1f1b",), zero_levels=(0,),
                         tp_plan=TP_PLAN)
    tps = {c.candidate.tp for c in res.ranked}
    assert tps == {1, 2, 4}, str(res)
    both = next(c for c in res.ranked if c.candidate.tp == 2 and c.candidate.pp == 2)
    assert both.candidate.tp_groups() == [[0, 1], [2, 3]] and [both.replica(r) for r in range(4)] == [0, 0, 0, 0]
    dp_tp = next(c for c in res.ranked if c.candidate.tp == 2 and c.candidate.dp == 2)
    assert [dp_tp.replica(r) for r in range(4)] == [0, 0, 1, 1]
    for choice in (both, dp_tp):
        fresh, _ = _gpt(layers=2)
        choice.annotate(fresh)
        local = tuple(t[: t.shape[0] // choice.local_batch_divisor] for t in batch)
        plan = piper.plan(fresh, *local, directives=choice.directives, world_size=4,
                          options={"optimizer": torch.optim.AdamW})
        assert plan.dag.to_text() == choice.dag_text, choice.candidate


def test_options_such_as_mixed_precision_reach_every_candidate():
    model, batch = _gpt(layers=2)
    fp32 = piper.autoplan(model, *batch, world_size=1, top=1)
    bf16 = piper.autoplan(model, *batch, world_size=1, top=1, options={"mixed_precision": {"param_dtype": "bf16"}})
    assert "precision" in bf16.best.dag_text and "precision" not in fp32.best.dag_text
    assert bf16.best.max_peak_mb != fp32.best.max_peak_mb


def test_a_measured_network_is_this_machines_link():
    """``network="measured"``: a ping-pong between two local gloo ranks gives every traffic class's link."""
    from piper_compile.autoplan import measure_link

    bw, lat = measure_link(reps=5)
    assert bw > 1e6 and 0 < lat < 0.1, (bw, lat)  # loopback: well above 1 MB/s, well under 100 ms
    cost = network_cost("measured")
    assert set(cost.links) == {"pp", "dp", "ep", "tp", "loss"} and len(set(cost.links.values())) == 1


_PARALLEL_SCRIPT = r"""
import json, sys, torch
import piper_compile as piper
from piper_compile.testing.models import build_model

def run(workers):
    model = build_model("gpt", layers=4)
    batch = model.make_batch(16, torch.Generator().manual_seed(0))
    res = piper.autoplan(model, *batch, world_size=8, memory_mb=float(sys.argv[1]), top=None, workers=workers,
                         schedules=("1f1b", "interleaved", "dualpipev"), network="ib")
    return {"ranked": [(c.candidate.label(), c.step_time, c.peak_mb, c.why, c.dag_text) for c in res.ranked],
            "rejected": res.rejected, "planned": res.planned, "pruned": res.pruned, "workers": res.workers}

print(json.dumps([run(1), run(2)]))
"""


def test_a_parallel_search_finds_what_the_serial_one_finds(tmp_path):
    """Two forked workers (one captured graph each) rank, explain and reject exactly as one process does,
    under a budget that rejects and prunes some strategies."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "search.py"
    script.write_text(_PARALLEL_SCRIPT)
    out = subprocess.run([sys.executable, str(script), "0.45"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    serial, parallel = json.loads(out.stdout.splitlines()[-1])
    assert serial.pop("workers") == 1 and parallel.pop("workers") == 2
    assert serial["rejected"] and serial["ranked"]  # the budget rejects some and keeps some
    assert parallel == serial
