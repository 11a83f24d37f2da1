"""CUDA paths: Inductor -> Triton segments, NCCL process groups per stream. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.parity import RunConfig, run_parity

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ADAM = ("AdamW", {"lr": 1e-3})


def test_single_gpu_inductor_triton_microbatched_gpt():
    cfg = RunConfig(model="gpt", directives=[piper.split(4)], local_batch=16, optimizer=ADAM, codegen="inductor",
                    device="cuda", no_grad_eval=True)
    run_parity(cfg, 1, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_dp2_nccl():
    cfg = RunConfig(model="gpt", directives=[piper.replicate(bucket_mb=0.05), piper.split(2)], optimizer=ADAM,
                    codegen="inductor", device="cuda")
    run_parity(cfg, 2, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_pp2_1f1b_tied_gpt_nccl():
    cfg = RunConfig(model="gpt", stages=2, optimizer=ADAM, codegen="inductor", device="cuda",
                    directives=[*piper.pipeline(2), piper.split(4), *piper.schedules.one_f_one_b(2, 4)])
    run_parity(cfg, 2, rtol=1e-3, atol=1e-4)
