"""``piper_compile.nn.MoE``: a mixture-of-experts layer whose expert computation is one custom op.

Single-device behaviour is an ordinary top-k MoE layer. For piper the op ``piper::moe_experts`` (and
its backward ``piper::moe_experts_backward``) is the boundary the ``shard`` directive recognises: capture
cuts a segment around it, and under expert parallelism the compiler replaces it by a dispatch
all-to-all (token counts first, then a variable-size ``all_to_all_single``), the local experts, and
the combining all-to-all -- in forward and backward.

Making your own MoE layer shardable: compute the experts through :func:`moe_experts` --
``y = moe_experts(x [N, D], expert_idx [N, k] int64, w_gate [E, D, H], w_up [E, D, H], w_down [E, H, D])``
returns every (token, choice) slot's expert output ``[N, k, D]`` (not yet weighted) -- and keep the
router, the gate weights and the weighted sum around it in ordinary PyTorch.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from piper_compile.nn.experts import grouped_swiglu, grouped_swiglu_backward, route


@torch.library.custom_op("piper::moe_experts", mutates_args=())
def _moe_experts(x: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor) -> torch.Tensor:
    n, k = idx.shape
    order, counts = route(idx, w_gate.shape[0])
    ys = grouped_swiglu(x[order // k], counts, w_gate, w_up, w_down)
    y = torch.empty_like(ys)
    y[order] = ys
    return y.view(n, k, -1)


@_moe_experts.register_fake
def _(x: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
      w_down: torch.Tensor) -> torch.Tensor:
    return x.new_empty(idx.shape[0], idx.shape[1], w_down.shape[-1])


@torch.library.custom_op("piper::moe_experts_backward", mutates_args=())
def _moe_experts_backward(gy: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor,
                          w_up: torch.Tensor, w_down: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = idx.shape
    order, counts = route(idx, w_gate.shape[0])
    gxs, gg, gu, gd = grouped_swiglu_backward(gy.reshape(n * k, -1)[order], x[order // k], counts,
                                              w_gate, w_up, w_down)
    gx = torch.zeros_like(x)
    gx.index_add_(0, order // k, gxs)
    return gx, gg, gu, gd


@_moe_experts_backward.register_fake
def _(gy: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
      w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
    x, idx, wg, wu, wd = ctx.saved_tensors
    gx, gg, gu, gd = torch.ops.piper.moe_experts_backward(gy, x, idx, wg, wu, wd)
    return gx, None, gg, gu, gd


torch.library.register_autograd("piper::moe_experts", _backward, setup_context=_setup)

FORWARD_OP = torch.ops.piper.moe_experts.default
BACKWARD_OP = torch.ops.piper.moe_experts_backward.default


def moe_experts(x: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """Expert outputs ``[N, k, D]`` of every (token, choice) slot: token ``n`` through expert ``idx[n, j]``.
    The op piper's ``shard`` directive turns into expert parallelism."""
    return torch.ops.piper.moe_experts(x, idx, w_gate, w_up, w_down)


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts (Mixtral / Qwen-MoE style): softmax router, the top ``k`` experts
    per token, their outputs weighted by the renormalised router probabilities.

    ``forward(x [..., D]) -> [..., D]``. No load-balancing loss: a Switch-style one (``E * sum(fraction_routed
    * mean_prob)`` over the batch's tokens) is a product of two batch means, which micro-batches cannot add
    up, so piper refuses it where the batch is cut (``capture/decompose.py``) unless ``local_batch_ops``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"piper: MoE top_k must be in 1..num_experts ({num_experts}), got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The experts' weights ~ N(0, 1 / fan_in) (the router, a Linear, resets itself)."""
        dim, hidden = self.w_gate.shape[1], self.w_gate.shape[2]
        for w, fan_in in ((self.w_gate, dim), (self.w_up, dim), (self.w_down, hidden)):
            nn.init.normal_(w, std=1.0 / math.sqrt(fan_in))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k weights [N, k], expert indices [N, k], router probabilities [N, E]) for tokens ``x [N, D]``."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), idx, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx, _ = self.route(flat)
        y = moe_experts(flat, idx, self.w_gate, self.w_up, self.w_down)
        return (y * weights.unsqueeze(-1)).sum(dim=1).reshape(shape)
