"""Triton kernels for the grouped SwiGLU experts of :mod:`piper_compile.nn.experts` (forward and backward).

Rows are sorted by expert (``counts[e]`` rows each). The row-wise GEMMs are grouped GEMMs: a table built on
the device from ``counts`` (no host sync, no Python loop over experts) maps every program to one tile of
``BLOCK_M`` rows of one expert. The weight gradients are per-expert reductions over that expert's rows: one
program per (expert, output tile) loops over the rows. All kernels accumulate in fp32. The forward fuses
``silu(x @ w_gate) * (x @ w_up)`` into one kernel (then one grouped GEMM with ``w_down``); the backward
recomputes the pre-activations in one kernel that also forms ``gy @ w_down^T`` and applies the SwiGLU
derivative in its epilogue, then one grouped GEMM for ``gx`` and two per-expert reductions for the weights.

``triton`` is imported guarded: without it this module still imports and :func:`triton_available` is False
(:mod:`piper_compile.nn.experts` only imports this module for CUDA tensors). The kernels are defined at
import, which is when triton reads ``TRITON_INTERPRET`` (the tests run them on CPU in a subprocess); the
``INTERP`` compile-time flag then switches on workarounds for the interpreter (see ``_INTERPRETED``), which
compiled kernels never see.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

try:
    import triton
    import triton.language as tl
    _jit: Callable[[Any], Any] = triton.jit
except Exception:  # noqa: BLE001 -- a missing or broken triton install both mean "no triton"
    triton = tl = None

    def _jit(fn: Any) -> Any:
        """Stand-in for ``triton.jit`` when triton is missing (the kernels are then never launched)."""
        return fn

Counts = torch.Tensor | list[int]
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Table = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


@dataclass
class Blocks:
    """Tile sizes (each a power of two >= 16): ``m`` rows, ``n`` output columns, ``k`` reduction step."""
    m: int = 64
    n: int = 64
    k: int = 32


BLOCKS = Blocks()  # module-level so tests can shrink the tiles to get several tiles per expert


def triton_available(device: torch.device | str) -> bool:
    """True when triton imports, ``device`` is CUDA and the knob ``PIPER_TRITON_EXPERTS`` is not ``0``."""
    from piper_compile.knobs import knob
    return triton is not None and torch.device(device).type == "cuda" and bool(knob("PIPER_TRITON_EXPERTS"))


@_jit
def _dot(a, b, acc, PREC: tl.constexpr, INTERP: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation; ``INTERP`` (interpreter only): operands to fp32 first, since
    the interpreter cannot multiply bf16 (exact: a bf16 product fits in fp32, accumulation stays fp32)."""
    if INTERP:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@_jit
def _k_end(r0, r1, K, INTERP: tl.constexpr, LOOP_END: tl.constexpr):
    """The reduction's end for a row tile ``[r0, r1)``: 0 for an empty tile (past the last rows), else ``K``.
    ``INTERP``: the compile-time ``LOOP_END`` (= ``K``): some interpreter versions take only constants as loop
    bounds (triton 3.6 passes even int arguments as 1-element arrays, which ``range`` rejects with numpy 2.4)."""
    if INTERP:
        return LOOP_END
    return tl.where(r1 > r0, K, 0)


@_jit
def _out(v, out_ptr, INTERP: tl.constexpr):
    """The fp32 tile ``v`` in ``out_ptr``'s element type, rounded to nearest even. ``INTERP`` (interpreter
    only): the interpreter's fp32 -> bf16 cast truncates where the GPU rounds, so round the bits first."""
    if INTERP:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)
            v = bits.to(tl.float32, bitcast=True)
    return v.to(out_ptr.dtype.element_ty)


@_jit
def _swiglu_hidden_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, tile_e, tile_r0, tile_r1, D, H,
                          PREC: tl.constexpr, INTERP: tl.constexpr, LOOP_END: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``h[rows] = silu(x[rows] @ wg[e]) * (x[rows] @ wu[e])`` for one (row tile, hidden tile)."""
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_e + pid).to(tl.int64)
    r0, r1 = tl.load(tile_r0 + pid), tl.load(tile_r1 + pid)
    rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < r1, cols < H
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, _k_end(r0, r1, D, INTERP, LOOP_END), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < D
        a = tl.load(x_ptr + rows[:, None] * D + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w_off = e * D * H + ks[:, None] * H + cols[None, :]
        wmask = kmask[:, None] & cmask[None, :]
        acc_g = _dot(a, tl.load(wg_ptr + w_off, mask=wmask, other=0.0), acc_g, PREC, INTERP)
        acc_u = _dot(a, tl.load(wu_ptr + w_off, mask=wmask, other=0.0), acc_u, PREC, INTERP)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = h_ptr + rows[:, None] * H + cols[None, :]
    tl.store(out, _out(h, h_ptr, INTERP), mask=rmask[:, None] & cmask[None, :])


@_jit
def _swiglu_backward_hidden_kernel(x_ptr, gy_ptr, wg_ptr, wu_ptr, wd_ptr, h_ptr, gu_ptr, gg_ptr,
                                   tile_e, tile_r0, tile_r1, D, H, PREC: tl.constexpr, INTERP: tl.constexpr,
                                   LOOP_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr):
    """Recompute ``g = x @ wg[e]``, ``u = x @ wu[e]`` and form ``gh = gy @ wd[e]^T`` for one tile, then store
    ``h = silu(g) * u``, ``gu_pre = gh * silu(g)`` and ``gg_pre = gh * u * silu'(g)``."""
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_e + pid).to(tl.int64)
    r0, r1 = tl.load(tile_r0 + pid), tl.load(tile_r1 + pid)
    rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < r1, cols < H
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, _k_end(r0, r1, D, INTERP, LOOP_END), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < D
        amask = rmask[:, None] & kmask[None, :]
        a = tl.load(x_ptr + rows[:, None] * D + ks[None, :], mask=amask, other=0.0)
        ga = tl.load(gy_ptr + rows[:, None] * D + ks[None, :], mask=amask, other=0.0)
        w_off = e * D * H + ks[:, None] * H + cols[None, :]  # wg[e], wu[e]: [D, H]
        wd_off = e * H * D + cols[None, :] * D + ks[:, None]  # wd[e]^T: [D, H] view of [H, D]
        wmask = kmask[:, None] & cmask[None, :]
        acc_g = _dot(a, tl.load(wg_ptr + w_off, mask=wmask, other=0.0), acc_g, PREC, INTERP)
        acc_u = _dot(a, tl.load(wu_ptr + w_off, mask=wmask, other=0.0), acc_u, PREC, INTERP)
        acc_h = _dot(ga, tl.load(wd_ptr + wd_off, mask=wmask, other=0.0), acc_h, PREC, INTERP)
    s = tl.sigmoid(acc_g)
    act = acc_g * s
    offs = rows[:, None] * H + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    tl.store(h_ptr + offs, _out(act * acc_u, h_ptr, INTERP), mask=omask)
    tl.store(gu_ptr + offs, _out(acc_h * act, gu_ptr, INTERP), mask=omask)
    gg = acc_h * acc_u * (s * (1.0 + acc_g * (1.0 - s)))
    tl.store(gg_ptr + offs, _out(gg, gg_ptr, INTERP), mask=omask)


@_jit
def _grouped_rows_kernel(a_ptr, b_ptr, a2_ptr, b2_ptr, out_ptr, tile_e, tile_r0, tile_r1, K, N,
                         sb_e, sb_k, sb_n, sb2_e, sb2_k, sb2_n, DUAL: tl.constexpr, PREC: tl.constexpr,
                         INTERP: tl.constexpr, LOOP_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """``out[rows] = a[rows] @ b[e]`` (``+ a2[rows] @ b2[e]`` with ``DUAL``) for one (row tile, column
    tile); ``a``, ``a2`` are ``[rows, K]`` and ``out`` ``[rows, N]`` row-major, ``b``, ``b2`` strided."""
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_e + pid).to(tl.int64)
    r0, r1 = tl.load(tile_r0 + pid), tl.load(tile_r1 + pid)
    rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < r1, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, _k_end(r0, r1, K, INTERP, LOOP_END), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        amask = rmask[:, None] & kmask[None, :]
        bmask = kmask[:, None] & cmask[None, :]
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=amask, other=0.0)
        b = tl.load(b_ptr + e * sb_e + ks[:, None] * sb_k + cols[None, :] * sb_n, mask=bmask, other=0.0)
        acc = _dot(a, b, acc, PREC, INTERP)
        if DUAL:
            a2 = tl.load(a2_ptr + rows[:, None] * K + ks[None, :], mask=amask, other=0.0)
            b2 = tl.load(b2_ptr + e * sb2_e + ks[:, None] * sb2_k + cols[None, :] * sb2_n, mask=bmask, other=0.0)
            acc = _dot(a2, b2, acc, PREC, INTERP)
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, _out(acc, out_ptr, INTERP), mask=rmask[:, None] & cmask[None, :])


@_jit
def _store_grad(out_ptr, acc, e, ps, qs, P, Q, so_e, so_p, so_q, ADD: tl.constexpr, INTERP: tl.constexpr):
    """Write (``ADD``: add) the fp32 tile ``acc`` into ``out[e, ps, qs]`` in ``out``'s dtype."""
    mask = (ps < P)[:, None] & (qs < Q)[None, :]
    ptr = out_ptr + e * so_e + ps[:, None] * so_p + qs[None, :] * so_q
    if ADD:
        acc += tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, _out(acc, out_ptr, INTERP), mask=mask)


@_jit
def _weight_grad_kernel(a_ptr, b_ptr, b2_ptr, out_ptr, out2_ptr, starts, counts, P, Q,
                        so_e, so_p, so_q, so2_e, so2_p, so2_q, DUAL: tl.constexpr, ADD: tl.constexpr,
                        PREC: tl.constexpr, INTERP: tl.constexpr, LOOP_END: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr):
    """``out[e] = a[rows_e]^T @ b[rows_e]`` (and ``out2[e]`` from ``b2`` with ``DUAL``) for one (expert,
    output tile): a reduction over the expert's rows, zero for an expert without rows. ``a`` is
    ``[rows, P]``, ``b``, ``b2`` ``[rows, Q]`` row-major; ``out``, ``out2`` ``[E, P, Q]`` strided."""
    e, pid_p, pid_q = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r0 = tl.load(starts + e)
    r1 = r0 + tl.load(counts + e)
    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    pmask, qmask = ps < P, qs < Q
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    lo, hi = r0, r1
    if INTERP:  # constant loop bounds only (see _k_end): all N = LOOP_END rows, masked to the expert's
        lo, hi = 0, LOOP_END
    for r in range(lo, hi, BLOCK_R):
        rows = (r + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = (rows >= r0) & (rows < r1)
        at = tl.load(a_ptr + rows[None, :] * P + ps[:, None], mask=pmask[:, None] & rmask[None, :], other=0.0)
        bmask = rmask[:, None] & qmask[None, :]
        b = tl.load(b_ptr + rows[:, None] * Q + qs[None, :], mask=bmask, other=0.0)
        acc = _dot(at, b, acc, PREC, INTERP)
        if DUAL:
            b2 = tl.load(b2_ptr + rows[:, None] * Q + qs[None, :], mask=bmask, other=0.0)
            acc2 = _dot(at, b2, acc2, PREC, INTERP)
    e64 = e.to(tl.int64)
    _store_grad(out_ptr, acc, e64, ps, qs, P, Q, so_e, so_p, so_q, ADD, INTERP)
    if DUAL:
        _store_grad(out2_ptr, acc2, e64, ps, qs, P, Q, so2_e, so2_p, so2_q, ADD, INTERP)


# kernels defined under TRITON_INTERPRET=1 run on the interpreter, which needs the INTERP workarounds: it
# multiplies bf16 bit patterns in tl.dot, truncates fp32 -> bf16, and (some versions) rejects tensor loop bounds
_INTERPRETED = type(_swiglu_hidden_kernel).__name__ == "InterpretedFunction"


def _require_triton() -> None:
    """Raise the user-facing error when the kernels are called without triton."""
    if triton is None:
        raise RuntimeError("piper: the Triton expert kernels need the 'triton' package, which is not importable")


def _tile_table(counts: Counts, num_experts: int, rows: int, block_m: int, device: torch.device) -> Table:
    """Device tables for the grouped row GEMMs: per program its expert, first row and end row (programs
    past the last tile get an empty range), and the grid size -- an upper bound on the tile count
    (``cdiv(rows, block_m) + E``), so that building the table needs no host sync."""
    c = _counts(counts, num_experts, device).to(torch.int64)
    ends = torch.cumsum(c, 0)
    tiles = (c + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    grid = (rows + block_m - 1) // block_m + num_experts
    tile = torch.arange(grid, device=device)
    e = torch.searchsorted(tile_end, tile, right=True).clamp_(max=num_experts - 1)
    row0 = ends[e] - c[e] + (tile - (tile_end[e] - tiles[e])) * block_m
    row1 = torch.minimum(ends[e], row0 + block_m)
    row0 = torch.minimum(row0, row1)
    return e.to(torch.int32), row0.to(torch.int32), row1.to(torch.int32), grid


def _counts(counts: Counts, num_experts: int, device: torch.device) -> torch.Tensor:
    """``counts`` as an int32 tensor on ``device``, checked against the number of experts."""
    c = torch.as_tensor(counts, device=device).reshape(-1).to(torch.int32)
    if c.numel() != num_experts:
        raise ValueError(f"piper: counts has {c.numel()} entries but the weights hold {num_experts} experts")
    return c


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 like torch's matmul (ieee unless TF32 matmuls are allowed); 16-bit
    inputs keep triton's default (the setting only affects fp32 operands)."""
    return "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


def _row_meta(prec: str, k: int) -> dict[str, Any]:
    """Compile-time arguments of the row-tile kernels (reduction length ``k``)."""
    return {"PREC": prec, "INTERP": _INTERPRETED, "LOOP_END": k if _INTERPRETED else 0,
            "BLOCK_M": BLOCKS.m, "BLOCK_N": BLOCKS.n, "BLOCK_K": BLOCKS.k}


def _check(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    """Shape and dtype checks shared by forward and backward."""
    _require_triton()
    e, d, h = w_gate.shape
    if w_up.shape != (e, d, h) or w_down.shape != (e, h, d) or x.dim() != 2 or x.shape[1] != d or e == 0:
        raise ValueError(f"piper: grouped SwiGLU shapes do not match: x {tuple(x.shape)}, w_gate "
                         f"{tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)}")
    if len({x.dtype, w_gate.dtype, w_up.dtype, w_down.dtype}) != 1:
        raise TypeError("piper: grouped SwiGLU needs x and the expert weights in one dtype, got "
                        f"{x.dtype}, {w_gate.dtype}, {w_up.dtype}, {w_down.dtype}")


def _row_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, table: Table,
              pair: tuple[torch.Tensor, torch.Tensor] | None, prec: str) -> None:
    """``out[rows] = a[rows] @ b[e]`` (``+ a2[rows] @ b2[e]`` for ``pair = (a2, b2)``) for every row tile;
    ``b``, ``b2`` are ``[E, K, N]`` views of any strides (so transposed weights need no copy)."""
    a2, b2 = pair if pair is not None else (a, b)
    grid = (table[3], triton.cdiv(out.shape[1], BLOCKS.n))
    _grouped_rows_kernel[grid](
        a, b, a2, b2, out, table[0], table[1], table[2], a.shape[1], out.shape[1],
        b.stride(0), b.stride(1), b.stride(2), b2.stride(0), b2.stride(1), b2.stride(2),
        DUAL=pair is not None, **_row_meta(prec, a.shape[1]))


def _weight_grad(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, counts: torch.Tensor,
                 pair: tuple[torch.Tensor, torch.Tensor] | None, add: bool, prec: str) -> None:
    """``out[e] (+)= a[rows_e]^T @ b[rows_e]`` for every expert (zero for experts without rows), and the
    same into ``out2`` from ``b2`` for ``pair = (b2, out2)``; ``add``: add into the old contents."""
    b2, out2 = pair if pair is not None else (b, out)
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    e, p, q = out.shape
    grid = (e, triton.cdiv(p, BLOCKS.n), triton.cdiv(q, BLOCKS.n))
    _weight_grad_kernel[grid](
        a, b, b2, out, out2, starts, counts, p, q,
        out.stride(0), out.stride(1), out.stride(2), out2.stride(0), out2.stride(1), out2.stride(2),
        DUAL=pair is not None, ADD=add, PREC=prec, INTERP=_INTERPRETED,
        LOOP_END=a.shape[0] if _INTERPRETED else 0,
        BLOCK_P=BLOCKS.n, BLOCK_Q=BLOCKS.n, BLOCK_R=BLOCKS.k)


def grouped_swiglu_triton(x: torch.Tensor, counts: Counts, w_gate: torch.Tensor, w_up: torch.Tensor,
                          w_down: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`piper_compile.nn.experts.grouped_swiglu` (same contract)."""
    _check(x, w_gate, w_up, w_down)
    x, w_gate, w_up, w_down = (t.contiguous() for t in (x, w_gate, w_up, w_down))
    n, (e, d, h) = x.shape[0], w_gate.shape
    y = x.new_zeros(n, d)  # zeros: rows past sum(counts) stay zero, as in the reference
    if n == 0:
        return y
    prec = _precision(x.dtype)
    table = _tile_table(counts, e, n, BLOCKS.m, x.device)
    hid = x.new_empty(n, h)
    _swiglu_hidden_kernel[(table[3], triton.cdiv(h, BLOCKS.n))](
        x, w_gate, w_up, hid, table[0], table[1], table[2], d, h, **_row_meta(prec, d))
    _row_gemm(hid, w_down, y, table, None, prec)
    return y


def _grad_buffers(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, accumulate: Grads | None,
                  overwrite: bool) -> tuple[Grads, bool]:
    """The weight-gradient outputs and whether the kernels add into them (else they overwrite them)."""
    if accumulate is None:
        return (torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)), False
    for g, w in zip(accumulate, (w_gate, w_up, w_down)):
        if g.shape != w.shape or g.device != w.device:
            raise ValueError(f"piper: gradient buffer {tuple(g.shape)} on {g.device} does not match its "
                             f"weight {tuple(w.shape)} on {w.device}")
    gg, gu, gd = accumulate
    return (gg, gu, gd), not overwrite


def grouped_swiglu_backward_triton(gy: torch.Tensor, x: torch.Tensor, counts: Counts, w_gate: torch.Tensor,
                                   w_up: torch.Tensor, w_down: torch.Tensor, accumulate: Grads | None = None,
                                   overwrite: bool = False,
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`piper_compile.nn.experts.grouped_swiglu_backward` (same contract)."""
    _check(x, w_gate, w_up, w_down)
    gy, x, w_gate, w_up, w_down = (t.contiguous() for t in (gy, x, w_gate, w_up, w_down))
    (gg, gu, gd), add = _grad_buffers(w_gate, w_up, w_down, accumulate, overwrite)
    n, (e, d, h) = x.shape[0], w_gate.shape
    prec, counts_t = _precision(x.dtype), _counts(counts, e, x.device)
    gx = torch.zeros_like(x)  # zeros: rows past sum(counts) stay zero, as in the reference
    if n == 0:  # no rows: every weight gradient is zero
        if not add:
            for g in (gg, gu, gd):
                g.zero_()
        return gx, gg, gu, gd
    hid, gu_pre, gg_pre = (x.new_empty(n, h) for _ in range(3))
    table = _tile_table(counts_t, e, n, BLOCKS.m, x.device)
    _swiglu_backward_hidden_kernel[(table[3], triton.cdiv(h, BLOCKS.n))](
        x, gy, w_gate, w_up, w_down, hid, gu_pre, gg_pre, table[0], table[1], table[2], d, h,
        **_row_meta(prec, d))
    # gx = gg_pre @ w_gate[e]^T + gu_pre @ w_up[e]^T: the transposes are stride swaps
    _row_gemm(gg_pre, w_gate.transpose(1, 2), gx, table, (gu_pre, w_up.transpose(1, 2)), prec)
    _weight_grad(hid, gy, gd, counts_t, None, add, prec)
    _weight_grad(x, gg_pre, gg, counts_t, (gu_pre, gu), add, prec)
    return gx, gg, gu, gd
