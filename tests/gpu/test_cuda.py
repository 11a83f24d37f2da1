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


def test_side_stream_fork_and_join_order_work_across_streams():
    """``SideStream``: work launched on it after ``fork`` sees the main stream's results, and the main
    stream's work after ``join`` sees the side stream's."""
    from piper_compile.runtime.executor import side_stream_for

    side = side_stream_for(torch.device("cuda"), True)
    assert side is not None and side_stream_for(torch.device("cuda"), False) is None
    x = torch.randn(2048, 2048, device="cuda")
    a = x @ x  # long enough that an unordered read on the side stream would see an unfinished result
    side.fork()
    with side.context():
        b = a * 2
    side.join()
    c = b + 1
    torch.testing.assert_close(c.cpu(), (x.cpu() @ x.cpu()) * 2 + 1, rtol=1e-3, atol=1e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_dualpipe_v_overlap_slots_on_two_streams_nccl():
    cfg = RunConfig(model="gpt", model_kwargs={"layers": 4}, stages=4, optimizer=ADAM, codegen="inductor",
                    device="cuda", directives=[piper.split(8), *piper.schedules.dualpipe_v(2, 8)])
    res = run_parity(cfg, 2, rtol=1e-3, atol=1e-4)
    assert res[0]["stats"].reordered > 0  # the overlap slots ran on the side stream


def test_single_gpu_regional_compilation_compiles_each_block_once_and_matches_eager():
    """Triton pieces (codegen/regional.py): the GPT's identical blocks reuse one compiled graph on CUDA."""
    import copy
    import functools

    from piper_compile.testing.models import build_model

    torch.manual_seed(0)
    model = build_model("gpt", 0, layers=4).cuda()
    ref = copy.deepcopy(model)
    step = piper.compile(model, directives=[piper.split(2)], optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    x, y = (t.cuda() for t in model.make_batch(8, torch.Generator().manual_seed(0)))
    loss = step(x, y)
    torch.testing.assert_close(loss.detach(), ref(x, y).detach(), rtol=1e-3, atol=1e-4)
    m = piper.stats(step)
    assert m.reused >= 5 and m.fallbacks == 0, m
