"""Hugging Face ``transformers`` models under piper, against an eager single-process run on the same
global batch (real gloo ranks): a tiny random Llama (GQA, RoPE, RMSNorm, SwiGLU, sdpa attention; AdamW)
whose decoder layers are tagged from outside with ``piper.annotate``, and a tiny Qwen3-MoE whose sparse
MoE blocks ``piper_compile.nn.hf.adapt_moe`` swaps for expert-parallel ones (SGD); transformers' code
untouched."""
from __future__ import annotations

import pytest

import piper_compile as piper
from piper_compile.testing.parity import RunConfig

pytest.importorskip("transformers")
from piper_compile.testing.hf import LLAMA_TP, max_differences, run_hf_parity  # noqa: E402

pytestmark = pytest.mark.slow

ADAMW = ("AdamW", {"lr": 1e-3, "weight_decay": 0.01})
# AdamW turns fp32 reduction-order noise on ~0 gradients into up to lr per element (see test_zero)
P_TOL = dict(rtol=1e-4, atol=5e-5)


def test_llama_pp2_x_dp2_1f1b():
    """Layers 0-1 on stage 0 (ranks 0, 2), layers 2-3 on stage 1 (ranks 1, 3); 4 micro-batches, 1F1B;
    transformers' own loss (``labels=``). The embedding joins stage 0 and the final norm and ``lm_head``
    the last stage by the region rule for untagged nodes."""
    m = 4
    directives = [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(m), *piper.schedules.one_f_one_b(2, m),
                  piper.replicate({"PP": "*"})]
    cfg = RunConfig(model="llama", model_kwargs={"hf_loss": True}, stages=2, directives=directives, steps=3,
                    local_batch=8, optimizer=ADAMW)
    res, ref = run_hf_parity(cfg, 4, **P_TOL)
    loss_diff, param_diff = max_differences(res, ref)
    assert loss_diff < 1e-5 and param_diff < 5e-5
    n = len(ref["params"])  # parameter order: embed_tokens first, ..., norm, lm_head last
    stage0, stage1 = set(res[0]["params"]), set(res[1]["params"])
    assert 0 in stage0 and {n - 2, n - 1} <= stage1 and not stage0 & stage1
    assert set(res[2]["params"]) == stage0 and set(res[3]["params"]) == stage1
    assert res[0]["collectives"] == {"grad": 1, "loss": 1}
    assert "SEND." in res[0]["program"] and "RECV." in res[1]["program"]


def test_llama_dp2_zero1():
    """Plain data parallel with a sharded AdamW (ZeRO-1), no annotations, 2 micro-batches per replica;
    loss from the model's logits and ``F.cross_entropy``."""
    directives = [piper.replicate(zero=1, bucket_mb=0.05), piper.split(2)]
    cfg = RunConfig(model="llama", directives=directives, steps=3, local_batch=4, optimizer=ADAMW)
    res, ref = run_hf_parity(cfg, 2, **P_TOL)
    loss_diff, param_diff = max_differences(res, ref)
    assert loss_diff < 1e-5 and param_diff < 5e-5
    assert res[0]["collectives"]["grad"] > 1 and res[0]["collectives"]["param"] > 1  # several buckets


SGD = ("SGD", {"lr": 0.05, "momentum": 0.9})


def test_qwen3_moe_ep2():
    """Qwen3-MoE (2 layers, 4 experts, top-2, renormalised) with its sparse MoE blocks swapped by
    ``piper_compile.nn.hf.adapt_moe`` (tagged ``EP=<layer>``), expert parallel over 2 ranks (2 experts
    each, real all-to-all routing), dense parameters data parallel, 2 micro-batches per replica. SGD with
    momentum: routing is discrete and Adam would amplify the rounding noise of exactly-zero router
    gradients (see test_expert_parallel)."""
    layers, m = 2, 2
    directives = [piper.split(m), piper.replicate(), piper.shard({"EP": "*"})]
    cfg = RunConfig(model="qwen3moe", model_kwargs={"num_hidden_layers": layers},
                    directives=directives, steps=3, local_batch=4, optimizer=SGD)
    res, ref = run_hf_parity(cfg, 2)
    loss_diff, param_diff = max_differences(res, ref)
    assert loss_diff < 1e-5 and param_diff < 1e-5
    for r in res:
        assert r["collectives"]["ep"] == 4 * layers * m, r["collectives"]
        assert r["collectives"]["ep_counts"] == layers * m, r["collectives"]
        assert r["collectives"]["grad"] >= 1  # attention, norms, routers, embeddings still all-reduce
    # trained_parameters gathers the expert shards: both ranks report every parameter
    assert set(res[0]["params"]) == set(res[1]["params"]) == set(range(len(ref["params"])))


def _tp_collectives(res: list[dict], layers: int, m: int, grad: bool, per_layer: int = 4) -> None:
    """Per decoder layer and micro-batch: two forward all-reduces (after o_proj and down_proj) and two
    backward ones (the input gradient of the attention input, shared by q, k and v, and of the MLP input,
    shared by gate and up)."""
    for r in res:
        assert r["collectives"]["tp"] == per_layer * layers * m, r["collectives"]
        assert ("grad" in r["collectives"]) == grad, r["collectives"]


def _llama_tp(world: int, *directives: object) -> list[dict]:
    """Llama (2 layers, 2 micro-batches per replica) under ``directives``, against eager training."""
    cfg = RunConfig(model="llama", model_kwargs={"num_hidden_layers": 2}, directives=[piper.split(2), *directives],
                    steps=3, local_batch=4, optimizer=ADAMW, tp=2)
    res, ref = run_hf_parity(cfg, world, **P_TOL)
    loss_diff, param_diff = max_differences(res, ref)
    assert loss_diff < 1e-5 and param_diff < 5e-5
    return res


def test_llama_tp2():
    """transformers' Llama under Megatron tensor parallelism over 2 ranks: 2 of the 4 query heads and 1 of
    the 2 key/value heads per rank. Dynamo bakes ``repeat_kv``'s full head counts into its
    ``expand``/``reshape``; capture rewrites them to the local ones (capture/tp_shapes.py)."""
    _tp_collectives(_llama_tp(2, piper.shard_tensor(LLAMA_TP)), layers=2, m=2, grad=False)


def test_llama_tp2_sequence_parallel():
    """Sequence parallel on Llama: the RMSNorms and the residual stream run on half the sequence each.
    Forward: layer 0 RS (o_proj), AG (gate/up), RS (down); layer 1 AG, RS, AG, RS; the final norm's output
    gathered for lm_head = 8. Backward: their 7 mirrors, the attention input's all-reduce in layer 0 (its
    input is the whole embedding) and the gather of the residual's cut = 9. Norm weights: gradient sync."""
    res = _llama_tp(2, piper.shard_tensor(LLAMA_TP, sequence_parallel=True))
    for r in res:
        assert r["collectives"]["tp"] == 17 * 2 and "grad" in r["collectives"], r["collectives"]


def test_llama_dp2_x_tp2():
    """Two data-parallel replicas, each a tensor-parallel pair ([0, 1] and [2, 3])."""
    res = _llama_tp(4, piper.replicate(), piper.shard_tensor(LLAMA_TP, devices=[[0, 1], [2, 3]]))
    _tp_collectives(res, layers=2, m=2, grad=True)


# One run per transformers family (tiny random config, 2 ranks, 2 micro-batches per replica, 3 steps), on
# the cheapest strategy that exercises what makes the family itself. ZeRO-3 all-gathers parameters before
# each use and reshards after it; the pipeline sends activations (and tied gradients) between stages.
ZERO3 = [piper.replicate(zero=3, bucket_mb=0.05), piper.split(2)]
PP2 = [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)]
EP2 = [piper.split(2), piper.replicate(), piper.shard({"EP": "*"})]
FAMILY_RUNS = {
    "mistral": ("zero3", {}),  # sliding-window attention (window 4 < 16 tokens)
    "qwen2": ("zero3", {}),  # q/k/v biases
    "gemma2": ("pp2", {}),  # embeddings tied across the stages, logit soft-capping, local/global layers
    "gemma3": ("pp2", {}),  # tied across the stages, q/k norms, a sliding and a full attention layer
    "olmo2": ("pp2", {}),  # q/k norms, norms after the sublayers
    "phi3": ("pp2", {}),  # fused qkv and gate/up projections
    "gpt2": ("pp2", {"hf_loss": True}),  # tanh GELU under remat, sqrt(2/pi) used by both stages, its own loss
    # (``labels=``, which logs through warning_once), lm_head tied to the embedding across the stages
    "gpt_neox": ("zero3", {}),  # parallel residual, partial rotary
    "bert": ("zero3", {}),  # post-norm encoder, masked-LM head tied to the embedding
    "vit": ("zero3", {}),  # patch convolution, class token, image classification
    "deepseek_v3": ("ep2", {}),  # MLA attention; MoE adapted (routed experts expert-parallel, shared ones dense)
}


TIED = {"gemma2", "gemma3", "gpt2"}  # embedding tied to lm_head: used by both stages, gradients summed


@pytest.mark.parametrize("family", sorted(FAMILY_RUNS))
def test_hf_family_trains_exactly(family: str):
    """A transformers family built as a new user would (``XForY(config)``, default attention
    implementation, default ``remat=True``) trains as eager single-process training does. SGD with
    momentum, so the fp32 tolerance stays tight: AdamW turns reduction-order noise on gradients that are zero
    in exact arithmetic (the key biases of BERT, ViT, GPT-2, Qwen2) into steps of up to lr (see P_TOL), and
    for DeepSeek-V3 could flip a routing near-tie."""
    strategy, kwargs = FAMILY_RUNS[family]
    directives = {"zero3": ZERO3, "pp2": PP2, "ep2": EP2}[strategy]
    cfg = RunConfig(model=family, model_kwargs=kwargs, stages=2 if strategy == "pp2" else 1, directives=directives,
                    steps=3, local_batch=4, optimizer=SGD)
    res, ref = run_hf_parity(cfg, 2)
    loss_diff, param_diff = max_differences(res, ref)
    assert loss_diff < 1e-5 and param_diff < 1e-5, (loss_diff, param_diff)
    for r in res:
        assert not r["fallbacks"]
        if strategy == "pp2":
            assert "SEND." in r["program"] and "RECV." in r["program"]
        elif strategy == "zero3":
            assert r["collectives"]["param"] > 1, r["collectives"]
        else:
            assert r["collectives"]["ep"] > 0 and r["collectives"]["grad"] >= 1, r["collectives"]
    if family in TIED:  # the tied weight's gradient completed on one stage is sent to the other
        assert any("SEND.grad:" in r["program"] for r in res), res[0]["program"]
