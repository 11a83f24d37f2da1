"""Small models used by the example, the tests and the benchmarks. Each ``forward`` returns a scalar
loss and reads the batch size from its input (``x.shape[0]``), so micro-batching works."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from piper_compile.capture.annotate import annotate
from piper_compile.nn.moe import MoE


class MLPChain(nn.Module):
    """``depth`` Linear+tanh layers; each layer is a pipeline-stage candidate. ``reduction``: the MSE's."""

    def __init__(self, dim: int = 32, depth: int = 4, reduction: str = "mean") -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.reduction = reduction

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y, reduction=self.reduction)

    def annotate_stages(self, stages: int) -> None:
        for i, layer in enumerate(self.layers):
            annotate(layer, PP=i * stages // len(self.layers))

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        d = self.layers[0].in_features
        return torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)


class ScaledLinear(nn.Linear):
    """``Linear`` followed by a per-feature gain and shift held as buffers (persistent ``gain``,
    non-persistent ``shift``), set by ``reset_parameters`` from the layer's index: constants that differ
    per layer, as a model's masks, rotary tables or normalization statistics do."""

    def __init__(self, dim: int, index: int) -> None:
        self.index = index
        super().__init__(dim, dim)
        self.register_buffer("gain", torch.empty(dim))
        self.register_buffer("shift", torch.empty(dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.gain.fill_(1.0 + 0.25 * self.index)
            self.shift.fill_(0.05 * (self.index + 1))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "gain"):  # nn.Linear's __init__ calls this before the buffers exist
            self.reset_buffers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain + self.shift


class BufferedMLP(MLPChain):
    """:class:`MLPChain` of :class:`ScaledLinear` layers: every pipeline stage reads its own buffers."""

    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__(dim, 0)
        self.layers = nn.ModuleList(ScaledLinear(dim, i) for i in range(depth))


class AutocastMLP(MLPChain):
    """``MLPChain`` whose layers run under ``torch.autocast`` (bf16 matmuls on fp32 weights, the loss in
    fp32 outside it): a user's own autocast, captured by Dynamo, alone or under a mixed-precision policy."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return F.mse_loss(x.float(), y.float())


class SkipNet(nn.Module):
    """A residual that jumps from the first layer over every later stage boundary to the loss."""

    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        first = torch.relu(self.layers[0](x))
        h = first
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return F.mse_loss(h + first, y)

    annotate_stages = MLPChain.annotate_stages
    make_batch = MLPChain.make_batch


@dataclass
class GPTConfig:
    vocab: int = 96
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 4


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention (scaled_dot_product_attention) + MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus causal self-attention of ``ln1(x)``."""
        b, t, c = x.shape
        # chunk and -1 (not split(c) / n_heads): under shard_tensor qkv holds this rank's heads only
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, -1, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, pre-LN blocks, LM head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: used by the first and the last stage
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 if "proj" not in name else 0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def annotate_stages(self, stages: int) -> None:
        for i, block in enumerate(self.blocks):
            annotate(block, PP=i * stages // len(self.blocks))

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        """Synthetic next-token task: sequences follow ``x[t+1] = (a * x[t] + b) % vocab``."""
        v, t = self.cfg.vocab, self.cfg.seq
        start = torch.randint(0, v, (n, 1), generator=gen)
        a = torch.randint(1, 4, (n, 1), generator=gen)
        steps = torch.arange(t + 1).unsqueeze(0)
        seq = (start + a * steps) % v
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class MoEBlock(Block):
    """A :class:`Block` whose MLP is a :class:`piper_compile.nn.MoE` (tagged ``EP`` by the model)."""

    def __init__(self, cfg: GPTConfig, experts: int, top_k: int) -> None:
        super().__init__(cfg)
        del self.fc, self.out
        self.moe = MoE(cfg.dim, 2 * cfg.dim, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.moe(self.ln2(x))


class MoEGPT(GPT):
    """:class:`GPT` with MoE blocks; every MoE layer is annotated ``EP=<layer>``, so ``{"EP": "*"}``
    selects all of them for the ``shard`` directive."""

    def __init__(self, cfg: GPTConfig | None = None, experts: int = 4, top_k: int = 2) -> None:
        super().__init__(cfg)
        cfg = self.cfg
        self.blocks = nn.ModuleList(MoEBlock(cfg, experts, top_k) for _ in range(cfg.layers))
        for name, p in self.blocks.named_parameters():
            if name.endswith("weight") and p.dim() == 2 and "ln" not in name:
                nn.init.normal_(p, std=0.02)
        for i, block in enumerate(self.blocks):
            annotate(block.moe, EP=i)


class MoENet(nn.Module):
    """One :class:`MoE` layer (tagged ``EP=0``) between two linear layers, MSE loss. ``skew`` > 0 biases
    the router towards experts 0..top_k-1 through input feature 0 (held at 1), so those experts get
    every token and the others none: load imbalance, and ranks that receive zero tokens under EP."""

    def __init__(self, dim: int = 16, hidden: int = 32, experts: int = 4, top_k: int = 2, skew: float = 0.0) -> None:
        super().__init__()
        self.dim, self.skew = dim, skew
        self.inp = nn.Linear(dim, dim)
        self.moe = annotate(MoE(dim, hidden, experts, top_k), EP=0)
        self.out = nn.Linear(dim, dim)
        if skew:
            with torch.no_grad():
                self.moe.router.weight[:, 0] = -skew
                self.moe.router.weight[:top_k, 0] = skew

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.skew:
            h = torch.cat([torch.ones_like(h[..., :1]), h[..., 1:]], dim=-1)
        return F.mse_loss(self.out(h + self.moe(h)), y)

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(n, 8, self.dim, generator=gen), torch.randn(n, 8, self.dim, generator=gen)


class SharedNormMLP(nn.Module):
    """Sequence-parallel corner case: one LayerNorm applied to the whole input and, after a
    column/row-parallel MLP pair (``fc``/``out``), to the sequence-split residual stream."""

    def __init__(self, dim: int = 16, seq: int = 8) -> None:
        super().__init__()
        self.seq = seq
        self.norm = nn.LayerNorm(dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x + self.out(F.gelu(self.fc(self.norm(x))))
        return F.mse_loss(self.norm(h), y)

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        d = self.fc.in_features
        return torch.randn(n, self.seq, d, generator=gen), torch.randn(n, self.seq, d, generator=gen)


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``NewGELUActivation``, written out as transformers does."""
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


class TanhGELUMLP(nn.Module):
    """``depth`` Linear layers each followed by GPT-2's tanh GELU, then ``Linear(hidden, classes)`` and
    cross-entropy. Two capture corner cases of transformers models in a few lines: the backward keeps
    ``tanh`` (as a detached alias) and the forward reads it again in ``1 + tanh`` (remat), and under
    ``dynamic=True`` Dynamo passes ``math.pi`` as a 0-dim input, so ``sqrt(2 / pi)`` is a symbolic float
    computed in the first layer's region and used by every layer's (pipeline stages)."""

    def __init__(self, dim: int = 16, hidden: int = 32, classes: int = 4, depth: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim if i == 0 else hidden, hidden) for i in range(depth))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = gelu_tanh(layer(x))
        return F.cross_entropy(self.head(x), y)

    def annotate_stages(self, stages: int) -> None:
        for i, layer in enumerate(self.layers):
            annotate(layer, PP=i * stages // len(self.layers))

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(n, self.layers[0].in_features, generator=gen)
        return x, torch.randint(0, self.head.out_features, (n,), generator=gen)


class TiedMLP(nn.Module):
    """``depth`` square Linear + tanh layers where every ``every``-th one (0, every, 2*every, ...) is one
    shared ``nn.Linear``: with a stage per ``every`` layers, three or more pipeline stages hold the same
    weight, each accumulating its own part of the gradient (``capture/grad_parts.py``)."""

    def __init__(self, dim: int = 16, depth: int = 6, every: int = 2) -> None:
        super().__init__()
        shared = nn.Linear(dim, dim)
        self.stages = 0
        self.layers = nn.ModuleList(shared if i % every == 0 else nn.Linear(dim, dim) for i in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.stages:  # the shared Linear runs in several stages: each call is tagged where it is made
                with annotate(PP=i * self.stages // len(self.layers)):
                    x = torch.tanh(layer(x))
            else:
                x = torch.tanh(layer(x))
        return F.mse_loss(x, y)

    def annotate_stages(self, stages: int) -> None:
        self.stages = stages

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        d = self.layers[0].in_features
        return torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)


class FloatArgument(nn.Module):
    """``inner``'s loss times a float the forward takes: a model whose call passes a Python float, under
    which piper keeps Dynamo's floats symbolic (``capture/dynamo.capture_settings``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        return self.inner(x, y) * scale


MODELS = {"tied_mlp": TiedMLP, "mlp": MLPChain, "buffered_mlp": BufferedMLP, "autocast_mlp": AutocastMLP, "skip": SkipNet, "gpt": GPT, "moegpt": MoEGPT, "moe": MoENet, "shared_norm": SharedNormMLP,
          "gelu_tanh": TanhGELUMLP}


def build_model(name: str, seed: int = 0, **kwargs: object) -> nn.Module:
    torch.manual_seed(seed)
    if name in ("gpt", "moegpt"):
        moe = {k: kwargs.pop(k) for k in ("experts", "top_k") if k in kwargs}
        cfg = GPTConfig(**kwargs)  # type: ignore[arg-type]
        return GPT(cfg) if name == "gpt" else MoEGPT(cfg, **moe)  # type: ignore[arg-type]
    return MODELS[name](**kwargs)  # type: ignore[arg-type]
