"""Hugging Face ``transformers`` models for tests and examples: a tiny randomly initialised Llama
and Qwen3-MoE (no download), wrappers whose ``forward`` returns the scalar loss, and pipeline-stage
annotations that tag the decoder layers from outside (``piper.annotate(layer, PP=s)``) without editing
transformers. The Qwen3-MoE blocks are swapped by :func:`piper_compile.nn.hf.adapt_moe` (tagged ``EP``).

Importing this module registers ``"llama"`` and ``"qwen3moe"`` in :data:`piper_compile.testing.models.MODELS`, so
:class:`piper_compile.testing.parity.RunConfig` can name it; spawned ranks import it through
:func:`hf_worker` (pickled by reference), which is what :func:`run_hf_parity` launches.

Needs ``transformers`` (the ``test`` extra pins the version these tests were written against).

With ``dynamic=True`` Dynamo passes the float attributes of transformers' modules (RMSNorm
``variance_epsilon``, rotary ``attention_scaling``, attention ``scaling``) as 0-dim tensor graph inputs read
with ``.item()``, which Inductor cannot compile. piper makes them constants (``piper.compile`` traces with
Dynamo's ``specialize_float``, ``capture/dynamo.capture_settings``; under a plain ``torch.compile`` the
``specialize_floats`` graph pass does) and every segment compiles.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from piper_compile.capture.annotate import annotate
from piper_compile.testing import models as _models


def tiny_llama_config(**overrides: Any) -> Any:
    """A small ``LlamaConfig``: 4 layers of hidden 64, 4 query heads over 2 key/value heads (GQA)."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False,
                              attn_implementation="sdpa")
    kw.update(overrides)
    attn = kw.pop("attn_implementation")
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = attn
    return cfg


def build_llama(seed: int | None = 0, **overrides: Any) -> nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` from :func:`tiny_llama_config` (fp32, train mode),
    seeded with ``seed`` (``None``: from the current RNG state)."""
    from transformers import LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    return model.float().train()


class LlamaLoss(nn.Module):
    """``forward(input_ids, labels)`` -> mean next-token cross-entropy of a ``LlamaForCausalLM``.

    ``labels`` are the targets already aligned with the positions (``labels[:, t]`` is the token after
    ``input_ids[:, t]``, see :meth:`make_batch`), so every sample contributes the same number of tokens
    and the mean over micro-batches equals the mean over the whole batch. ``hf_loss=True`` instead passes
    ``labels=`` to the model (transformers' own shifted loss, which ignores the last position: a mean over
    the labels kept, which piper weighs per micro-batch by their count, ``capture/items.py``)."""

    def __init__(self, seq: int = 16, hf_loss: bool = False, seed: int | None = None, **config: Any) -> None:
        super().__init__()
        # build_model (RunConfig) seeds the RNG just before constructing: seed=None keeps that state
        self.model = build_llama(seed=seed, **config)
        self.seq = seq
        self.hf_loss = hf_loss

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.hf_loss:
            return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    def annotate_stages(self, stages: int) -> None:
        annotate_llama_stages(self.model, stages)

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids, targets = make_batch(n, gen, vocab=self.vocab, seq=self.seq)
        return (ids, ids.clone()) if self.hf_loss else (ids, targets)


# Megatron tensor parallelism for LlamaForCausalLM (and LlamaLoss, whose model sits under ``model.``): q/k/v and
# gate/up column-parallel (whole attention heads per rank: GQA needs the key/value heads divisible by the
# tensor-parallel size), o_proj and down_proj row-parallel. ``shard_tensor(LLAMA_TP)``.
LLAMA_TP: dict[str, str] = {
    **{f"model.model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.model.layers.*.self_attn.o_proj": "rowwise",
    "model.model.layers.*.mlp.gate_proj": "colwise",
    "model.model.layers.*.mlp.up_proj": "colwise",
    "model.model.layers.*.mlp.down_proj": "rowwise",
}


def tiny_qwen3_moe_config(**overrides: Any) -> Any:
    """A small ``Qwen3MoeConfig``: 2 layers of hidden 64, 4 query heads over 2 key/value heads (head_dim 16),
    every layer a sparse MoE of 4 SwiGLU experts (hidden 64), top-2, renormalised top-k weights."""
    from transformers import Qwen3MoeConfig

    kw: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                              use_cache=False, attn_implementation="sdpa")
    kw.update(overrides)
    attn = kw.pop("attn_implementation")
    cfg = Qwen3MoeConfig(**kw)
    cfg._attn_implementation = attn
    return cfg


def build_qwen3_moe(seed: int | None = 0, adapt: bool = True, **overrides: Any) -> nn.Module:
    """A randomly initialised ``Qwen3MoeForCausalLM`` from :func:`tiny_qwen3_moe_config` (fp32, train mode),
    its MoE blocks swapped by :func:`piper_compile.nn.hf.adapt_moe` when ``adapt`` (tagged ``EP=<layer>``)."""
    from transformers import Qwen3MoeForCausalLM

    from piper_compile.nn.hf import adapt_moe

    if seed is not None:
        torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config(**overrides)).float().train()
    return adapt_moe(model) if adapt else model


class Qwen3MoeLoss(LlamaLoss):
    """:class:`LlamaLoss` over :func:`build_qwen3_moe` (adapted, so ``piper.shard({"EP": "*"})`` shards
    its experts). The router load-balancing loss is left out (``output_router_logits`` off): it is a
    product of batch means, so it would not equal its mean over micro-batches."""

    def __init__(self, seq: int = 16, hf_loss: bool = False, seed: int | None = None, adapt: bool = True,
                 **config: Any) -> None:
        nn.Module.__init__(self)
        self.model = build_qwen3_moe(seed=seed, adapt=adapt, **config)
        self.seq = seq
        self.hf_loss = hf_loss


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a ``LlamaForCausalLM`` (or a ``LlamaModel``, or a :class:`LlamaLoss`)."""
    if isinstance(model, LlamaLoss):
        model = model.model
    base = getattr(model, "model", model)
    return base.layers  # type: ignore[return-value]


def annotate_llama_stages(model: nn.Module, stages: int) -> list[int]:
    """Tag decoder layer ``i`` of ``L`` with ``PP = i * stages // L``; returns the stage of each layer.

    Only the decoder layers are tagged. By piper's region rule for untagged nodes the token embedding,
    the rotary embedding and the causal mask (no tagged input; first tagged user is layer 0) join stage 0,
    and the final norm, ``lm_head`` and the loss (latest tagged input is the last layer) join the last stage.
    """
    layers = decoder_layers(model)
    if not 1 <= stages <= len(layers):
        raise ValueError(f"piper: {stages} stages for {len(layers)} decoder layers")
    placement = [i * stages // len(layers) for i in range(len(layers))]
    for layer, stage in zip(layers, placement):
        annotate(layer, PP=stage)
    return placement


def make_batch(n: int, generator: torch.Generator, vocab: int = 128, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic next-token data: ``x[t+1] = (a * x[t] + b) % vocab`` per sequence; returns
    ``(input_ids, targets)`` of shape ``(n, seq)``, int64, with ``targets[:, t] = x[t + 1]``."""
    start = torch.randint(0, vocab, (n, 1), generator=generator)
    a = torch.randint(1, 4, (n, 1), generator=generator)
    b = torch.randint(0, vocab, (n, 1), generator=generator)
    xs = [start]
    for _ in range(seq):
        xs.append((a * xs[-1] + b) % vocab)
    full = torch.cat(xs, dim=1)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous()


# Tiny random configs of other transformers families, built as a new user would (``XForY(config)``, the
# attention implementation transformers picks by default). Dropout off (random ops differ between ranks and
# the reference). Decoder LMs share _DECODER; the overrides are what makes each family itself.
_DECODER: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                use_cache=False)
_ENCODER: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@dataclass(frozen=True)
class Family:
    """A transformers model family: its config and model classes and a tiny config."""

    config: str  # transformers config class
    model: str  # transformers model class
    kwargs: dict[str, Any]
    inputs: str = "tokens"  # "tokens" (input_ids, next-token targets) | "image" (pixel_values, class labels)


FAMILIES: dict[str, Family] = {
    "mistral": Family("MistralConfig", "MistralForCausalLM", {**_DECODER, "sliding_window": 4}),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM",  # tied embeddings, logit soft-capping, local layers
                     {**_DECODER, "head_dim": 16, "sliding_window": 4, "tie_word_embeddings": True}),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM",
                     {**_DECODER, "head_dim": 16, "sliding_window": 4, "tie_word_embeddings": True,
                      "layer_types": ["sliding_attention", "full_attention"]}),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", _DECODER),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", {**_DECODER, "pad_token_id": 0, "bos_token_id": 1,
                                                     "eos_token_id": 2}),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel",  # tied lm_head, tanh GELU, Conv1D projections
                   dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM",  # parallel residual, partial rotary
                       dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25,
                            hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)),
    "bert": Family("BertConfig", "BertForMaskedLM", {**_ENCODER, "vocab_size": 128, "max_position_embeddings": 64}),
    "vit": Family("ViTConfig", "ViTForImageClassification",
                  {**_ENCODER, "image_size": 8, "patch_size": 4, "num_channels": 3, "num_labels": 4}, inputs="image"),
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM",  # MLA attention, routed + shared experts
                          {**_DECODER, "num_key_value_heads": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 0,
                           "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
                           "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                           "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8}),
}


def build_family(family: str, seed: int | None = 0, adapt: bool = True, **overrides: Any) -> nn.Module:
    """A randomly initialised model of ``family`` (a key of :data:`FAMILIES`; fp32, train mode), its MoE blocks
    swapped by :func:`piper_compile.nn.hf.adapt_moe` when ``adapt``."""
    import transformers

    from piper_compile.nn.hf import adapt_moe

    fam = FAMILIES[family]
    if seed is not None:
        torch.manual_seed(seed)
    cfg = getattr(transformers, fam.config)(**{**fam.kwargs, **overrides})
    model = getattr(transformers, fam.model)(cfg).float().train()
    return adapt_moe(model) if adapt else model


class HFLoss(nn.Module):
    """``forward(x, labels)`` -> the cross-entropy of a :data:`FAMILIES` model: next-token targets aligned
    with the positions for token models (as :class:`LlamaLoss`), class labels for image models.
    ``hf_loss=True`` passes ``labels=`` to the model instead (its own loss)."""

    def __init__(self, family: str, seq: int = 16, hf_loss: bool = False, seed: int | None = None,
                 adapt: bool = True, **config: Any) -> None:
        super().__init__()
        self.model = build_family(family, seed=seed, adapt=adapt, **config)
        self.family, self.seq, self.hf_loss = family, seq, hf_loss

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        key = "pixel_values" if FAMILIES[self.family].inputs == "image" else "input_ids"
        if self.hf_loss:
            return self.model(**{key: x}, labels=labels).loss
        logits = self.model(**{key: x}).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    def annotate_stages(self, stages: int) -> None:
        layers = transformer_layers(self.model)
        for i, layer in enumerate(layers):
            annotate(layer, PP=i * stages // len(layers))

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.model.config
        if FAMILIES[self.family].inputs == "image":
            size = (n, cfg.num_channels, cfg.image_size, cfg.image_size)
            return torch.randn(size, generator=gen), torch.randint(0, cfg.num_labels, (n,), generator=gen)
        ids, targets = make_batch(n, gen, vocab=cfg.vocab_size, seq=self.seq)
        return (ids, ids.clone()) if self.hf_loss else (ids, targets)


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The ``ModuleList`` of a transformers model's ``config.num_hidden_layers`` blocks (``model.layers``,
    ``transformer.h``, ``encoder.layer``, ...)."""
    n = model.config.num_hidden_layers
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return mod
    raise ValueError(f"piper: no ModuleList of {n} layers in {type(model).__name__}")


_models.MODELS.setdefault("llama", LlamaLoss)
_models.MODELS.setdefault("qwen3moe", Qwen3MoeLoss)
for _name in FAMILIES:
    _models.MODELS.setdefault(_name, functools.partial(HFLoss, _name))


def hf_worker(rank: int, world: int, cfg: Any) -> dict[str, Any]:
    """:func:`piper_compile.testing.parity.piper_worker`, from a module that registers the HF models."""
    from piper_compile.testing.parity import piper_worker

    return piper_worker(rank, world, cfg)


def max_differences(results: list[dict[str, Any]], ref: dict[str, Any]) -> tuple[float, float]:
    """Largest absolute loss difference (any rank, any step) and parameter difference (any owned
    parameter) between piper ranks and the eager reference."""
    loss = max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"]))
    param = max(((p - ref["params"][k]).abs().max().item() for r in results for k, p in r["params"].items()),
                default=0.0)
    return loss, param


def run_hf_parity(cfg: Any, world: int, rtol: float = 1e-5, atol: float = 1e-6,
                  loss_tol: float = 1e-5) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`piper_compile.testing.parity.run_parity` for the models of this module; returns the ranks'
    results and the eager reference."""
    from piper_compile.testing.launch import run_local
    from piper_compile.testing.parity import assert_parity, eager_reference

    results = run_local(hf_worker, world, cfg) if world > 1 else [hf_worker(0, 1, cfg)]
    ref = eager_reference(cfg, world)
    assert_parity(results, ref, rtol, atol, loss_tol)
    return results, ref
