"""Tensor parallelism (``shard_tensor``) against eager single-process training: Megatron column/row
splits of the GPT's attention (fused qkv, heads split across ranks) and MLP, on gloo ranks."""
from __future__ import annotations

import pytest

import piper_compile as piper
from piper_compile.testing.models import build_model
from piper_compile.testing.parity import RunConfig, eager_reference, run_parity

TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


def _collectives(res: list[dict], tp_per_rank: int, grad: bool) -> None:
    """Per layer and micro-batch: two forward all-reduces (after proj and out) and two backward ones (the
    input gradients of qkv and fc); gradient reduction only across data-parallel replicas."""
    for r in res:
        assert r["collectives"]["tp"] == tp_per_rank, r["collectives"]
        assert ("grad" in r["collectives"]) == grad, r["collectives"]


@pytest.mark.parametrize("codegen", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_tp2_gpt(codegen):
    cfg = RunConfig(model="gpt", model_kwargs={"layers": 2}, directives=[piper.split(2), piper.shard_tensor(TP)],
                    local_batch=4, tp=2, codegen=codegen)
    _collectives(run_parity(cfg, 2), 4 * 2 * 2, grad=False)


@pytest.mark.slow
def test_dp2_x_tp2_gpt():
    d = [piper.split(2), piper.replicate(), piper.shard_tensor(TP, devices=[[0, 1], [2, 3]])]
    res = run_parity(RunConfig(model="gpt", model_kwargs={"layers": 2}, directives=d, local_batch=4, tp=2), 4)
    _collectives(res, 4 * 2 * 2, grad=True)
    for r in res:  # gradient buffers hold this rank's pieces of the split layers, as the plan predicts
        m, p = r["memory"].measured, r["memory"].predicted
        assert m.grads == p.grads and m.params == p.params, r["memory"]


@pytest.mark.slow
def test_pp2_x_tp2_gpt_tied_embedding():
    """Stages on [0,1] and [2,3], each a tensor-parallel pair; the embedding tied to the LM head crosses stages."""
    groups = [[0, 1], [2, 3]]
    d = [*piper.pipeline(2, ranks=groups), piper.split(4), *piper.schedules.one_f_one_b(2, 4),
         piper.shard_tensor(TP, devices=groups)]
    res = run_parity(RunConfig(model="gpt", model_kwargs={"layers": 2}, stages=2, directives=d, local_batch=4, tp=2), 4)
    _collectives(res, 4 * 1 * 4, grad=False)


# -- gradient clipping: the global norm counts each TP piece once (not once per data-parallel replica),
# parameters replicated inside a TP group once (not once per TP rank), sequence-parallel partial gradients
# once they are summed. SGD with momentum (stateful, so ZeRO shards its state too) because its update is
# proportional to the clip coefficient: AdamW normalises the gradient's scale away, so a norm counting some
# gradients twice moves its parameters by barely more than its summation-order tolerance.
MAX_NORM = 0.1


def _clipped_parity(directives: list, world: int) -> list[dict]:
    cfg = RunConfig(model="gpt", model_kwargs={"layers": 2}, directives=directives, local_batch=4, tp=2,
                    optimizer=("SGD", {"lr": 0.05, "momentum": 0.9}), clip_grad_norm=MAX_NORM)
    norms = eager_reference(cfg, world)["grad_norms"]
    assert len(norms) == cfg.steps and min(norms) > 2 * MAX_NORM, norms  # clipping happens at every step
    res = run_parity(cfg, world)
    assert all(r["collectives"]["gradnorm"] == 1 for r in res)
    return res


@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_tp2_gpt_grad_clipping(sp):
    _clipped_parity([piper.split(2), piper.shard_tensor(TP, sequence_parallel=sp)], 2)


@pytest.mark.slow
def test_dp2_x_tp2_gpt_grad_clipping():
    _clipped_parity([piper.split(2), piper.replicate(), piper.shard_tensor(TP, devices=[[0, 1], [2, 3]])], 4)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_dp2_x_tp2_gpt_zero1_grad_clipping(sp):
    """ZeRO-1 within each data-parallel subgroup ([0, 2] and [1, 3]): each shards the optimizer state of its
    own copy of the buckets, which hold its position's pieces of the split layers; the gradient norm
    counts the shards of the replicated parameters in one subgroup only. Sequence parallel: the norms'
    and rowwise biases' partial gradients are summed over the whole group and updated whole instead."""
    d = [piper.split(2), piper.replicate(zero=1, bucket_mb=0.01),
         piper.shard_tensor(TP, devices=[[0, 1], [2, 3]], sequence_parallel=sp)]
    model = build_model("gpt", 0, layers=2)
    for r in _clipped_parity(d, 4):
        assert bool(r["tp_partial"]) == sp
        whole = sum(model.get_parameter(f).nbytes for f in r["tp_partial"])
        m, p = r["memory"].measured, r["memory"].predicted
        # the momentum of half of this rank's sharded parameters (its TP pieces and the replicated ones) and
        # of all of those updated whole, up to one padding element per bucket
        assert 0 <= 2 * m.optimizer - (m.params + whole) <= 2 * 4 * r["collectives"]["grad"], (m, whole)
        assert (p.params, p.grads, p.optimizer) == (m.params, m.grads, m.optimizer), (p, m)


# -- sequence parallel: per layer and micro-batch, forward reduce-scatter x2 + all-gather x2, backward the
# mirror; block 0's qkv reads the whole embedding (one all-reduce in backward) and the residual is cut
# at its first add (an all-gather of its gradient), ln_f's output is gathered for the LM head.
SP_PER_MB_2_LAYERS = 8 + 9


@pytest.mark.slow  # ~11 s even in eager: the fast subset keeps test_tp2_gpt[eager]
@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_tp2_gpt_sequence_parallel(codegen):
    cfg = RunConfig(model="gpt", model_kwargs={"layers": 2}, local_batch=4, tp=2, codegen=codegen, no_grad_eval=True,
                    directives=[piper.split(2), piper.shard_tensor(TP, sequence_parallel=True)])
    _collectives(run_parity(cfg, 2), SP_PER_MB_2_LAYERS * 2, grad=True)  # grad: norms and biases, partial per rank


def test_tp2_norm_shared_by_whole_and_split_activations():
    cfg = RunConfig(model="shared_norm", local_batch=4, tp=2,
                    directives=[piper.shard_tensor({"fc": "colwise", "out": "rowwise"}, sequence_parallel=True)])
    run_parity(cfg, 2)


@pytest.mark.slow
def test_dp2_x_tp2_gpt_sequence_parallel():
    d = [piper.split(2), piper.replicate(),
         piper.shard_tensor(TP, devices=[[0, 1], [2, 3]], sequence_parallel=True)]
    _collectives(run_parity(RunConfig(model="gpt", model_kwargs={"layers": 2}, directives=d, local_batch=4, tp=2), 4),
                 SP_PER_MB_2_LAYERS * 2, grad=True)


@pytest.mark.slow
def test_pp2_x_tp2_gpt_sequence_parallel():
    groups = [[0, 1], [2, 3]]
    d = [*piper.pipeline(2, ranks=groups), piper.split(4), *piper.schedules.one_f_one_b(2, 4),
         piper.shard_tensor(TP, devices=groups, sequence_parallel=True)]
    run_parity(RunConfig(model="gpt", model_kwargs={"layers": 2}, stages=2, directives=d, local_batch=4, tp=2), 4)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_pp2_x_dp2_x_tp2_gpt_8_ranks(sp):
    """All three at once on 8 ranks: stage 0 on [0, 1, 4, 5], stage 1 on [2, 3, 6, 7]; tensor-parallel pairs
    [0, 1], [4, 5], [2, 3], [6, 7]; the two pairs of a stage are data-parallel replicas (ranks 0 and 4 ...)."""
    stages = [[0, 1, 4, 5], [2, 3, 6, 7]]
    d = [*piper.pipeline(2, ranks=stages), piper.split(2), *piper.schedules.one_f_one_b(2, 2),
         piper.replicate({"PP": "*"}),
         piper.shard_tensor(TP, devices=[[0, 1], [4, 5], [2, 3], [6, 7]], sequence_parallel=sp)]
    res = run_parity(RunConfig(model="gpt", model_kwargs={"layers": 2, "dim": 16, "heads": 2}, stages=2,
                               directives=d, local_batch=2, tp=2, steps=2), 8)
    if not sp:
        _collectives(res, 4 * 1 * 2, grad=True)  # each stage holds one layer: 4 TP all-reduces per micro-batch
