"""Tensor parallelism (``shard_tensor``) against eager single-process training: Megatron column/row
splits of the GPT's attention (fused qkv, heads split across ranks) and MLP, on gloo ranks."""
from __future__ import annotations

import pytest

import piper_compile as piper
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
# once they are summed. AdamW is nearly invariant to the gradient's scale, but a 5% error in the clip
# coefficient already moves these parameters by ~4e-5, outside AdamW's tolerance (the one of the other
# AdamW parity tests: its update normalises tiny gradients, so summation order shows at ~1e-6).
ADAMW = ("AdamW", {"lr": 1e-3, "weight_decay": 0.1})
ADAMW_TOL = dict(rtol=1e-4, atol=1e-5)
MAX_NORM = 0.1


def _clipped_parity(directives: list, world: int) -> None:
    cfg = RunConfig(model="gpt", model_kwargs={"layers": 2}, directives=directives, local_batch=4, tp=2,
                    optimizer=ADAMW, clip_grad_norm=MAX_NORM)
    norms = eager_reference(cfg, world)["grad_norms"]
    assert len(norms) == cfg.steps and min(norms) > 2 * MAX_NORM, norms  # clipping happens at every step
    res = run_parity(cfg, world, **ADAMW_TOL)
    assert all(r["collectives"]["gradnorm"] == 1 for r in res)


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_gpt_grad_clipping(sp):
    _clipped_parity([piper.split(2), piper.shard_tensor(TP, sequence_parallel=sp)], 2)


@pytest.mark.slow
def test_dp2_x_tp2_gpt_grad_clipping():
    _clipped_parity([piper.split(2), piper.replicate(), piper.shard_tensor(TP, devices=[[0, 1], [2, 3]])], 4)


# -- sequence parallel: per layer and micro-batch, forward reduce-scatter x2 + all-gather x2, backward the
# mirror; block 0's qkv reads the whole embedding (one all-reduce in backward) and the residual is cut
# at its first add (an all-gather of its gradient), ln_f's output is gathered for the LM head.
SP_PER_MB_2_LAYERS = 8 + 9


@pytest.mark.parametrize("codegen", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
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
