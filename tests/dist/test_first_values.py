"""Replicas start from rank 0's weights: the first step broadcasts every parameter and buffer, packed into
a few flat buffers per dtype (``comm.broadcast_coalesced``)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import piper_compile as piper
from piper_compile.runtime import comm
from piper_compile.testing.launch import run_local
from piper_compile.testing.models import build_model


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(3, 5, generator=g), torch.randn(7, 4, generator=g).t(),  # non-contiguous
            torch.randint(0, 100, (6,), generator=g), torch.empty(0),
            torch.randn(40, generator=g).to(torch.bfloat16), torch.randn(2, 2, 2, generator=g),
            torch.randn(33, generator=g)]


def _coalesced_worker(rank: int, world: int, bucket_bytes: int) -> list[torch.Tensor]:
    ts = _tensors(rank)
    storage = [t.data_ptr() for t in ts]
    comm.broadcast_coalesced(ts, 0, bucket_bytes=bucket_bytes)
    assert [t.data_ptr() for t in ts] == storage  # written in place, into the tensors the caller holds
    return ts


@pytest.mark.parametrize("bucket_bytes", [64 << 20, 100])
def test_broadcast_coalesced_gives_every_rank_rank0s_values(bucket_bytes):
    """Several dtypes, a transposed tensor, an empty one; one bucket per dtype, or (100 bytes) several."""
    want = _tensors(0)
    for got in run_local(_coalesced_worker, 2, bucket_bytes, timeout_s=120):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a, b)


def _dp_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = build_model("mlp", seed=rank)  # rank 1 starts from other weights: the broadcast must fix that
    batch = model.make_batch(8, torch.Generator().manual_seed(0))
    step = piper.compile(model, directives=[piper.replicate()], codegen="eager",
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    local = [t.chunk(world)[rank] for t in batch]
    for _ in range(2):
        step(*local)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_dp_replicas_start_from_rank0_weights():
    """Ranks built with different seeds train as one model from rank 0's weights: after two SGD steps
    every rank's parameters equal eager training of rank 0's model on the global batch."""
    ref = build_model("mlp", seed=0)
    eager = copy.deepcopy(ref)
    batch = ref.make_batch(8, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        eager(*batch).backward()
        opt.step()
    for state in run_local(_dp_worker, 2, timeout_s=300):
        for k, v in eager.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
