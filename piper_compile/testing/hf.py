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
with ``.item()``; piper feeds them every step, but ``codegen="inductor"`` cannot retrace those forward
segments and runs them eagerly (a warning). ``torch._dynamo.config.specialize_float = True`` makes them
constants (guarded) and every segment compiles.
"""
from __future__ import annotations

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
    ``labels=`` to the model (transformers' own shifted loss, which ignores the last position; it averages
    per call, so it equals the global mean only when every micro-batch has as many non-ignored labels --
    true here, not with uneven ``-100`` padding)."""

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


_models.MODELS.setdefault("llama", LlamaLoss)
_models.MODELS.setdefault("qwen3moe", Qwen3MoeLoss)


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
