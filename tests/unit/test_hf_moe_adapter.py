"""``piper_compile.nn.hf.adapt_moe``: transformers' sparse MoE blocks (Qwen3-MoE, Mixtral, DeepSeek-V3) swapped for
``piper::moe_experts`` blocks give the same logits, loss, router aux loss and gradients on one device (fp32)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

from piper_compile.nn.hf import (StackedMoE, UnsupportedMoEError, adapt_moe, hf_state_dict,  # noqa: E402
                                 unadapted_moe_blocks)
from piper_compile.testing.hf import build_family, build_qwen3_moe, make_batch  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


def _mixtral(seed: int = 0, **kw: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = MixtralConfig(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2, max_position_embeddings=64, use_cache=False), **kw})
    cfg._attn_implementation = "sdpa"
    return MixtralForCausalLM(cfg).float().train()


def _pair(original: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    adapted = adapt_moe(copy.deepcopy(original))
    return original, adapted


def _run(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, **kw: object):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, use_cache=False, **kw)
    loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + 0.01 * out.aux_loss
    loss.backward()
    return out, loss


def _expert_grads(model: torch.nn.Module, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """Per-expert weight gradients of the unadapted model, stacked like the adapted block's."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "experts") and not isinstance(mod, StackedMoE):
            for stacked, proj in zip(("w_gate", "w_up", "w_down"), names):
                ws = [getattr(e, proj).weight for e in mod.experts]  # an expert no token chose has no grad
                out[f"{name}.{stacked}"] = torch.stack([(w.grad if w.grad is not None else torch.zeros_like(w)).t()
                                                        for w in ws])
    return out


def _check(original: torch.nn.Module, adapted: torch.nn.Module, names: tuple[str, str, str], aux: bool = False) -> None:
    ids, targets = make_batch(4, torch.Generator().manual_seed(1), vocab=128, seq=16)
    kw = {"output_router_logits": True} if aux else {}
    out_o, loss_o = _run(original, ids, targets, **kw)
    out_a, loss_a = _run(adapted, ids, targets, **kw)
    torch.testing.assert_close(out_a.logits, out_o.logits, **TOL)
    torch.testing.assert_close(loss_a, loss_o, **TOL)
    if aux:
        assert out_o.aux_loss is not None and out_a.aux_loss is not None
        torch.testing.assert_close(out_a.aux_loss, out_o.aux_loss, **TOL)
        assert len(out_a.router_logits) == len(out_o.router_logits)
        for a, o in zip(out_a.router_logits, out_o.router_logits):
            torch.testing.assert_close(a, o, **TOL)
    grads_o = dict(original.named_parameters())
    shared = 0
    for name, p in adapted.named_parameters():
        if name in grads_o:  # every parameter outside the experts, routers included
            torch.testing.assert_close(p.grad, grads_o[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            shared += 1
    assert shared == sum(1 for n in grads_o if ".experts." not in n)
    stacked = {n: p.grad for n, p in adapted.named_parameters() if n.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down")}
    ref = _expert_grads(original, names)
    assert stacked.keys() == ref.keys() and stacked
    for name, g in stacked.items():
        torch.testing.assert_close(g, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_adapted_equals_transformers(norm_topk_prob):
    original, adapted = _pair(build_qwen3_moe(adapt=False, norm_topk_prob=norm_topk_prob))
    _check(original, adapted, ("gate_proj", "up_proj", "down_proj"))
    blocks = [m for m in adapted.modules() if isinstance(m, StackedMoE)]
    assert len(blocks) == 2 and [b._piper_tags for b in blocks] == [{"EP": 0}, {"EP": 1}]
    assert all(b.norm_topk_prob is norm_topk_prob and b.w_gate.shape == (4, 64, 64) for b in blocks)


def test_qwen3_moe_top4_dense_layers_and_router_aux_loss():
    """top-k 4 of 4 (a different summation order than transformers'), a dense MLP layer
    (``mlp_only_layers``), and ``output_router_logits`` (transformers' recorder finds the adapted block:
    it is still an instance of ``Qwen3MoeSparseMoeBlock``)."""
    original, adapted = _pair(build_qwen3_moe(adapt=False, num_hidden_layers=3, num_experts_per_tok=4,
                                              mlp_only_layers=[1]))
    _check(original, adapted, ("gate_proj", "up_proj", "down_proj"), aux=True)
    assert [m._piper_tags["EP"] for m in adapted.modules() if isinstance(m, StackedMoE)] == [0, 2]


def test_mixtral_adapted_equals_transformers():
    original, adapted = _pair(_mixtral())
    _check(original, adapted, ("w1", "w3", "w2"), aux=True)
    assert all(m.norm_topk_prob for m in adapted.modules() if isinstance(m, StackedMoE))


def test_names_state_dict_and_errors():
    model = build_qwen3_moe(adapt=False)
    assert unadapted_moe_blocks(model) == ["model.layers.0.mlp (Qwen3MoeSparseMoeBlock)",
                                           "model.layers.1.mlp (Qwen3MoeSparseMoeBlock)"]
    reference = copy.deepcopy(model)
    adapt_moe(model)
    assert unadapted_moe_blocks(model) == [] and adapt_moe(model) is model  # idempotent
    assert not any(".experts." in n for n, _ in model.named_parameters())
    # transformers' names back: an unadapted model loads them exactly
    fresh = build_qwen3_moe(seed=5, adapt=False)
    fresh.load_state_dict(hf_state_dict(model), strict=True)
    for (n, a), (_, b) in zip(fresh.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), n

    gelu = build_qwen3_moe(adapt=False, hidden_act="gelu")
    with pytest.raises(UnsupportedMoEError, match=r"model\.layers\.0\.mlp\.experts\.0 uses activation .*not SiLU"):
        adapt_moe(gelu)
    assert len(unadapted_moe_blocks(gelu)) == 2  # nothing replaced


def _deepseek(**kw: object) -> torch.nn.Module:
    model = build_family("deepseek_v3", adapt=False, **kw)
    gen = torch.Generator().manual_seed(3)
    for mod in model.modules():  # a nonzero score correction: the grouped top-k must see it
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.copy_(0.1 * torch.randn(mod.e_score_correction_bias.shape, generator=gen))
    return model


@pytest.mark.parametrize("kw", [{}, {"num_hidden_layers": 3, "first_k_dense_replace": 1, "norm_topk_prob": False,
                                     "n_shared_experts": 2, "n_group": 1, "topk_group": 1}])
def test_deepseek_v3_adapted_equals_transformers(kw):
    """DeepSeek-V3's MoE (routed experts chosen by its sigmoid router with grouped top-k, score-correction
    bias and routed_scaling_factor, plus shared experts) adapted: same logits, loss and gradients. Before,
    adapt_moe left it alone and Dynamo failed on its ``if token_indices.numel() > 0``."""
    original, adapted = _pair(_deepseek(**kw))
    moe = [m for m in adapted.modules() if isinstance(m, StackedMoE)]
    layers = kw.get("num_hidden_layers", 2)
    dense = kw.get("first_k_dense_replace", 0)
    assert len(moe) == layers - dense and [m._piper_tags for m in moe] == [{"EP": i} for i in range(dense, layers)]
    assert all(m.w_gate.shape == (4, 64, 32) and hasattr(m, "shared_experts") for m in moe)
    _check(original, adapted, ("gate_proj", "up_proj", "down_proj"))
    # transformers' names back (router weight and bias, shared experts keep theirs)
    fresh = build_family("deepseek_v3", seed=7, adapt=False, **kw)
    fresh.load_state_dict(hf_state_dict(adapted), strict=True)


class ToyMoE(torch.nn.Module):
    """A MoE block no adapter knows: a list of experts, a Python loop."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)


class FancySparseMoeBlock(torch.nn.Module):
    """Named like a MoE block, experts stored as one stacked tensor (no ``experts`` module)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 4, 4))


def test_unadapted_moe_blocks_lists_every_moe_block():
    """Every MoE-like block is reported, adaptable or not (DeepSeek-V3's used to be missed: ``[]``), only the
    outermost one of nested blocks; adapt_moe adapts what it can and warns about the rest."""
    model = _deepseek()
    model.toy = ToyMoE()
    model.fancy = FancySparseMoeBlock()
    assert unadapted_moe_blocks(model) == ["model.layers.0.mlp (DeepseekV3MoE)",
                                           "model.layers.1.mlp (DeepseekV3MoE)", "toy (ToyMoE)",
                                           "fancy (FancySparseMoeBlock)"]
    with pytest.warns(UserWarning, match=r"no adapter for the MoE block\(s\) \['toy \(ToyMoE\)', 'fancy"):
        adapt_moe(model)
    assert unadapted_moe_blocks(model) == ["toy (ToyMoE)", "fancy (FancySparseMoeBlock)"]
    assert unadapted_moe_blocks(build_qwen3_moe()) == []
