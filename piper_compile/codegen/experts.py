"""The local experts of an expert-parallel chain, compiled: what ``ExpertStep("experts")`` computes on the
rows a rank received (``runtime/expert.py`` moves the rows; this module computes on them).

Rows come grouped by local expert (``counts[e]`` rows for expert ``e``), and the counts change every
step, so the grouped computation cannot be one static graph. How each codegen computes it:

- CUDA with Triton: piper's grouped Triton kernels (``nn/triton_experts.py``), one launch for every expert.
- ``codegen="inductor"`` elsewhere: per expert, Inductor's code for that expert's rows, traced once with
  a symbolic row count (``make_fx`` on fake inputs of a ``ShapeEnv``), so no routing recompiles it
  (``torch.compile(dynamic=True)`` recompiled on 0/1 row counts and on view offsets). The SwiGLU's ``silu * up`` and the backward's
  elementwise chain run as fused kernels, and the backward writes the weight gradients into their buffers
  itself (overwriting on the step's first write, else adding), as compiled segments do
  (``codegen/accumulate.py``).
- ``codegen="eager"``: the reference, ``nn/experts.py``.

Where Inductor fails, a warning says so once per process and the reference computes instead (as a
segment Inductor cannot compile runs eagerly).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from piper_compile.nn import experts as reference

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def expert_forward(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU on its rows."""
    return (F.silu(x @ wg) * (x @ wu)) @ wd


def expert_backward(gy: torch.Tensor, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor,
                    gg: torch.Tensor, gu: torch.Tensor, gd: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """One expert's input gradient; its weight gradients are written into ``gg``/``gu``/``gd``, added to
    their contents where the 0-d ``add`` is true (``where``, as ``codegen/accumulate.py``: stale contents
    never leak into a first write). The hidden values are recomputed, as in the reference."""
    g_pre, u = x @ wg, x @ wu
    s = torch.sigmoid(g_pre)
    act = g_pre * s
    gh = gy @ wd.t()
    gu_pre = gh * act
    gg_pre = gh * u * (s * (1 + g_pre * (1 - s)))
    for buf, g in ((gd, (act * u).t() @ gy), (gu, x.t() @ gu_pre), (gg, x.t() @ gg_pre)):
        buf.copy_(torch.where(add, buf + g, g))
    return gg_pre @ wg.t() + gu_pre @ wu.t()


ROWS_HINT = 64  # the row count the functions are traced with; the code is compiled for any count


def symbolic_rows(example: list[torch.Tensor], dynamic: list[bool]) -> list[Any]:
    """Fake tensors like ``example`` whose first dimension is one size symbol where ``dynamic`` says so
    (every such input has ``ROWS_HINT`` rows: one symbol), other dimensions static."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    out = []
    for t, dyn in zip(example, dynamic):
        dims = [DimDynamic.DYNAMIC if dyn and i == 0 else DimDynamic.STATIC for i in range(t.dim())]
        ctx = StatelessSymbolicContext(dynamic_sizes=dims, constraint_sizes=[None] * t.dim())  # type: ignore[arg-type]
        out.append(mode.from_tensor(t, symbolic_context=ctx))
    return out


def _compile(fn: Callable[..., Any], example: list[torch.Tensor], dynamic: list[bool]) -> Callable[..., Any]:
    """Inductor's code for ``fn`` traced on ``example`` with a symbolic row count (through piper's segment
    cache, ``codegen/cache.py``): a boxed function of a list of inputs."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from piper_compile.codegen import cache, warmup
    from piper_compile.knobs import knob

    fakes = symbolic_rows(example, dynamic)
    warmup.wait()
    with torch.no_grad():
        gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*fakes)
        gm.graph.output_node().args = ((gm.graph.output_node().args[0],),)  # Inductor compiles tuple outputs
        gm.recompile()
        return cache.compile_once(gm, fakes, use_cache=bool(knob("PIPER_INDUCTOR_CACHE")))[0]


class _Compiled:
    """The per-expert functions compiled by Inductor, per (hidden sizes, dtype, device); none once
    Inductor failed in this process."""

    def __init__(self) -> None:
        self.kernels: dict[tuple[Any, ...], tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self.failed: str | None = None

    def get(self, x: torch.Tensor, wg: torch.Tensor, wd: torch.Tensor, grad_dtype: torch.dtype | None = None
            ) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
        """(forward, backward) for rows like ``x``, weights like ``wg``/``wd`` and gradient buffers of
        ``grad_dtype`` (default: the weights'; mixed precision writes bf16 gradients into fp32 buffers)."""
        if self.failed is not None:
            return None
        grad_dtype = grad_dtype or wg.dtype
        key = (tuple(wg.shape[1:]), tuple(wd.shape[1:]), x.dtype, wg.dtype, grad_dtype, str(x.device))
        if key not in self.kernels:
            self.kernels[key] = self._build(x, wg, wd, grad_dtype)
        return self.kernels[key]

    @staticmethod
    def _build(x: torch.Tensor, wg: torch.Tensor, wd: torch.Tensor, grad_dtype: torch.dtype
               ) -> tuple[Callable[..., Any], Callable[..., Any]]:
        def w(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
            return like.new_empty(like.shape[1:], dtype=dtype)  # every input its own tensor (one placeholder each)

        rows, out = x.new_empty(ROWS_HINT, x.shape[1]), x.new_empty(ROWS_HINT, wd.shape[-1])
        flag = torch.zeros((), dtype=torch.bool, device=x.device)
        forward = _compile(expert_forward, [rows, w(wg), w(wg), w(wd)], [True, False, False, False])
        grads = [w(wg, grad_dtype), w(wg, grad_dtype), w(wd, grad_dtype)]
        backward = _compile(expert_backward, [out, rows, w(wg), w(wg), w(wd), *grads, flag], [True, True] + [False] * 7)
        return forward, backward

    def fail(self, e: Exception) -> None:
        self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        warnings.warn(f"piper: Inductor could not compile the local experts ({self.failed}); computing them "
                      "eagerly (numerics unchanged; set codegen='eager' to silence)", stacklevel=3)


COMPILED = _Compiled()


def compiles(x: torch.Tensor, codegen: str) -> bool:
    """Whether experts on rows like ``x`` run Inductor's code (which also writes low-precision weight
    gradients into fp32 buffers; the reference and the Triton kernels take buffers of the weights' dtype)."""
    return codegen == "inductor" and not reference.use_triton(x) and COMPILED.failed is None


def _compiled(x: torch.Tensor, wg: torch.Tensor, wd: torch.Tensor, codegen: str,
              grad_dtype: torch.dtype | None = None) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The per-expert functions to use for rows ``x``, or None for the reference / Triton path."""
    if not compiles(x, codegen):
        return None
    try:
        return COMPILED.get(x, wg, wd, grad_dtype)
    except Exception as e:  # noqa: BLE001 - an Inductor failure must not stop training
        COMPILED.fail(e)
        return None


def grouped_forward(x: torch.Tensor, counts: list[int], wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor,
                    codegen: str) -> torch.Tensor:
    """Every expert's outputs for ``x`` (rows sorted by expert, ``counts`` rows each)."""
    fns = _compiled(x, wg, wd, codegen)
    if fns is None:
        return reference.grouped_swiglu(x, counts, wg, wu, wd)
    y = x.new_empty(x.shape[0], wd.shape[-1])
    for e, a, b in reference.blocks(counts):
        y[a:b] = fns[0]([x[a:b], wg[e], wu[e], wd[e]])[0]
    return y


def grouped_backward(gy: torch.Tensor, x: torch.Tensor, counts: list[int], wg: torch.Tensor, wu: torch.Tensor,
                     wd: torch.Tensor, acc: Grads | None, overwrite: bool, codegen: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input gradient, weight gradients) of :func:`grouped_forward`; with ``acc`` (the gradient buffers)
    the weight gradients are written into them (over their contents when ``overwrite``) and returned.
    Buffers of another dtype than the weights' (mixed precision: fp32) are written by Inductor's code;
    the reference and the Triton kernels return the gradients, which are then copied or added in, as
    ``GradBuffers.accumulate`` would."""
    fns = _compiled(x, wg, wd, codegen, acc[0].dtype if acc is not None else None)
    if fns is None and acc is not None and acc[0].dtype != wg.dtype:
        gx, *grads = reference.grouped_swiglu_backward(gy, x, counts, wg, wu, wd)
        for buf, g in zip(acc, grads):
            buf.copy_(g) if overwrite else buf.add_(g)
        return gx, *acc
    if fns is None:
        return reference.grouped_swiglu_backward(gy, x, counts, wg, wu, wd, acc, overwrite)
    if acc is None:  # fresh gradients: an expert without rows keeps zeros
        grads, add = (torch.zeros_like(wg), torch.zeros_like(wu), torch.zeros_like(wd)), True
    else:
        grads, add = acc, not overwrite
    spans = reference.blocks(counts)
    if not add:
        reference.zero_unused(grads, spans)
    flag = torch.full((), add, dtype=torch.bool, device=x.device)
    gx = torch.empty_like(x)  # the experts' rows cover every row
    for e, a, b in spans:
        gx[a:b] = fns[1]([gy[a:b], x[a:b], wg[e], wu[e], wd[e], grads[0][e], grads[1][e], grads[2][e], flag])[0]
    return gx, *grads
