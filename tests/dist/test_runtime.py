"""Runtime behaviour on real gloo ranks: a stuck peer becomes a clear timeout error, not a hang."""
from __future__ import annotations

import time

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.models import build_model

pytestmark = pytest.mark.slow


def _stuck_peer_worker(rank: int, world: int) -> str:
    model = build_model("mlp")
    model.annotate_stages(2)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": [*piper.pipeline(2), piper.split(2)], "codegen": "eager",
                                  "timeout": 3})
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    step(*batch)  # both ranks run the first step
    if rank == 1:
        time.sleep(8)  # rank 1 stops taking part: rank 0 must time out, not hang
        return "idle"
    try:
        step(*batch)
    except piper.PiperRuntimeError as e:
        return str(e)
    return "no error"


def test_stuck_peer_times_out_with_rank_instruction_and_peer():
    """Rank 1 stops calling the step: rank 0's next call fails at its call check (before any traffic of
    the step), within the timeout, naming rank 1 as the rank that never made the call."""
    t0 = time.time()
    msg, idle = run_local(_stuck_peer_worker, 2, timeout_s=120)
    assert idle == "idle"
    assert msg.startswith("piper: rank 0: the call check of a training step"), msg
    assert "peer rank 1" in msg and "did not complete within 3s" in msg, msg
    assert "rank(s) [1] never made this call" in msg, msg
    assert time.time() - t0 < 100
