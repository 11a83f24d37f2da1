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
from piper_compile.precision import Precision
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
    ({"param_dtype": "fp16"}, "loss scaling"),
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
