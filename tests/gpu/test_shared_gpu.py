"""Two and four ranks sharing one GPU over gloo (NCCL refuses two ranks on one device): every transfer of
a CUDA tensor is staged through pinned host memory (runtime/comm.py). Each strategy against eager on the
same GPU; bf16 parity on one GPU with Inductor -> Triton. Skipped without CUDA; ``scripts/gpu_check.sh``
runs them and reports a table."""
from __future__ import annotations

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.parity import RunConfig, run_mixed_parity, run_parity

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ADAM = ("AdamW", {"lr": 1e-3})
TOL = {"rtol": 1e-3, "atol": 1e-4}  # cuBLAS picks other kernels per micro-batch shape: fp32 summation order


def _shared(**kw) -> RunConfig:
    return RunConfig(device="cuda", shared_gpu=True, optimizer=ADAM, **kw)


def test_shared_gpu_dp2():
    cfg = _shared(model="gpt", directives=[piper.replicate(bucket_mb=0.05), piper.split(2)])
    res = run_parity(cfg, 2, **TOL)
    assert res[0]["collectives"].get("grad")


def test_shared_gpu_pp2_1f1b():
    cfg = _shared(model="gpt", stages=2, directives=[*piper.pipeline(2), piper.split(4),
                                                       *piper.schedules.one_f_one_b(2, 4)])
    assert run_parity(cfg, 2, **TOL)[0]["p2p"] > 0


def test_shared_gpu_pp2_x_dp2_zero3():
    cfg = _shared(model="gpt", stages=2, local_batch=8,
                  directives=[*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(4),
                              *piper.schedules.one_f_one_b(2, 4), piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.01)])
    run_parity(cfg, 4, **TOL)


def test_shared_gpu_dualpipe_v_overlap_slots_on_two_streams():
    cfg = _shared(model="gpt", model_kwargs={"layers": 4}, stages=4,
                  directives=[piper.split(8), *piper.schedules.dualpipe_v(2, 8)])
    res = run_parity(cfg, 2, **TOL)
    assert res[0]["stats"].reordered > 0  # the overlap slots ran on the side stream


def test_shared_gpu_ep2():
    """SGD: routing is discrete (see tests/dist/test_expert_parallel.py)."""
    cfg = RunConfig(device="cuda", shared_gpu=True, model="moe", model_kwargs={"experts": 4}, local_batch=4,
                    directives=[piper.split(2), piper.replicate(), piper.shard({"EP": 0})])
    run_parity(cfg, 2, **TOL)


def test_single_gpu_bf16_inductor_parity():
    """bf16 with fp32 master weights on one GPU, Inductor -> Triton: Inductor keeps fused intermediates
    in fp32 where eager rounds to bf16. On an H200 (2026-11-28) the run was 7.8% from the bf16 reference
    and 7.8% from fp32 training (the CPU's fixed bound of 6% failed): bounded by the dtype's measured noise
    on this device, as the CPU Inductor test is."""
    cfg = RunConfig(model="gpt", device="cuda", codegen="inductor", directives=[piper.split(2)], steps=3,
                    optimizer=ADAM, mixed_precision={"param_dtype": "bf16"})
    run_mixed_parity(cfg, 1, loss_tol=2**-6, within_noise=1.5)
