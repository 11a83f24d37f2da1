"""Host staging (runtime/comm.py): ranks sharing one GPU run over gloo, and every collective and message
of a CUDA tensor moves through host buffers. ``PIPER_HOST_STAGING=always`` takes that path for CPU
tensors too, so these runs check it here: every strategy's communication (P2P, all-reduce, ZeRO-3
all-gather and reduce-scatter, expert all-to-all, the initial broadcast) staged, results equal to eager."""
from __future__ import annotations

import pytest

import piper_compile as piper
from piper_compile.testing.parity import RunConfig, run_parity

pytestmark = pytest.mark.slow
ADAMW = ("AdamW", {"lr": 1e-3})


@pytest.fixture(autouse=True)
def _staged(monkeypatch):
    monkeypatch.setenv("PIPER_HOST_STAGING", "always")


def test_staged_pp2_x_dp2_zero3():
    cfg = RunConfig(model="gpt", stages=2, local_batch=8, steps=3, optimizer=ADAMW,
                    directives=[*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(4),
                                *piper.schedules.one_f_one_b(2, 4), piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.01)])
    res = run_parity(cfg, 4, rtol=1e-4, atol=5e-4)
    assert res[0]["p2p"] > 0 and res[0]["collectives"].get("grad")


def test_staged_ep2():
    """SGD: routing is discrete (see test_expert_parallel)."""
    cfg = RunConfig(model="moe", model_kwargs={"experts": 4}, local_batch=4, steps=3,
                    directives=[piper.split(2), piper.replicate(), piper.shard({"EP": 0})])
    res = run_parity(cfg, 2, rtol=1e-4, atol=1e-5)
    assert res[0]["collectives"], res[0]["collectives"]
