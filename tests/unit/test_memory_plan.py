"""The memory plan before anything runs: ``piper.plan(...).memory`` per rank (figures, the step where the
activations peak, the largest contributors), the ``explain`` report, and ``options["memory_budget_mb"]``
rejecting a plan that does not fit, naming the rank, the step and what fills it."""
from __future__ import annotations

import functools

import pytest
import torch

import piper_compile as piper
from piper_compile.errors import PiperError, PiperPlanError
from piper_compile.ir.dag import Kind
from piper_compile.memory import MiB, optimizer_state_factor
from piper_compile.sim.memory_walk import INSIDE, TEMP
from piper_compile.testing.models import build_model

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CFG = {"dim": 32, "heads": 4, "layers": 4, "seq": 16, "vocab": 64}


def _plan(directives: list, world: int = 2, **options: object) -> piper.StaticPlan:
    model = build_model("gpt", **CFG)
    model.annotate_stages(2)  # type: ignore[operator]
    x, y = model.make_batch(8, torch.Generator().manual_seed(0))  # type: ignore[operator]
    return piper.plan(model, x, y, directives=directives, world_size=world, options={"optimizer": ADAMW, **options})


def _pp(schedule: str = "1f1b", m: int = 4) -> list:
    sched = piper.schedules.one_f_one_b if schedule == "1f1b" else piper.schedules.gpipe
    return [*piper.pipeline(2), piper.split(m), *sched(2, m)]


@pytest.mark.slow  # ~4 s: keeps the fast subset under 5 min
def test_plan_memory_names_the_peak_step_and_its_values():
    mem = _pp()
    plan = _plan(mem)
    for r, m in plan.memory.items():
        f = m.figures
        assert f.params > 0 and f.optimizer == 2 * f.params  # AdamW: exp_avg and exp_avg_sq per element
        assert f.peak_total >= f.persistent + f.peak_activations - f.grads
        # the peak is after one of the rank's steps (a compute step, or a SEND during which a reordered
        # backward ran early: gradients go into their buffers inside the segments, so no step's gradient
        # outputs dominate), and what is live there are activations the rank's compute steps produced
        program = next(p for p in plan.programs if p.rank == r)
        made = {v for ins in program.instrs if ins.node.kind is Kind.COMPUTE for v in ins.node.outputs}
        assert 0 <= m.peak_pos < len(program.instrs) and m.live_at_peak
        # (or the intermediates a segment holds while it runs, sim/segment_memory)
        segs = {f"{INSIDE}{ins.node.op.segment}" for ins in program.instrs if hasattr(ins.node.op, "segment")}
        held = {v for ins in program.instrs for v in ins.node.outputs} | segs  # received values too
        assert all(v in held or v.startswith(TEMP) for v, _ in m.live_at_peak), (r, m.live_at_peak[:3])
        assert any(v in made and b for v, b in m.live_at_peak), (r, m.peak_step, m.live_at_peak[:3])
        assert sum(b for _, b in m.live_at_peak) == f.peak_activations  # the values live at the peak add up
        assert "activations peak at step #" in str(m) and "largest (MiB)" in str(m)
    # GPipe keeps every micro-batch until the backward: its stage-0 activation peak is higher
    assert _plan(_pp("gpipe")).memory[0].figures.peak_activations > plan.memory[0].figures.peak_activations


@pytest.mark.slow
def test_checkpointing_lowers_the_predicted_peak():
    base = _plan(_pp()).memory[0].figures.peak_activations
    ck = _plan([*_pp(), piper.checkpoint({"PP": "*"})]).memory[0].figures.peak_activations
    # the recomputed stage's intermediates are live while its backward runs (sim/segment_memory): 0.56 here
    assert ck < 0.6 * base


@pytest.mark.slow  # ~4 s: keeps the fast subset under 5 min
def test_budget_rejects_a_plan_before_it_runs_naming_rank_step_and_contributors():
    need = max(m.figures.peak_total for m in _plan(_pp()).memory.values()) / MiB
    _plan(_pp(), memory_budget_mb=need * 1.01)  # fits
    with pytest.raises(PiperPlanError) as e:
        _plan(_pp(), memory_budget_mb=need * 0.9)
    msg = str(e.value)
    assert msg.startswith("piper: the plan needs") and "on rank 0" in msg and "memory_budget_mb" in msg
    assert "activations peak at step #" in msg and "largest: optimizer state" in msg and "Fix:" in msg


@pytest.mark.parametrize("bad", [0, -3, "big", True])
def test_bad_budget_is_a_clear_error(bad: object):
    with pytest.raises(PiperError, match=r"options\['memory_budget_mb'\] must be a positive number of MiB"):
        _plan(_pp(), memory_budget_mb=bad)


def test_optimizer_state_factor_from_partials_classes_and_instances():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_state_factor(ADAMW) == 2 == optimizer_state_factor(torch.optim.Adam)
    assert optimizer_state_factor(functools.partial(torch.optim.SGD, lr=0.1)) == 0
    assert optimizer_state_factor(functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)) == 1
    assert optimizer_state_factor(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == 1
    assert optimizer_state_factor(None) == 0


def test_explain_prints_memory_per_rank(capsys: pytest.CaptureFixture[str]):
    from piper_compile.cli import main

    assert main(["explain", "--model", "gpt", "--stages", "2", "--microbatches", "4", "--ranks", "0", "1"]) == 0
    out = capsys.readouterr().out
    assert "# memory rank 0: peak" in out and "# memory rank 1: peak" in out and "largest (MiB)" in out
