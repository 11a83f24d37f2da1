"""The ``checkpoint`` directive (capture/checkpointing.py): what each policy keeps, that training is
unchanged (bitwise with eager codegen, dropout masks included), that every recomputation runs once per
micro-batch under split backward, that ZeRO-3 gathers nothing more, and the errors."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper
from piper_compile.capture.regions import boundary_kind
from piper_compile.capture.remat import HANDOVER_SUFFIX
from piper_compile.errors import PiperDirectiveError
from piper_compile.testing.models import build_model

sys.path.insert(0, str(Path(__file__).parent))
from test_remat import ADAMW, BATCH, GPT_CFG, DropoutMLP, _kept_elements, _ops, _plan  # noqa: E402

MATMULS = ("addmm", "mm", "bmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention")


def _gpt_plan(policy: object = None, directives: list | None = None, **kw: object) -> piper.StaticPlan:
    dirs = list(directives or [piper.replicate()])
    if policy is not None:
        dirs.append(piper.checkpoint(policy=policy))
    return _plan(build_model("gpt", **GPT_CFG), dirs, **kw)


def _forward_in_backward(p: piper.StaticPlan, ops: tuple[str, ...]) -> int:
    return sum(_ops(s, o) for s in p.segments.values() if s.pass_ != "F" for o in ops)


@pytest.mark.slow  # in the full suite; keeps the fast subset under 5 min
def test_each_policy_keeps_less_than_the_next():
    """full keeps only the inputs (the batch: embeddings are the first region's own ops), selective also
    matmul/attention outputs, none everything; the backward recomputes the forward matmuls under full."""
    none, full, sel = _gpt_plan(), _gpt_plan("full"), _gpt_plan("selective")
    save = _gpt_plan({"save": ["addmm"]})
    assert _kept_elements(full) < _kept_elements(save) <= _kept_elements(sel) < _kept_elements(none)
    assert _kept_elements(full) == 0  # one region whose only inputs are the batch and the parameters
    forward_mm = sum(_ops(s, "addmm") for s in none.segments.values() if s.pass_ == "F")
    assert _ops_delta(full, none, "addmm") == forward_mm  # every linear runs again, once
    assert _ops_delta(sel, none, "addmm") == 0 and _ops_delta(full, none, "_scaled_dot_product_flash_attention_for_cpu") > 0


def _ops_delta(a: piper.StaticPlan, b: piper.StaticPlan, op: str) -> int:
    return _forward_in_backward(a, (op,)) - _forward_in_backward(b, (op,))


@pytest.mark.slow
@pytest.mark.parametrize("mb", [0.02, 0.05])
def test_budget_keeps_within_the_budget_and_more_with_more(mb: float):
    full, budget = _gpt_plan("full"), _gpt_plan({"budget_mb": mb})
    kept = _kept_elements(budget) * 4  # fp32
    assert _kept_elements(full) <= _kept_elements(budget) and kept <= mb * 2 ** 20
    if mb >= 0.05:
        assert _kept_elements(budget) > _kept_elements(full)
        # the dearest values per byte are kept first: matmul outputs before pointwise ones
        assert _ops_delta(budget, _gpt_plan(), "addmm") < _ops_delta(full, _gpt_plan(), "addmm")


def test_budget_below_what_must_be_kept_is_an_error():
    """The second stage keeps its input (the first stage's output) whatever it recomputes."""
    with pytest.raises(PiperDirectiveError, match=r"regions \[\{'PP': 1\}\] on devices \[1\] keep 0.00391 MB of "
                                                  r"activations \(per micro-batch times the 1 in flight.*above "
                                                  r"budget_mb=0.001"):
        _two_stage(piper.schedules.one_f_one_b(2, 2), {"budget_mb": 0.001})


def test_micro_batches_in_flight_come_from_each_ranks_order():
    from piper_compile.directives.spec import activation_window, parse_directives

    def window(*dirs: object) -> object:
        return activation_window(parse_directives([*piper.pipeline(2), piper.split(4), *dirs]))

    one_f_one_b, gpipe, none = (window(*piper.schedules.one_f_one_b(2, 4)), window(*piper.schedules.gpipe(2, 4)),
                                window())
    assert [one_f_one_b.inflight({"PP": s}) for s in (0, 1)] == [2, 1]  # 1F1B: p - s
    assert [gpipe.inflight({"PP": s}) for s in (0, 1)] == [4, 4] == [none.inflight({"PP": s}) for s in (0, 1)]
    assert one_f_one_b.stage({"PP": 1, "AC": 3}) == (1,) and window().stage({"EP": 0}) is None


@pytest.mark.slow
def test_budget_is_per_stage_over_the_micro_batches_in_flight():
    """1F1B holds 2 micro-batches on stage 0 and 1 on stage 1; GPipe 2 on both: with one budget, stage 1 keeps
    more per micro-batch under 1F1B, and every stage's kept bytes over its micro-batches in flight fit."""
    mb = 0.03
    plans = {name: _two_stage(sched(2, 2), {"budget_mb": mb})
             for name, sched in (("1f1b", piper.schedules.one_f_one_b), ("gpipe", piper.schedules.gpipe))}
    inflight = {"1f1b": (2, 1), "gpipe": (2, 2)}
    for name, p in plans.items():
        for stage in (0, 1):
            per_mb = _kept_elements(p, stage) * 4 / 2  # fp32, 2 micro-batches
            assert per_mb * inflight[name][stage] <= mb * 2 ** 20, (name, stage, per_mb)
    assert _kept_elements(plans["1f1b"], 1) > _kept_elements(plans["gpipe"], 1)
    assert _kept_elements(plans["1f1b"], 0) == _kept_elements(plans["gpipe"], 0)


@pytest.mark.parametrize("policy", ["full", *(pytest.param(p, marks=pytest.mark.slow)
                                              for p in ("selective", {"budget_mb": 0.05}))])
def test_training_is_bitwise_unchanged_and_matches_eager(policy: object):
    """Two micro-batches, eager codegen: gradients with checkpointing equal those without bitwise (the same
    ops on the same values) and match eager autograd."""
    torch.manual_seed(0)
    base = build_model("gpt", **GPT_CFG)
    x, y = base.make_batch(8, torch.Generator().manual_seed(1))  # type: ignore[operator]
    grads = [_grads(base, [piper.split(2)] + extra, x, y) for extra in ([], [piper.checkpoint(policy=policy)])]
    ref = copy.deepcopy(base)
    (ref(x[:4], y[:4]) / 2 + ref(x[4:], y[4:]) / 2).backward()
    for a, b, p in zip(*grads, ref.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


def _grads(base: nn.Module, directives: list, *batch: torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"codegen": "eager", "directives": directives})
    torch.manual_seed(seed)
    step(*batch)
    return [p.grad.clone() for p in model.parameters()]


def test_dropout_replays_the_forward_mask_bitwise():
    """Dropout is never drawn again: its output is rebuilt in the backward from the kept (1-byte) mask, so
    gradients with checkpointing equal those without bitwise at the same seed, and no random op runs in a
    backward segment."""
    base = DropoutMLP()
    x, y = base.make_batch(8, torch.Generator().manual_seed(1))
    on = _grads(base, [piper.checkpoint()], x, y, seed=3)
    off = _grads(base, [], x, y, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    assert not all(torch.equal(a, b) for a, b in zip(on, _grads(base, [], x, y, seed=4)))  # the mask matters
    p = _plan(base, [piper.replicate(), piper.checkpoint()])
    back = [n for s in p.segments.values() if s.pass_ == "B" for n in s.gm.graph.nodes]
    assert not [n for n in back if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert sum(1 for n in back if "native_dropout_backward" in str(n.target)) == 2  # replay + the real backward
    fw = next(s for s in p.segments.values() if s.pass_ == "F")
    kept = [o for o, v in zip(fw.gm.graph.find_nodes(op="output")[0].args[0], fw.outputs) if v != fw.loss]
    assert [o.meta["val"].dtype for o in kept] == [torch.bool]  # only the mask crosses to the backward


def _two_stage(schedule: list, policy: object = "full", extra: list | None = None) -> piper.StaticPlan:
    model = build_model("gpt", **{**GPT_CFG, "layers": 4})
    model.annotate_stages(2)  # type: ignore[operator]
    dirs = [*piper.pipeline(2), piper.split(2), *schedule, *(extra or [])]
    if policy is not None:
        dirs.append(piper.checkpoint({"PP": "*"}, policy=policy))
    return _plan(model, dirs)


def test_split_backward_recomputes_in_bi_once_and_hands_to_bw():
    """ZB-H1 cuts each stage's backward into BI and BW: a recomputed matmul output runs once (in BI, or in
    BW when only BW needs it), never in both; BW receives what BI recomputed as ``<value>~rc``."""
    p = _two_stage(piper.schedules.zb_h1(2, 2))
    for stage in (0, 1):
        pieces = [s for s in p.segments.values() if s.pass_ in ("BI", "BW") and dict(s.region) == {"PP": stage}]
        forward = {n.name for s in p.segments.values() if s.pass_ == "F" and dict(s.region) == {"PP": stage}
                   for n in s.gm.graph.nodes if n.op == "call_function"}
        seen: list[str] = []
        for s in pieces:
            seen += [n.name for n in s.gm.graph.nodes if n.name in forward and n.op == "call_function"
                     and not isinstance(n.meta.get("val"), torch.Tensor) or n.name in forward
                     and any(getattr(n.target, "__name__", "").startswith(m) for m in MATMULS)]
        assert seen and len(seen) == len(set(seen)), seen  # matmuls, attention and tuples (layer norm) once
    bw = [s for s in p.segments.values() if s.pass_ == "BW" and dict(s.region) == {"PP": 1}]
    assert any(v.endswith(HANDOVER_SUFFIX) for s in bw for v in s.inputs)  # stage 0 has no BI: all in BW
    assert _kept_elements(p) < _kept_elements(_two_stage(piper.schedules.zb_h1(2, 2), policy=None))


@pytest.mark.slow
def test_pipeline_stages_exchange_the_same_values():
    """Checkpointing never crosses a region: the stages send each other exactly what they did before."""
    on, off = (_two_stage(piper.schedules.one_f_one_b(2, 2), pol) for pol in ("full", None))
    where = lambda p: {v: s.region for s in p.segments.values() for v in s.outputs}  # noqa: E731
    cross = lambda p: {v for s in p.segments.values() for v in s.inputs  # noqa: E731
                       if v in where(p) and where(p)[v] != s.region}
    assert cross(on) == cross(off)


@pytest.mark.slow
def test_zero3_backward_steps_gather_the_same_buckets():
    """Under ZeRO-3 a step gathers the buckets it reads: a recomputation reads only parameters its step
    gathers anyway (others' values stay kept), so every step reads the same parameters as without."""
    for bucket in (1e-4, 0.05):
        dirs = [piper.replicate(zero=3, bucket_mb=bucket)]
        on, off = _gpt_plan("full", dirs, **ADAMW), _gpt_plan(None, dirs, **ADAMW)
        params = lambda p: {s.name: {v for v in s.inputs if v.startswith("param:")}  # noqa: E731
                            for s in p.segments.values()}
        assert params(on) == params(off)
        assert _kept_elements(on) < _kept_elements(off)


@pytest.mark.slow
def test_expert_and_tensor_parallel_boundaries_are_never_recomputed():
    moe = build_model("moegpt", **{**GPT_CFG, "experts": 4})
    p = _plan(moe, [piper.split(2), piper.replicate(), piper.shard({"EP": "*"}), piper.checkpoint()])
    assert not [s.name for s in p.segments.values() if s.pass_ != "F" and s.boundary in ("moe_fwd",)]
    tp = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
    gpt = build_model("gpt", **GPT_CFG)
    p = _plan(gpt, [piper.split(2), piper.shard_tensor(tp), piper.checkpoint()])
    markers = [n for s in p.segments.values() if s.boundary is None for n in s.gm.graph.nodes if boundary_kind(n)]
    assert not markers  # the tensor-parallel collectives stay their own segments, run once
    assert _ops_delta(p, _plan(gpt, [piper.split(2), piper.shard_tensor(tp)]), "addmm") > 0


@pytest.mark.parametrize("raw, match", [
    ({"op": "checkpoint", "policy": "most"}, "unknown checkpoint policy 'most'"),
    ({"op": "checkpoint", "policy": {"save": []}}, "non-empty list of aten op names"),
    ({"op": "checkpoint", "policy": {"budget_mb": -1}}, "positive number of MB"),
    ({"op": "checkpoint", "policy": {"keep": ["mm"]}}, "one key 'save' or 'budget_mb'"),
    ({"op": "checkpoint", "filter": {"PASS": "B"}}, "names regions, not passes"),
    ({"op": "checkpoint", "every": 2}, "unknown field"),
])
def test_bad_directives(raw: dict, match: str):
    with pytest.raises(PiperDirectiveError, match=match) as e:
        piper.directives.parse_directives([raw])
    assert str(e.value).startswith("piper:")


@pytest.mark.slow  # ~4 s: keeps the fast subset under 5 min
def test_bad_filters_and_conflicts_name_the_directive():
    model = build_model("gpt", **{**GPT_CFG, "layers": 2})
    model.annotate_stages(2)  # type: ignore[operator]
    base = [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)]
    with pytest.raises(PiperDirectiveError, match=r"matches no region"):
        _plan(model, [*base, piper.checkpoint({"PP": 7})])
    with pytest.raises(PiperDirectiveError, match=r"also matched by checkpoint directive #\d+ with another policy"):
        _plan(model, [*base, piper.checkpoint({"PP": "*"}), piper.checkpoint({"PP": 1}, policy="selective")])
    with pytest.raises(PiperDirectiveError, match=r"'save' names op\(s\) \['matmul_typo'\].*e\.g\."):
        _plan(model, [*base, piper.checkpoint(policy={"save": ["matmul_typo"]})])


class _Dropout2(nn.Module):
    """Two stacked dropouts in one region: each mask replayed, none drawn again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(F.dropout(torch.relu(self.a(x)), 0.2), 0.3)).square().mean()


@pytest.mark.slow
def test_stacked_dropouts_replay_their_masks():
    base = _Dropout2()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(_grads(base, [piper.checkpoint()], x, seed=5),
                                                  _grads(base, [], x, seed=5)))
