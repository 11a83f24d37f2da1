"""Expert parallelism (``shard``) against eager single-process training: real token routing over gloo
ranks (counts all-to-all, then variable-size all_to_all_single), experts split across the ranks.

SGD with momentum: MoE routing is discrete (top-k), and Adam turns the rounding noise of gradients that
are exactly zero in exact arithmetic (router rows of experts no token chose) into steps of size lr."""
from __future__ import annotations

import pytest

import piper_compile as piper
from piper_compile.testing.parity import RunConfig, run_parity

S = piper.schedules


def _ep(model: str, kwargs: dict, directives: list, **kw: object) -> RunConfig:
    return RunConfig(model=model, model_kwargs=kwargs, directives=directives, local_batch=4, **kw)  # type: ignore[arg-type]


def _counts(res: list[dict], layers: int, microbatches: int) -> None:
    """Per step and rank: per layer and micro-batch, one counts exchange and four token all-to-alls
    (dispatch and combine, forward and backward)."""
    for r in res:
        assert r["collectives"]["ep"] == 4 * layers * microbatches, r["collectives"]
        assert r["collectives"]["ep_counts"] == layers * microbatches, r["collectives"]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_layer_ep(world):
    res = run_parity(_ep("moe", {"experts": 4}, [piper.split(2), piper.replicate(), piper.shard({"EP": 0})]), world)
    _counts(res, 1, 2)
    assert all(r["collectives"]["grad"] >= 1 for r in res)  # dense layers still all-reduce


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_moe_gpt_ep_top2(world):
    res = run_parity(_ep("moegpt", {"layers": 2, "experts": 4, "top_k": 2},
                         [piper.split(2), piper.replicate(), piper.shard({"EP": "*"})]), world)
    _counts(res, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 2])
def test_imbalanced_routing_ranks_with_no_tokens(top_k):
    """Every token goes to experts 0..top_k-1 (top_k=1: all to one expert): on EP4 ranks 1-3 (and rank 0's
    other experts) receive zero tokens; their experts get zero gradients, and everything still matches."""
    res = run_parity(_ep("moe", {"experts": 4, "top_k": top_k, "skew": 20.0},
                         [piper.replicate(), piper.shard({"EP": 0})]), 4)
    _counts(res, 1, 1)


@pytest.mark.slow
def test_forward_only_under_no_grad():
    run_parity(_ep("moe", {"experts": 4}, [piper.split(2), piper.replicate(), piper.shard({"EP": 0})],
                   no_grad_eval=True), 2)


@pytest.mark.slow  # slow: keeps the fast subset under 5 min
def test_ep_with_zero1_and_adamw_inductor():
    """Dense parameters ZeRO-1-sharded, experts expert-sharded, AdamW, Inductor-compiled segments."""
    res = run_parity(_ep("moe", {"experts": 4}, [piper.split(2), piper.replicate(zero=1), piper.shard({"EP": 0})],
                         optimizer=("AdamW", {"lr": 1e-3}), codegen="inductor"), 2, rtol=1e-4, atol=1e-5)
    _counts(res, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,zero", [("1f1b", 0), ("1f1b", 1), ("dualpipe_v", 1)])
def test_pp2_x_ep2(schedule, zero):
    """4 ranks: two pipeline ranks, each a group of two that shards the experts of its stages; dense
    weights replicated over the pair, or ZeRO-1-sharded (PP x DP x EP with ZeRO-1)."""
    groups = [[0, 1], [2, 3]]
    if schedule == "1f1b":
        stages, d = 2, [*piper.pipeline(2, ranks=groups), piper.split(4), *S.one_f_one_b(2, 4)]
    else:
        stages, d = 4, [piper.split(4), *S.dualpipe_v(2, 4, groups=groups)]
    cfg = _ep("moegpt", {"layers": stages, "experts": 4},
              [*d, piper.replicate({"PP": "*"}, zero=zero), piper.shard({"EP": "*"})], stages=stages)
    res = run_parity(cfg, 4)
    _counts(res, stages // 2, 4)
