"""options["mixed_precision"] on real gloo ranks against eager training in the same dtypes
(``testing/parity.ComputeCopy``: fp32 master weights, a bf16 compute copy), AdamW, 3 steps. Why the
tolerances are what they are: ``testing/parity.run_mixed_parity``. The reference cuts the batch into
the same micro-batches as each strategy (``ComputeCopy``), so the bf16 roundings happen at the same
points and the runs agree to ~1e-7."""
from __future__ import annotations

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.models import build_model
from piper_compile.testing.parity import RunConfig, run_mixed_parity

pytestmark = pytest.mark.slow

ADAMW = ("AdamW", {"lr": 1e-3, "weight_decay": 0.01})
BF16 = {"param_dtype": "bf16"}


def _pp_dp(zero: int, m: int = 4) -> list:
    return [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(m), *piper.schedules.one_f_one_b(2, m),
            piper.replicate({"PP": "*"}, zero=zero, bucket_mb=0.01)]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_dp2_zero_gpt_bf16(zero: int):
    """Parity, and memory by dtype: persistent bytes per rank (fp32 master shards, AdamW state in fp32,
    bf16 compute copies of what is not gathered per use) within 10% of the simulator's prediction; the
    ZeRO-3 gathers hold bf16, half of the fp32 parameters they gather."""
    cfg = RunConfig(model="gpt", directives=[piper.replicate(zero=zero, bucket_mb=0.01), piper.split(2)],
                    steps=3, optimizer=ADAMW, local_batch=4, mixed_precision=BF16)
    res = run_mixed_parity(cfg, 2)
    full = sum(p.numel() * 4 for p in build_model("gpt", 0).parameters())
    for r in res:
        m, p = r["memory"].measured, r["memory"].predicted
        assert abs(m.persistent - p.persistent) <= 0.10 * p.persistent, (m, p)
        assert m.compute_copies == p.compute_copies, (m, p)
        if zero == 3:
            assert m.compute_copies == 0 and 0 < m.peak_gathered_params < full / 2, (m, full)
            assert abs(m.peak_gathered_params - p.peak_gathered_params) <= 0.10 * p.peak_gathered_params, (m, p)
        else:  # every parameter's bf16 copy is kept between steps: half the fp32 model
            assert m.compute_copies == full // 2, (m, full)


def test_dp2_zero3_bf16_reduce():
    """reduce_dtype bf16: the reduce-scatter moves bf16. The reference rounds each replica's sum to bf16
    before adding them; a run that reduced in fp32 instead misses it by ~1e-2 and fails."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    cfg = RunConfig(model="gpt", directives=[piper.replicate(zero=3, bucket_mb=0.01)], steps=3, optimizer=ADAMW,
                    local_batch=4, mixed_precision=policy)
    run_mixed_parity(cfg, 2)


def test_pp2_1f1b_bf16():
    cfg = RunConfig(model="gpt", stages=2, local_batch=8, steps=3, optimizer=ADAMW, mixed_precision=BF16,
                    directives=[*piper.pipeline(2), piper.split(4), *piper.schedules.one_f_one_b(2, 4)])
    res = run_mixed_parity(cfg, 2)
    assert res[0]["p2p"] > 0


def test_pp2_x_dp2_zero3_bf16():
    cfg = RunConfig(model="gpt", stages=2, local_batch=8, directives=_pp_dp(3), steps=3, optimizer=ADAMW,
                    mixed_precision=BF16)
    run_mixed_parity(cfg, 4)


def test_dp2_bf16_all_reduce_in_bf16():
    cfg = RunConfig(model="mlp", directives=[piper.replicate(bucket_mb=0.001)], steps=3, optimizer=ADAMW,
                    mixed_precision={"param_dtype": "bf16", "reduce_dtype": "bf16"})
    run_mixed_parity(cfg, 2)


def test_inductor_bf16_single_rank():
    """The compiled segments in bf16. Inductor's bf16 kernels keep fused intermediates (and its
    decomposed norms and softmax) in fp32, so they do not round where eager does: 4.6% from eager bf16
    and 8.0% from fp32 training here, where eager bf16 is 7.7% from fp32 training (AdamW turns rounding
    into sign flips on near-zero gradients). Bounded by that noise (``within_noise``), which still fails a
    run that computed in fp32 (0% from fp32) or wrongly (O(1))."""
    cfg = RunConfig(model="gpt", directives=[piper.split(2)], steps=3, optimizer=ADAMW, mixed_precision=BF16,
                    codegen="inductor")
    res = run_mixed_parity(cfg, 1, loss_tol=2**-6, within_noise=1.5)
    assert not res[0]["fallbacks"]


S = piper.schedules
TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


@pytest.mark.parametrize("schedule", ["zbv", "dualpipe_v"])
def test_v_schedules_bf16(schedule: str):
    """Split backward (BI/BW) and, for DualPipeV, overlap slots, in bf16."""
    cfg = RunConfig(model="gpt", model_kwargs={"layers": 4}, stages=4, steps=3, optimizer=ADAMW, mixed_precision=BF16,
                    directives=[piper.split(8), *getattr(S, schedule)(2, 8)])
    res = run_mixed_parity(cfg, 2)
    assert "BW" in res[0]["program"]


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_ep2_bf16(codegen):
    """Expert parallel: tokens cross ranks in bf16, experts computed in bf16, their gradients in fp32.
    SGD: routing is discrete, see test_expert_parallel. Under Inductor the compiled experts write their
    bf16 weight gradients into the fp32 buffers themselves (codegen/experts.py); eagerly the reference's
    gradients are copied or added in after it."""
    cfg = RunConfig(model="moe", model_kwargs={"experts": 4}, local_batch=4, steps=3, mixed_precision=BF16,
                    directives=[piper.split(2), piper.replicate(), piper.shard({"EP": 0})], codegen=codegen)
    # An expert's weight gradient is one bf16 matmul over the rows both replicas sent it, where the
    # reference rounds each replica's part on its own: ~3e-4 apart, 10x nearer than fp32 training.
    # Inductor's bf16 segments keep fused intermediates in fp32 (test_inductor_bf16_single_rank): with SGD's
    # small updates that is 0.0026 from the reference against 0.0033 from fp32 training (the same with the
    # expert gradients returned instead of written into the buffers: measured), so its bound is looser; a
    # gradient not written at all would leave its expert's update 1.0 away.
    bounds = {"max_err": 1e-3, "closer": 0.2} if codegen == "eager" else {"max_err": 0.06, "closer": 0.9, "loss_tol": 2**-6}
    res = run_mixed_parity(cfg, 2, **bounds)
    assert not any(r["fallbacks"] for r in res)


def test_tp2_sequence_parallel_bf16():
    cfg = RunConfig(model="gpt", model_kwargs={"layers": 2}, local_batch=4, tp=2, steps=3, mixed_precision=BF16,
                    optimizer=("SGD", {"lr": 0.05, "momentum": 0.9}),
                    directives=[piper.split(2), piper.shard_tensor(TP, sequence_parallel=True)])
    # Row-parallel layers round each rank's partial sum to bf16 and add the halves in bf16 (as Megatron's
    # bf16 all-reduce does) where the reference rounds one full matmul: ~3e-3 apart, fp32 training ~5e-3.
    # The bounds still fail a lost reduction (O(1)) or a run that computed in fp32 (0 from fp32).
    run_mixed_parity(cfg, 2, max_err=0.01, closer=0.8)


def test_pp2_x_dp2_zero3_autocast_in_forward_under_bf16_policy():
    cfg = RunConfig(model="autocast_mlp", stages=2, local_batch=8, directives=_pp_dp(3), steps=3, optimizer=ADAMW,
                    mixed_precision=BF16)
    run_mixed_parity(cfg, 4)
