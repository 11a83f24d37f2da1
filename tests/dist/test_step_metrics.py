"""piper.stats on real gloo ranks (PP2 x DP2, 1F1B): the ranks' FLOPs add up to the analytic count of
the global batch, every rank counts the global batch's tokens, and the time split sees the pipeline."""
from __future__ import annotations

import pytest

import piper_compile as piper
from piper_compile.testing.parity import RunConfig, run_parity

pytestmark = pytest.mark.slow
CFG = {"vocab": 128, "seq": 32, "dim": 64, "heads": 4, "layers": 2}


def test_pp2_x_dp2_flops_tokens_and_time_split():
    cfg = RunConfig(model="gpt", model_kwargs=CFG, stages=2, local_batch=4, steps=2, optimizer=("AdamW", {"lr": 1e-3}),
                    directives=[*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(2),
                                *piper.schedules.one_f_one_b(2, 2), piper.replicate({"PP": "*"}, zero=1)])
    res = run_parity(cfg, 4, rtol=1e-4, atol=1e-5)  # AdamW on a bigger GPT: summation order
    tokens = 2 * 4 * CFG["seq"]  # 2 replicas of 4 sequences
    exact = 6 * (CFG["layers"] * 12 * CFG["dim"] ** 2 + CFG["vocab"] * CFG["dim"]) * tokens \
        + 12 * CFG["layers"] * CFG["seq"] * CFG["dim"] * tokens
    ms = [r["metrics"] for r in res]
    # the tied embedding's head matmul runs on the last stage; the first stage's gathers are not matmuls
    assert sum(m.flops for m in ms) == exact, ([m.flops for m in ms], exact)
    assert all(m.tokens == tokens and m.samples == 8 for m in ms)
    assert any(m.wait_s > 0 for m in ms)  # pipeline: a stage waits for the other's activations/gradients
    for m in ms:
        assert m.compute_s + m.update_s + m.exposed_comm_s + m.wait_s <= m.step_time_s * 1.01, m
        assert 0 < m.tflops_per_s and 0 < m.mfu


def test_ep2_flops_add_up_to_one_rank_on_the_global_batch():
    """Expert steps run outside segment graphs under expert parallelism: counted as they run, on the rows
    each rank received, the two ranks' FLOPs add up to one rank's on the whole batch (where the grouped
    experts are a custom op inside the segment graph)."""
    from piper_compile.testing.parity import piper_worker

    one = RunConfig(model="moe", model_kwargs={"experts": 4}, local_batch=8, steps=1, directives=[piper.split(2)])
    ep2 = RunConfig(model="moe", model_kwargs={"experts": 4}, local_batch=4, steps=1,
                    directives=[piper.split(2), piper.replicate(), piper.shard({"EP": 0})])
    whole = piper_worker(0, 1, one)["metrics"].flops
    res = run_parity(ep2, 2, rtol=1e-4, atol=1e-5)
    assert whole > 0 and sum(r["metrics"].flops for r in res) == whole, ([r["metrics"].flops for r in res], whole)
    # the routing's skew, measured: in each micro-batch the two ranks receive both ranks' slots between them,
    # so the busiest micro-batch's loads (rows over balanced routing's) add up to at least 2, each at most 2
    loads = [r["metrics"].expert_load for r in res]
    assert all(0 < x <= 2 for x in loads) and sum(loads) >= 2 - 1e-9, loads
    assert all(f"expert load {x:.2f}x" in r["metrics"].line() for x, r in zip(loads, res))
    alone = piper_worker(0, 1, one)["metrics"]
    assert alone.expert_load == 0.0 and "expert load" not in alone.line()
