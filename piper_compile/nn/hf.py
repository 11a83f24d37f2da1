"""Hugging Face ``transformers`` MoE blocks made capturable and expert parallel, without editing transformers.

transformers' sparse MoE blocks (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``DeepseekV3MoE``)
compute their experts with a Python loop over the experts that were hit (``expert_hit = (...).nonzero()``,
then ``torch.where`` per expert; DeepSeek-V3 branches on ``token_indices.numel() > 0``): data-dependent
control flow and shapes. Dynamo cannot trace that into one
graph -- with ``fullgraph=True`` the first call fails inside transformers, where Dynamo raises (piper
reports it as a ``piper:`` error naming the block and :func:`adapt_moe`, ``capture/dynamo.one_graph_errors``)::

    torch._dynamo.exc.UserError: Could not extract specialized integer from data-dependent expression u0
    Caused by: for expert_idx in expert_hit:  # transformers/models/qwen3_moe/modeling_qwen3_moe.py:250

(with ``fullgraph=False`` Dynamo breaks the graph there and piper reports that the captured graph does
not return one scalar loss) -- and even a captured loop could not be sharded. :func:`adapt_moe` swaps
every such block for one with the same single-device math whose experts are one
:func:`piper_compile.nn.moe.moe_experts` op over stacked expert weights, tagged ``EP=<layer>``::

    model = Qwen3MoeForCausalLM(config)
    piper_compile.nn.hf.adapt_moe(model)       # before torch.compile and before building any optimizer
    directives = [piper.split(2), piper.replicate(), piper.shard({"EP": "*"})]

:func:`unadapted_moe_blocks` lists the blocks that still need it; :func:`hf_state_dict` gives back
transformers' parameter names (per-expert ``gate_proj`` / ``up_proj`` / ``down_proj``) for
``save_pretrained(state_dict=...)`` or loading into an unadapted model.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from piper_compile.capture.annotate import annotate
from piper_compile.errors import PiperError
from piper_compile.nn.moe import moe_experts

__all__ = ["adapt_moe", "moe_blocks", "unadapted_moe_blocks", "hf_state_dict", "init_fn", "StackedMoE",
           "UnsupportedMoEError"]


class UnsupportedMoEError(PiperError, ValueError):
    """A transformers MoE block whose experts are not SwiGLU (SiLU-gated, bias-free) experts."""


@dataclass(frozen=True)
class _Spec:
    """How one transformers MoE block class stores its experts."""

    module: str  # transformers module path
    cls: str  # block class name
    gate: str  # expert projection names: x -> act(gate(x)) * up(x) -> down
    up: str
    down: str
    norm_topk: str | None = None  # attribute holding norm_topk_prob; None: always renormalised (Mixtral)
    jitter: str | None = None  # attribute holding the training-time input jitter (Mixtral)
    # "softmax": ``gate`` is an nn.Linear, softmax then top-k in the adapted forward (Qwen3-MoE, Mixtral);
    # "module": ``gate(x)`` is transformers' own router module returning (expert indices, weights) (DeepSeek-V3)
    router: str = "softmax"
    shared: str | None = None  # attribute of a dense MLP every token also goes through (DeepSeek-V3)


_SPECS = (
    _Spec("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate_proj", "up_proj",
          "down_proj", norm_topk="norm_topk_prob", jitter=None),
    _Spec("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "w1", "w3", "w2",
          norm_topk=None, jitter="jitter_noise"),
    _Spec("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", "gate_proj", "up_proj", "down_proj",
          router="module", shared="shared_experts"),
)


def _hf_classes() -> list[tuple[type, _Spec]]:
    """The transformers block classes importable here, with their specs."""
    import importlib

    out = []
    for spec in _SPECS:
        try:
            out.append((getattr(importlib.import_module(spec.module), spec.cls), spec))
        except (ImportError, AttributeError):
            continue
    return out


class StackedMoE(nn.Module):
    """Mixin of the adapted blocks: the router (``gate``, the HF block's own ``nn.Linear`` or router module),
    the expert weights stacked as ``w_gate [E, D, H]``, ``w_up [E, D, H]``, ``w_down [E, H, D]`` (``x @ w``,
    i.e. the transposed ``nn.Linear`` weights) and, for DeepSeek-V3, the block's own ``shared_experts``.

    The adapted class derives from it *and* from the transformers class it replaces (so transformers'
    ``isinstance`` checks -- e.g. the ``output_router_logits`` recorder -- still find it), but is built
    by :meth:`from_hf`, never by the transformers ``__init__``; the per-expert modules are gone."""

    hf_class: type
    spec: _Spec

    @classmethod
    def from_hf(cls, block: nn.Module, name: str = "") -> "StackedMoE":
        spec = cls.spec
        experts = list(block.experts)
        where = name or type(block).__name__
        router = block.gate
        expected = block.num_experts if spec.router == "softmax" else router.n_routed_experts
        if len(experts) != expected:
            raise UnsupportedMoEError(f"piper: {where} ({type(block).__name__}) has {len(experts)} expert modules "
                                      f"but the router chooses among {expected}")
        for e, ex in enumerate(experts):
            act = getattr(ex, "act_fn", None)
            if not _is_silu(act):
                raise UnsupportedMoEError(
                    f"piper: {where}.experts.{e} uses activation {type(act).__name__}, not SiLU; "
                    "piper_compile.nn.moe_experts computes SwiGLU experts (silu(x @ w_gate) * (x @ w_up)) @ w_down "
                    "only, so adapt_moe cannot replace this block (config.hidden_act must be 'silu' or 'swish')")
            for p in (spec.gate, spec.up, spec.down):
                lin = getattr(ex, p, None)
                if not isinstance(lin, nn.Linear) or lin.bias is not None:
                    raise UnsupportedMoEError(f"piper: {where}.experts.{e}.{p} is not a bias-free nn.Linear "
                                              f"({type(lin).__name__}); adapt_moe cannot stack it")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_experts, new.top_k = expected, (block.top_k if spec.router == "softmax" else router.top_k)
        if spec.norm_topk:
            new.norm_topk_prob = bool(getattr(block, spec.norm_topk))
        else:  # Mixtral: always; DeepSeek-V3: its router applies its own setting (shown in extra_repr)
            new.norm_topk_prob = bool(getattr(router, "norm_topk_prob", True))
        new.jitter_noise = float(getattr(block, spec.jitter)) if spec.jitter else 0.0
        new.gate = router  # the same router module, parameter (and DeepSeek-V3's score-correction buffer)
        if spec.shared:
            new.shared_experts = getattr(block, spec.shared)  # the same dense MLP
        if hasattr(block, "config"):
            new.config = block.config

        def stacked(proj: str) -> nn.Parameter:
            ws = [getattr(ex, proj).weight for ex in experts]
            w = torch.stack([x.detach().t() for x in ws]).contiguous()
            return nn.Parameter(w, requires_grad=all(x.requires_grad for x in ws))

        new.w_gate, new.w_up, new.w_down = stacked(spec.gate), stacked(spec.up), stacked(spec.down)
        new.train(block.training)
        return new

    def forward(self, hidden_states: torch.Tensor) -> Any:
        """transformers' sparse MoE forward, the expert loop replaced by one ``piper::moe_experts``:
        returns ``(hidden_states [B, S, D], router_logits [B*S, E])`` like the Qwen3-MoE / Mixtral block it
        replaces, the hidden states alone for DeepSeek-V3."""
        if self.spec.router == "module":
            return self._forward_routed(hidden_states)
        batch, seq, dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral multiplies in place; same values, out of place
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.reshape(-1, dim)
        router_logits = self.gate(flat)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, idx = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        y = moe_experts(flat, idx, self.w_gate, self.w_up, self.w_down)  # [N, k, D], unweighted
        out = (y * weights.unsqueeze(-1)).sum(dim=1)
        return out.reshape(batch, seq, dim), router_logits

    def _forward_routed(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3: transformers' router module picks the experts and their weights (sigmoid scores plus
        the score-correction bias, the best ``topk_group`` of ``n_group`` groups, top-k, renormalised when
        ``norm_topk_prob``, times ``routed_scaling_factor``); the weighted expert outputs are summed in the
        weights' dtype (float32), cast back, and the shared experts' output is added."""
        shape = hidden_states.shape
        idx, weights = self.gate(hidden_states)
        flat = hidden_states.reshape(-1, shape[-1])
        y = moe_experts(flat, idx, self.w_gate, self.w_up, self.w_down)  # [N, k, D], unweighted
        out = (y * weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype).reshape(shape)
        if self.spec.shared:
            out = out + self.shared_experts(hidden_states)
        return out

    def extra_repr(self) -> str:
        e, d, h = self.w_gate.shape
        return (f"experts={e}, top_k={self.top_k}, dim={d}, hidden={h}, norm_topk_prob={self.norm_topk_prob}"
                f"{', shared experts' if self.spec.shared else ''}"
                f"{f', jitter_noise={self.jitter_noise}' if self.jitter_noise else ''} "
                f"(replaces {self.hf_class.__name__})")


def _is_silu(act: Any) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # older transformers: ACT2FN["silu"] is nn.SiLU
        return False
    return isinstance(act, SiLUActivation)


_ADAPTED: dict[type, type] = {}


def _adapted_class(hf_cls: type, spec: _Spec) -> type:
    cls = _ADAPTED.get(hf_cls)
    if cls is None:
        name = f"Stacked{hf_cls.__name__}"
        cls = type(name, (StackedMoE, hf_cls), {"__module__": __name__, "__qualname__": name,
                                                   "hf_class": hf_cls, "spec": spec})
        _ADAPTED[hf_cls] = cls
        globals()[name] = cls  # picklable by reference
    return cls


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module, type, _Spec]]:
    classes = _hf_classes()
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, StackedMoE):
            continue
        for hf_cls, spec in classes:
            if isinstance(mod, hf_cls):
                out.append((name, mod, hf_cls, spec))
                break
    return out


_MOE_CLASS_NAME = re.compile(r"(MoE|Moe)(Block|Layer)?$|SparseMLP$")


def _moe_like(mod: nn.Module) -> bool:
    """A mixture-of-experts block: it has an ``experts`` submodule (a list of expert MLPs or one module of
    stacked expert weights), or its class is named like one (``...MoE``, ``...MoeBlock``, ``...MoELayer``,
    ``...SparseMLP``). piper's own :class:`piper_compile.nn.MoE` and the adapted blocks are shardable as
    they are."""
    from piper_compile.nn.moe import MoE

    if isinstance(mod, (StackedMoE, MoE)):
        return False
    return isinstance(getattr(mod, "experts", None), nn.Module) or bool(_MOE_CLASS_NAME.search(type(mod).__name__))


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost mixture-of-experts blocks of ``model`` that are not :class:`StackedMoE` yet, as
    ``(qualified name, module)`` in module order: what :func:`unadapted_moe_blocks` names, for callers that
    need the modules themselves (piper's capture errors point at the block a failed trace stopped in)."""
    out: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in out if outer) or (out and out[0][0] == ""):
            continue
        if _moe_like(mod):
            out.append((name, mod))
    return out


def unadapted_moe_blocks(model: nn.Module) -> list[str]:
    """Qualified names (and classes) of the mixture-of-experts blocks in ``model`` that are not
    :class:`StackedMoE` yet, e.g. ``["model.layers.0.mlp (Qwen3MoeSparseMoeBlock)"]``: every block with an
    ``experts`` submodule or a class named like a MoE block (``...MoE``, ``...SparseMoeBlock``), whether
    :func:`adapt_moe` can adapt it or not. Dynamo cannot capture most of them with ``fullgraph=True``
    (data-dependent expert loops) and piper cannot shard their experts."""
    return [f"{name} ({type(mod).__name__})" for name, mod in moe_blocks(model)]


def adapt_moe(model: nn.Module) -> nn.Module:
    """Replace every ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` / ``DeepseekV3MoE`` in ``model``
    (in place) by a :class:`StackedMoE` with the same single-device math -- router ``gate`` (the same
    ``nn.Linear``), softmax in float32, top-k, renormalisation when ``norm_topk_prob`` (always for
    Mixtral), weights cast back to the input dtype, SwiGLU experts, weighted sum; for DeepSeek-V3 its own
    router module (sigmoid scores, score-correction bias, grouped top-k, ``routed_scaling_factor``), the
    weighted sum in float32, plus its shared experts -- its experts computed by one ``piper::moe_experts``
    op over expert weights stacked from the experts' ``gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral:
    ``w1`` / ``w3`` / ``w2``). Returns ``model``. Other MoE-like blocks (:func:`unadapted_moe_blocks`) stay
    as they are, with a warning naming them.

    Each adapted block is annotated ``EP=<decoder layer index>`` (from its name ``...layers.<i>...``; the
    block's ordinal when a name has none), so ``piper.shard({"EP": "*"})`` with ``piper.replicate()``
    makes them all expert parallel; other tags already on the block are kept.

    Why: transformers computes the experts in a Python loop over ``(...).nonzero()`` with ``torch.where``;
    compiling the unadapted model with ``fullgraph=True`` fails in Dynamo (``Could not extract specialized
    integer from data-dependent expression ... Caused by: for expert_idx in expert_hit``; ``piper.compile``
    says so naming the block and this function); :func:`unadapted_moe_blocks` names the blocks.

    Call it before ``torch.compile`` and before building an optimizer over ``model.parameters()``: the
    per-expert parameters are replaced by three stacked ones per block (:func:`hf_state_dict` maps back to
    transformers' names). The router keeps its parameter. Experts must be SiLU-gated and bias-free
    (:class:`UnsupportedMoEError` names the module otherwise). Single-device outputs match transformers'
    up to floating-point summation order (exact for ``top_k <= 2``)."""
    blocks = _blocks(model)
    adaptable = {id(mod) for _, mod, _, _ in blocks}
    others = [f"{name} ({type(mod).__name__})" for name, mod in moe_blocks(model) if id(mod) not in adaptable]
    if others:
        known = ", ".join(spec.cls for spec in _SPECS)
        warnings.warn(f"piper: adapt_moe has no adapter for the MoE block(s) {others}; they stay as they are (not "
                      f"expert parallel, and Dynamo may not capture them with fullgraph=True). Adapted classes: "
                      f"{known}", stacklevel=2)
    if not blocks:
        return model
    indices = [_layer_index(name) for name, *_ in blocks]
    if None in indices or len(set(indices)) != len(indices):
        indices = list(range(len(blocks)))
    adapted = [(name, _adapted_class(hf_cls, spec).from_hf(mod, name), mod)
               for name, mod, hf_cls, spec in blocks]  # validate every block before replacing any
    for (name, new, old), layer in zip(adapted, indices):
        tags = dict(getattr(old, "_piper_tags", {}))
        tags.setdefault("EP", layer)
        annotate(new, **tags)
        _set_submodule(model, name, new)
    return model


def _layer_index(name: str) -> int | None:
    found = re.findall(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
    return int(found[-1]) if found else None


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    if not name:
        raise UnsupportedMoEError("piper: adapt_moe(model) was given the MoE block itself; pass the model "
                                  "that contains it (the block is replaced inside its parent)")
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every adapted block's stacked expert weights split back into
    transformers' per-expert ``nn.Linear`` weights (``<block>.experts.<e>.gate_proj.weight = w_gate[e].T``,
    ...), so an unadapted transformers model (or ``save_pretrained(state_dict=...)``) accepts it."""
    sd = model.state_dict()
    for name, mod in model.named_modules():
        if not isinstance(mod, StackedMoE):
            continue
        prefix = f"{name}." if name else ""
        for stacked, proj in (("w_gate", mod.spec.gate), ("w_up", mod.spec.up), ("w_down", mod.spec.down)):
            w = sd.pop(prefix + stacked)
            for e in range(w.shape[0]):
                sd[f"{prefix}experts.{e}.{proj}.weight"] = w[e].t().contiguous()
    return sd


def init_fn(model: nn.Module) -> Any:
    """``options["init_fn"]`` for a transformers model built on the meta device: its own ``_init_weights``
    per module (normal(0, initializer_range) Linear / Embedding weights, zero biases, unit norms), and each
    rotary embedding's ``inv_freq`` computed again from its config (transformers computes it in
    ``__init__``, so on the meta device it has no values). Adapted MoE blocks' stacked experts get
    ``normal(0, initializer_range)`` as their per-expert Linears would."""
    found = next((m for m in model.modules() if callable(getattr(m, "_init_weights", None))
                  and hasattr(m, "config")), None)
    if found is None:
        raise PiperError("piper: nn.hf.init_fn(model): the model contains no transformers PreTrainedModel")
    hf = found
    std = float(getattr(hf.config, "initializer_range", 0.02))

    def init(mod: nn.Module) -> None:
        if callable(getattr(mod, "rope_init_fn", None)) and isinstance(getattr(mod, "inv_freq", None), torch.Tensor):
            inv_freq, _ = mod.rope_init_fn(mod.config, torch.device("cpu"))
            mod.inv_freq.copy_(inv_freq)
        elif isinstance(mod, StackedMoE):
            for w in (mod.w_gate, mod.w_up, mod.w_down):
                nn.init.normal_(w, std=std)
        else:
            hf._init_weights(mod)

    return init
