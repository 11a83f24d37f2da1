"""options["mixed_precision"]: the policy vocabulary (FSDP2's MixedPrecisionPolicy or a dict), its
errors, and what each field means (precision.py); a one-rank bf16 step keeps fp32 master weights."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import piper_compile as piper
from piper_compile.errors import PiperError
from piper_compile.options import Options
from piper_compile.precision import LossScaling, Precision
from piper_compile.testing.models import build_model

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _parse(mp, optimizer=SGD) -> Precision:
    return Options.parse({"optimizer": optimizer, "mixed_precision": mp}).precision


def test_policy_and_dict_and_strings_agree():
    a = _parse(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    b = _parse({"param_dtype": "bf16", "reduce_dtype": "fp32"})
    c = _parse({"param_dtype": torch.bfloat16, "reduce_dtype": "float32"})
    assert a == b == c and a.active and a.param_dtype is torch.bfloat16
    assert Options.parse({}).precision == Precision() and not Precision().active


def test_defaults_differ_from_fsdp2_where_documented():
    p = _parse({"param_dtype": "bf16"})
    assert p.reduce(torch.float32) is torch.float32  # FSDP2 would reduce in param_dtype
    assert p.loss_dtype(torch.bfloat16) is torch.float32  # the returned loss is fp32
    assert _parse({"param_dtype": "bf16", "output_dtype": "bf16"}).loss_dtype(torch.bfloat16) is torch.bfloat16
    assert Precision().loss_dtype(torch.float64) is torch.float64


def test_cast_input_rules():
    p = _parse({"param_dtype": "bf16"})
    assert p.cast_input(torch.ones(2, 3)).dtype is torch.bfloat16
    assert p.cast_input(torch.ones(2, dtype=torch.long)).dtype is torch.long  # token ids stay integers
    assert p.cast_input(torch.tensor(1e-5, dtype=torch.float64)).dtype is torch.float64  # a lifted Python float
    off = _parse({"param_dtype": "bf16", "cast_forward_inputs": False})
    assert off.cast_input(torch.ones(2, 3)).dtype is torch.float32


@pytest.mark.parametrize("mp, words", [
    ({"param_dtype": "bf17"}, "is not a dtype"),
    ({"param_dtype": torch.int8}, "not a training dtype"),
    ({"param_dtype": torch.float8_e4m3fn}, "not a training dtype"),
    ({"param_dtype": "bf16", "keep_fp32": True}, "unknown key"),
    ({"param_dtype": "bf16", "cast_forward_inputs": "yes"}, "True or False"),
    ("bf16", "must be a MixedPrecisionPolicy or a dict"),
])
def test_bad_policies_are_piper_errors(mp, words):
    with pytest.raises(PiperError, match=words):
        _parse(mp)


def test_mixed_precision_needs_an_optimizer():
    with pytest.raises(PiperError, match="needs options\\['optimizer'\\]"):
        _parse({"param_dtype": "bf16"}, optimizer=None)
    assert _parse({"reduce_dtype": "bf16"}, optimizer=None).reduce(torch.float32) is torch.bfloat16


def test_one_rank_bf16_step_keeps_fp32_master_and_optimizer_state():
    model = build_model("gpt", 0)
    step = piper.compile(model, directives=[piper.split(2)], codegen="eager",
                         optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), mixed_precision={"param_dtype": "bf16"})
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    losses = [step(*batch) for _ in range(2)]
    assert all(loss.dtype is torch.float32 for loss in losses)
    assert all(p.dtype is torch.float32 for p in model.parameters())
    opt = piper.optimizer(step)
    states = [s for s in opt.state.values()]
    assert states and all(s["exp_avg"].dtype is torch.float32 for s in states)
    cs = piper.compiled_steps(step)[0]
    placeholders = cs.joint.gm.graph.find_nodes(op="placeholder")
    traced = [ph.meta["val"].dtype for ph, s in zip(placeholders, cs.joint.inputs) if s.kind == "param"]
    assert traced and set(traced) == {torch.bfloat16}  # the joint graph computes with the bf16 copy


def test_torch_compile_with_mixed_precision_says_to_use_piper_compile():
    model = build_model("mlp", 0)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"optimizer": SGD, "codegen": "eager", "mixed_precision": {"param_dtype": "bf16"}})
    with pytest.raises(PiperError, match="piper.compile"):
        step(*model.make_batch(4, torch.Generator().manual_seed(0)))


def test_dtype_read_from_a_tensor_follows_the_compute_dtype():
    """The MoE router computes in fp32 and casts back with ``.to(x.dtype)``: traced from the fp32 graph,
    that cast stayed fp32 and the next matmul mixed dtypes; re-traced in bf16 it is bf16, as in eager."""
    from piper_compile.testing.parity import RunConfig, run_mixed_parity

    cfg = RunConfig(model="moe", model_kwargs={"experts": 4}, local_batch=4, steps=2, mixed_precision={"param_dtype": "bf16"},
                    directives=[piper.split(2)])
    run_mixed_parity(cfg, 1)


def _zero3_plan(mp):
    from piper_compile.sim.cost import UniformCost
    from piper_compile.sim.shapes import Sizes
    from piper_compile.sim.simulate import copy_bytes, simulate

    model = build_model("gpt", 0)
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    plan = piper.plan(model, *batch, directives=[piper.replicate(zero=3, bucket_mb=0.01)], world_size=2,
                      options={"optimizer": SGD, "mixed_precision": mp})
    res = simulate(plan.programs, UniformCost(), plan.dag)
    return plan, res, copy_bytes(plan.programs[0], Sizes.from_dag(plan.dag))


@pytest.mark.slow  # slow: keeps the fast subset under 5 min
def test_simulator_predicts_bytes_per_dtype():
    """The DAG records the policy (META precision, parsed back with the DAG); the simulator keeps master
    weights and gradients in fp32 and counts ZeRO-3 gathers in bf16, half of fp32's bytes."""
    p32, r32, c32 = _zero3_plan(None)
    p16, r16, c16 = _zero3_plan({"param_dtype": "bf16"})
    from piper_compile.ir.dag import parse_dag

    text = p16.dag.to_text()
    assert '"precision":{"master":"float32","compute":"bfloat16","reduce":"float32"}' in text
    assert parse_dag(text).meta.precision == p16.dag.meta.precision and p32.dag.meta.precision is None
    assert r16.param_bytes == r32.param_bytes and r16.grad_bytes == r32.grad_bytes
    assert c32 == c16 == 0  # ZeRO-3: every parameter is gathered as a copy per use, none kept
    for r in (0, 1):
        assert 0 < r16.peak_gathered_bytes[r] == r32.peak_gathered_bytes[r] // 2


def test_fp16_turns_on_loss_scaling_with_grad_scaler_defaults():
    gs = torch.amp.GradScaler("cpu")
    default = _parse({"param_dtype": "fp16"}).scaling
    assert default == LossScaling() and default.init_scale == gs.get_scale()
    assert default.growth_interval == gs.get_growth_interval() and default.backoff_factor == gs.get_backoff_factor()
    mine = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    p = Options.parse({"optimizer": SGD, "mixed_precision": {"param_dtype": "fp16"}, "loss_scaling": mine}).precision
    assert p.scaling == LossScaling(init_scale=1024.0, growth_interval=3)
    off = Options.parse({"optimizer": SGD, "mixed_precision": {"param_dtype": "fp16"}, "loss_scaling": {"enabled": False}})
    assert off.precision.scaling is None
    assert _parse({"param_dtype": "bf16"}).scaling is None


@pytest.mark.parametrize("mp, scaling, words", [
    ({"param_dtype": "bf16"}, {"init_scale": 8.0}, "scales fp16 gradients"),
    (None, {"init_scale": 8.0}, "scales fp16 gradients"),
    ({"param_dtype": "fp16"}, {"init_scale": 8.0, "dynamic": True}, "unknown key"),
    ({"param_dtype": "fp16"}, {"backoff_factor": 2.0}, "not a valid scaler"),
    ({"param_dtype": "fp16"}, {"growth_interval": 0}, "not a valid scaler"),
    ({"param_dtype": "fp16"}, 65536.0, "must be a torch.amp.GradScaler or a dict"),
])
def test_bad_loss_scaling_is_a_piper_error(mp, scaling, words):
    with pytest.raises(PiperError, match=words):
        Options.parse({"optimizer": SGD, "mixed_precision": mp, "loss_scaling": scaling})


def test_scale_follows_grad_scaler_through_overflows():
    """LossScaler against torch.amp.GradScaler on the same sequence of good and overflowing steps: the
    same scales, the same steps skipped, gradients unscaled by the same factor."""
    from piper_compile.runtime.loss_scale import LossScaler

    cfg = LossScaling(init_scale=2.0**10, growth_interval=2)
    mine, gs = LossScaler(cfg), torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    gs.scale(torch.zeros(()))  # GradScaler makes its scale at the first scale()
    for bad in [False, True, False, False, False, True, True, False]:
        g = torch.tensor([1.0, float("inf") if bad else 2.0, 3.0]) * mine.scale
        p.grad = g.clone()
        before = p.detach().clone()
        gs.unscale_(opt)
        gs.step(opt)
        gs.update()
        out = mine.unscale([g], g.pow(2).sum())
        assert mine.scale == gs.get_scale() and (out is None) == bad == mine.last_skipped
        assert bad == torch.equal(p.detach(), before)
        if not bad:
            assert torch.equal(g, torch.tensor([1.0, 2.0, 3.0])) and float(out) == 14.0
    assert mine.skipped == 3


def test_one_rank_fp16_matches_grad_scaler_on_eager_and_skips_an_overflow():
    """fp16 compute with loss scaling on one rank, 2 micro-batches, against eager training with a fp16
    compute copy and torch's GradScaler: the same losses (inf at the step whose batch holds an inf), the
    same scales step by step (back off at the overflow, grow after 2 good steps), the updates within
    ~1e-7 and fp32 master weights."""
    from piper_compile.testing.parity import RunConfig, run_mixed_parity

    cfg = RunConfig(model="mlp", directives=[piper.split(2)], steps=5, optimizer=("AdamW", {"lr": 1e-2}),
                    mixed_precision={"param_dtype": "fp16"}, loss_scaling={"init_scale": 2.0**12, "growth_interval": 2},
                    poison=(1, 3))
    res = run_mixed_parity(cfg, 1)
    assert res[0]["scales"] == [2.0**12, 2.0**11, 2.0**11, 2.0**12, 2.0**12]
    assert not torch.isfinite(torch.tensor(res[0]["losses"][1])) and all(
        torch.isfinite(torch.tensor(x)) for i, x in enumerate(res[0]["losses"]) if i != 1)


def test_autocast_in_the_forward_alone_and_under_a_policy():
    """The user's own ``torch.autocast`` (bf16 matmuls) is captured by Dynamo and runs as eager runs it:
    alone (fp32 parameters, no policy) within fp32 summation noise of eager; under a bf16 policy (the
    autocast region then sees bf16 weights) within the mixed-precision bounds of ``run_mixed_parity``."""
    from piper_compile.testing.parity import RunConfig, run_mixed_parity, run_parity

    adamw = ("AdamW", {"lr": 1e-2})
    res = run_parity(RunConfig(model="autocast_mlp", steps=3, optimizer=adamw), 1, rtol=1e-5, atol=1e-6)
    assert all(p.dtype is torch.float32 for p in res[0]["params"].values())
    cfg = RunConfig(model="autocast_mlp", directives=[piper.split(2)], steps=3, optimizer=adamw,
                    mixed_precision={"param_dtype": "bf16"})
    run_mixed_parity(cfg, 1)


@pytest.mark.parametrize("err, err32, ok", [(0.078, 0.078, True), (0.046, 0.080, True),
                                            (0.077, 1e-6, False),  # computed in fp32: updates as fp32 training's
                                            (0.3, 0.3, False)])  # wrong: far beyond bf16's noise
def test_inductor_bf16_bounds_follow_the_dtype_s_noise(err, err32, ok):
    """``run_mixed_parity(within_noise=1.5)`` with the reference 0.077 from fp32 training (the CPU's and an
    H200's measured distances pass; an fp32 run, here 0.077 from the reference, or a wrong one fails)."""
    from piper_compile.testing.parity import _within_noise

    if ok:
        _within_noise(0, err, err32, 0.077, 1.5)
    else:
        with pytest.raises(AssertionError, match="at most 1.5 times"):
            _within_noise(0, err, err32, 0.077, 1.5)
