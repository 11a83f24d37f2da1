"""The Triton grouped SwiGLU kernels (nn/triton_experts.py) compiled for the GPU, against the torch
reference on the same device: forward and backward, fp32 and bf16, an expert with no rows."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2**-6)])
def test_triton_grouped_swiglu_matches_torch_on_cuda(dtype, tol):
    import piper_compile.nn.experts as ex
    from piper_compile.nn.triton_experts import triton_available

    pytest.importorskip("triton")
    assert triton_available(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    E, D, H = 4, 96, 160
    counts = torch.tensor([37, 0, 130, 9], device="cuda")
    n = int(counts.sum())
    x = torch.randn(n, D, device="cuda", generator=g).to(dtype)
    wg, wu = (torch.randn(E, D, H, device="cuda", generator=g).div(D**0.5).to(dtype) for _ in range(2))
    wd = torch.randn(E, H, D, device="cuda", generator=g).div(H**0.5).to(dtype)
    gy = torch.randn(n, D, device="cuda", generator=g).to(dtype)
    y = ex.grouped_swiglu(x, counts, wg, wu, wd)
    grads = ex.grouped_swiglu_backward(gy, x, counts, wg, wu, wd)
    ref32 = [t.float() for t in (x, wg, wu, wd, gy)]
    with torch.no_grad():
        torch.backends.cuda.matmul.allow_tf32 = False
        ry = _torch_forward(*ref32[:4], counts)
        rgrads = _torch_backward(ref32[4], *ref32[:4], counts)
    for got, want in [(y, ry), *zip(grads, rgrads)]:
        err = (got.float() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (got.shape, err)
    assert grads[1][1].abs().max() == 0  # the expert with no rows


def _torch_forward(x, wg, wu, wd, counts):
    import piper_compile.nn.experts as ex

    return ex.grouped_swiglu(x.cpu(), counts.cpu(), wg.cpu(), wu.cpu(), wd.cpu()).cuda()


def _torch_backward(gy, x, wg, wu, wd, counts):
    import piper_compile.nn.experts as ex

    return [t.cuda() for t in ex.grouped_swiglu_backward(gy.cpu(), x.cpu(), counts.cpu(), wg.cpu(), wu.cpu(), wd.cpu())]
