"""Clipping by the global gradient norm costs a few multi-tensor kernels per step, not a few per parameter:
on a GPU every kernel is a launch the host issues (a 24-layer GPT has ~290 parameters: ~1,200 launches a
step for the norm and the scaling, done one tensor at a time), and it matches eager clipping."""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import piper_compile as piper
from piper_compile.runtime.state import scale_all, sum_of_squares
from piper_compile.testing.models import build_model
from piper_compile.testing.parity import RunConfig, eager_reference, run_parity

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def _ops_of_a_clipped_step(layers: int) -> Counter:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("gpt", 0, layers=layers)
    step = piper.compile(model, directives=[piper.split(2)], optimizer=ADAMW, clip_grad_norm=0.05, codegen="eager")
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    step(*batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(*batch)
    return Counter(e.name for e in prof.events())


@pytest.mark.slow  # slow: keeps the fast subset under 5 min
def test_the_norm_and_the_scaling_do_not_grow_with_the_parameter_count():
    small, big = _ops_of_a_clipped_step(1), _ops_of_a_clipped_step(4)
    assert big["aten::_foreach_norm"] == small["aten::_foreach_norm"] >= 1
    assert big["aten::_foreach_mul_"] == small["aten::_foreach_mul_"] >= 1
    assert big["aten::pow"] == small["aten::pow"] <= 2, (small["aten::pow"], big["aten::pow"])


def test_sum_of_squares_and_scale_all_match_the_per_tensor_forms():
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g).to(torch.bfloat16), torch.randn(0),
          torch.randn(11, 2, generator=g), torch.full((4,), 60000.0, dtype=torch.float16)]  # its norm overflows fp16
    expect = sum(t.float().pow(2).sum() for t in ts)
    torch.testing.assert_close(sum_of_squares(ts, torch.device("cpu")), expect, rtol=1e-6, atol=0)
    coef = torch.tensor(0.37)
    scaled = [t * coef.to(t.dtype) for t in ts]
    scale_all(ts, coef)
    assert all(torch.equal(a, b) for a, b in zip(ts, scaled))


@pytest.mark.slow  # a compiled run and its eager reference; the op counts above stay in the fast subset
def test_one_rank_clipped_adamw_matches_eager_clipping():
    """Losses and parameters after 3 steps as eager training with ``clip_grad_norm_`` (which also takes
    the norm with ``_foreach_norm``); the norm is far above the bound, so every step clips."""
    cfg = RunConfig(model="gpt", directives=[piper.split(2)], steps=3, optimizer=("AdamW", {"lr": 1e-2}),
                    clip_grad_norm=0.05, local_batch=4)
    run_parity(cfg, 1)
    assert min(eager_reference(cfg, 1)["grad_norms"]) > 0.5
