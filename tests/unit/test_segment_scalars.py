"""Scalars between segments (capture/segments.py): a size or a symbolic float used in another region is
recomputed there, never received as a tensor."""
from __future__ import annotations

import torch

import piper_compile as piper
from piper_compile.ir.dag import Kind
from piper_compile.testing.models import FloatArgument, build_model


def _pp2_plan(float_arg: bool) -> piper.StaticPlan:
    model = build_model("gelu_tanh", depth=2)
    model.annotate_stages(2)
    x, y = model.make_batch(4, torch.Generator().manual_seed(0))
    dirs = [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)]
    if float_arg:
        return piper.plan(FloatArgument(model), x, y, 1.0, directives=dirs, world_size=2)
    return piper.plan(model, x, y, directives=dirs, world_size=2)


def test_a_float_of_the_code_is_a_constant_under_piper_settings():
    """A forward that takes no float: Dynamo traces ``math.pi`` as the constant it is; no stage reads it."""
    p = _pp2_plan(float_arg=False)
    assert not any(v.endswith("pi") for s in p.segments.values() for v in s.inputs)
    assert not any(r.op.dtype == "sym" for r in p.dag.of_kind(Kind.RECV))


def test_symbolic_float_is_recomputed_on_the_consuming_stage():
    """``math.sqrt(2.0 / math.pi)`` in GPT-2's GELU: where Dynamo passes ``math.pi`` as a 0-dim input (a
    forward that takes a float), the constant is a symbolic float computed where stage 0 first uses it.
    Stage 1 used to receive it as a tensor (``RECV._sym_sqrt@mb0 shape () dtype sym`` -> ``module 'torch'
    has no attribute 'sym'``); now each stage computes it from the input."""
    p = _pp2_plan(float_arg=True)
    region_of = {v: s.region for s in p.segments.values() for v in s.outputs}
    meta = {v: m for s in p.segments.values() for v, m in s.out_meta.items()}
    crossing = {(s.name, v) for s in p.segments.values() for v in s.inputs
                if v in region_of and region_of[v] != s.region and meta[v][1] == "sym"}
    assert not crossing
    stage1 = [s for s in p.segments.values() if dict(s.region).get("PP") == 1]
    assert all(any(v.startswith("input:") and v.endswith("pi") for v in s.inputs) for s in stage1)
    recvs = list(p.dag.of_kind(Kind.RECV))
    assert recvs and not any(r.op.dtype == "sym" for r in recvs)
