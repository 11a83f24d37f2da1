"""Grouped SwiGLU experts: the math shared by the single-device custom op and the expert-parallel runtime.

Weights are grouped per expert: ``w_gate`` and ``w_up`` are ``[E, D, H]``, ``w_down`` is ``[E, H, D]``;
expert ``e`` maps a token ``x`` to ``(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]``. Tokens are given
sorted by expert with ``counts[e]`` rows for expert ``e``; an expert with no rows is skipped (its weight
gradient is zero).

On CUDA both functions run the Triton kernels of :mod:`piper_compile.nn.triton_experts` when triton is
installed (``PIPER_TRITON_EXPERTS=0`` turns them off); the torch code here is the reference and the CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def blocks(counts: torch.Tensor | list[int]) -> list[tuple[int, int, int]]:
    """(expert, start row, end row) of every expert that has rows."""
    sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    out, start = [], 0
    for e, c in enumerate(sizes):
        if c:
            out.append((e, start, start + int(c)))
        start += int(c)
    return out


def zero_unused(grads: tuple[torch.Tensor, ...], spans: list[tuple[int, int, int]]) -> None:
    """Gradients written over (not added to): an expert without rows in ``spans`` has a zero gradient."""
    used = {e for e, _, _ in spans}
    for e in range(grads[0].shape[0]):
        if e not in used:
            for g in grads:
                g[e].zero_()


def use_triton(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the Triton kernels: CUDA fp32/bf16/fp16 only (triton is then imported on
    first use), and not while torch.compile traces (the reference stays the traced code)."""
    if (x.device.type != "cuda" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or torch.compiler.is_compiling()):
        return False
    from piper_compile.nn.triton_experts import triton_available
    return triton_available(x.device)


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor | list[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """Expert outputs for ``x`` (rows sorted by expert, ``counts`` rows each)."""
    if use_triton(x):
        from piper_compile.nn.triton_experts import grouped_swiglu_triton
        return grouped_swiglu_triton(x, counts, w_gate, w_up, w_down)
    y = x.new_zeros(x.shape[0], w_down.shape[-1])
    for e, a, b in blocks(counts):
        y[a:b] = block_forward(x[a:b], w_gate[e], w_up[e], w_down[e])
    return y


def block_forward(xe: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """One expert's rows through its SwiGLU (the reference's loop body; ``sim/expert_memory`` walks it)."""
    return (F.silu(xe @ wg) * (xe @ wu)) @ wd


def block_backward(ge: torch.Tensor, xe: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor,
                   gg: torch.Tensor, gu: torch.Tensor, gd: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """One expert's input gradient; its weight gradients added into ``gg``/``gu``/``gd`` (``beta=0``: written
    over them). The reference's loop body (``sim/expert_memory`` walks it): each intermediate is dropped
    after its last use, as the walk assumes (a named local would hold its rows until the return)."""
    g_pre, u = xe @ wg, xe @ wu
    s = torch.sigmoid(g_pre)
    act = g_pre * s
    gd.addmm_((act * u).t(), ge, beta=beta)
    gh = ge @ wd.t()
    gu_pre = gh * act
    del act
    d_act = s * (1 + g_pre * (1 - s))  # silu'(g_pre)
    del s, g_pre
    gg_pre = (gh * u).mul_(d_act)
    del gh, u, d_act
    gu.addmm_(xe.t(), gu_pre, beta=beta)
    gg.addmm_(xe.t(), gg_pre, beta=beta)
    return gg_pre @ wg.t() + gu_pre @ wu.t()


def grouped_swiglu_backward(gy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor | list[int],
                            w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                            accumulate: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            overwrite: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`grouped_swiglu` w.r.t. ``x`` and the three weights (hidden values recomputed).
    ``accumulate``: existing weight-gradient buffers to add into (returned in place of new tensors);
    with ``overwrite`` their contents are replaced instead (no zeroing pass before the first write)."""
    if use_triton(x):
        from piper_compile.nn.triton_experts import grouped_swiglu_backward_triton
        return grouped_swiglu_backward_triton(gy, x, counts, w_gate, w_up, w_down, accumulate, overwrite)
    gx = torch.zeros_like(x)
    if accumulate is None:
        gg, gu, gd = torch.zeros_like(w_gate), torch.zeros_like(w_up), torch.zeros_like(w_down)
    else:
        gg, gu, gd = accumulate
    spans = blocks(counts)
    beta = 0.0 if overwrite and accumulate is not None else 1.0  # beta=0: addmm_ ignores the old contents
    if beta == 0.0:
        zero_unused((gg, gu, gd), spans)
    for e, a, b in spans:
        gx[a:b] = block_backward(gy[a:b], x[a:b], w_gate[e], w_up[e], w_down[e], gg[e], gu[e], gd[e], beta)
    return gx, gg, gu, gd


def route(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For top-k expert indices ``idx [N, k]``: the slot order that sorts the ``N*k`` (token, choice) slots
    by expert (stable, so ties keep token order), and the slot count per expert ``[E]``."""
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts
