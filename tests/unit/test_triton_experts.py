"""The Triton grouped SwiGLU kernels (``piper_compile.nn.triton_experts``) against the torch reference
(``piper_compile.nn.experts``), run on CPU tensors through the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined (module import), so every kernel run happens in
ONE subprocess started with ``TRITON_INTERPRET=1``; this process never sets it (checked below), so the GPU
tests that compile real Triton through Inductor are unaffected. The subprocess runs :func:`_run_all` and
prints one JSON line: the outcome ("ok" or what failed) of every (shape, dtype, mode) case, each case run
with the default tiles and with 16-wide tiles (several row tiles per expert, ragged edges in every GEMM).

Tolerances, as ``max|got - want| <= tol * max(1, max|want|)`` per tensor:
* fp32 (want: the fp32 reference): ``1e-5``. Both sides accumulate in fp32 and differ only in summation
  order over <= 40 terms (worst case ~K*eps = 40 * 1.2e-7 ~ 5e-6 of the summed magnitudes); observed <= 4e-6.
* bf16 (want: the fp32 reference on the same bf16-rounded inputs): ``2**-6`` (= 8 bf16 unit roundoffs
  u = 2**-9). The output is rounded once to bf16 (<= u) and, as in the torch bf16 reference, the hidden
  activations ``h``/``gu_pre``/``gg_pre`` are stored in bf16 (<= u each per term), which after a reduction
  over <= 40 terms with cancellation reaches a few u of the largest entry: observed <= 0.7% (torch's own
  bf16 path: <= 1.4%) over 48 random cases, so 1.6% leaves margin without hiding a real bug (those show as
  errors of O(1) or NaN). Overwrite mode must equal a fresh backward bit for bit.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from piper_compile.nn import experts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (it is in the 'test' extras: triton==3.9.0)")

SHAPES = {  # name: (E, D, H, counts); D/H 24/40 are not multiples of any tile
    "e1": (1, 16, 32, [7]),
    "e3_empty_expert": (3, 24, 40, [5, 0, 20]),
    "e4_all_rows_on_one": (4, 16, 32, [0, 0, 19, 0]),
    "e4_no_rows": (4, 24, 40, [0, 0, 0, 0]),
    "e4_ragged": (4, 24, 40, [3, 17, 0, 1]),
}
DTYPES = ("float32", "bfloat16")
MODES = ("forward", "backward", "accumulate", "overwrite")
TILES = ((64, 64, 32), (16, 16, 16))
TOL = {"float32": 1e-5, "bfloat16": 2.0 ** -6}
_MARK = "TRITON_EXPERT_CHECKS "


def _case_id(shape: str, dtype: str, mode: str) -> str:
    """The key of a case in the subprocess's results."""
    return f"{shape}-{dtype}-{mode}"


def _far(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> str | None:
    """Why ``got`` is not within ``tol`` (normwise, see the module docstring) of ``want``, or None."""
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel() == 0:
        return None
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    return None if err <= tol * scale else f"{what}: max err {err:.3g} > {tol:.3g} * {scale:.3g}"


def _inputs(shape: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]]:
    """(gy, x, counts, [w_gate, w_up, w_down]) for a case, weights scaled so that activations are O(1)."""
    e, d, h, counts = SHAPES[shape]
    g = torch.Generator().manual_seed(len(shape) * 7 + e)
    n = sum(counts)
    x, gy = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    w = [torch.randn(e, d, h, generator=g) / d ** 0.5, torch.randn(e, d, h, generator=g) / d ** 0.5,
         torch.randn(e, h, d, generator=g) / h ** 0.5]
    return gy.to(dtype), x.to(dtype), counts, [t.to(dtype) for t in w]


def _buffers(w: list[torch.Tensor], fill: float | None, mixed: bool) -> tuple[torch.Tensor, ...]:
    """Weight-gradient buffers: w_gate's non-contiguous (strided kernel stores), w_down's in fp32 when
    ``mixed`` (accumulation in the buffer's dtype); ``fill``: a constant (NaN: stale contents), else random."""
    g = torch.Generator().manual_seed(3)
    gg = torch.empty(w[0].shape[0], w[0].shape[2], w[0].shape[1], dtype=w[0].dtype).transpose(1, 2)
    out = [gg, torch.empty_like(w[1]), torch.empty_like(w[2], dtype=torch.float32 if mixed else None)]
    for b in out:
        b.copy_(torch.randn(b.shape, generator=g) if fill is None else torch.full(b.shape, fill))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _fresh_backward(shape: str, dtype_name: str, tiles: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The kernels' backward of a case into fresh buffers under ``tiles`` (the current ``BLOCKS``), run once
    for the backward and the overwrite modes."""
    from piper_compile.nn import triton_experts as tx
    gy, x, counts, w = _inputs(shape, getattr(torch, dtype_name))
    return tuple(tx.grouped_swiglu_backward_triton(gy, x, counts, *w))


def _check_case(shape: str, dtype_name: str, mode: str) -> str | None:
    """Run one case on the Triton kernels (interpreted) and compare with the reference; None when it passes."""
    from piper_compile.nn import triton_experts as tx
    dtype, tol = getattr(torch, dtype_name), TOL[dtype_name]
    gy, x, counts, w = _inputs(shape, dtype)
    f32 = [t.float() for t in w]
    if mode == "forward":
        return _far(tx.grouped_swiglu_triton(x, torch.tensor(counts), *w),
                    experts.grouped_swiglu(x.float(), counts, *f32), tol, "y")
    want = experts.grouped_swiglu_backward(gy.float(), x.float(), counts, *f32)
    fresh = _fresh_backward(shape, dtype_name, (tx.BLOCKS.m, tx.BLOCKS.n, tx.BLOCKS.k)) if mode != "accumulate" else ()
    if mode == "backward":
        return next((m for m in map(_far, fresh, want, [tol] * 4, ["gx", "gg", "gu", "gd"]) if m), None)
    if mode == "overwrite":
        stale = _buffers(w, float("nan"), mixed=False)
        got = tx.grouped_swiglu_backward_triton(gy, x, counts, *w, accumulate=stale, overwrite=True)
        same = all(torch.equal(a, b) for a, b in zip(got, fresh)) and all(a is b for a, b in zip(got[1:], stale))
        return None if same else "overwrite: differs from a fresh backward (or not written in place)"
    old = _buffers(w, None, mixed=True)
    base = [b.float().clone() for b in old]
    got = tx.grouped_swiglu_backward_triton(gy, x, counts, *w, accumulate=old, overwrite=False)
    if not all(a is b for a, b in zip(got[1:], old)):
        return "accumulate: the buffers were not returned"
    targets = [want[0]] + [b + g for b, g in zip(base, want[1:])]
    return next((m for m in map(_far, got, targets, [tol] * 4, ["gx", "gg", "gu", "gd"]) if m), None)


def _run_all() -> None:
    """Subprocess entry (TRITON_INTERPRET=1): every case with both tile configurations; prints JSON."""
    from piper_compile.nn import triton_experts as tx
    results: dict[str, str] = {"interpreted": str(tx._INTERPRETED)}
    for shape in SHAPES:
        for dtype in DTYPES:
            for mode in MODES:
                problems = []
                for tiles in TILES:
                    tx.BLOCKS = tx.Blocks(*tiles)
                    try:
                        msg = _check_case(shape, dtype, mode)
                    except Exception as exc:  # noqa: BLE001 -- reported to the parent test
                        msg = f"{type(exc).__name__}: {exc}"
                    if msg:
                        problems.append(f"tiles {tiles}: {msg}")
                results[_case_id(shape, dtype, mode)] = "; ".join(problems) or "ok"
    print(_MARK + json.dumps(results), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Outcomes of all cases, from one interpreted subprocess (the env var is set only in its environment)."""
    before = os.environ.get("TRITON_INTERPRET")
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('triton_expert_checks', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); m._run_all()")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve())], env=env,
                          capture_output=True, text=True, timeout=600)
    assert os.environ.get("TRITON_INTERPRET") == before
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    assert proc.returncode == 0 and lines, f"interpreted run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len(_MARK):])


@pytest.mark.slow  # one interpreter subprocess for every case, ~30-45 s: out of the fast subset
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernels_match_reference(interpreted: dict[str, str], shape: str, dtype: str, mode: str) -> None:
    assert interpreted[_case_id(shape, dtype, mode)] == "ok"


@pytest.mark.slow
def test_interpreter_confined_to_the_subprocess(interpreted: dict[str, str]) -> None:
    assert interpreted["interpreted"] == "True"  # the checks really ran on the interpreter
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # ... and this process still compiles real Triton
        from piper_compile.nn import triton_experts as tx
        assert tx._INTERPRETED is False


def test_triton_available_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from piper_compile.nn.triton_experts import triton_available
    monkeypatch.delenv("PIPER_TRITON_EXPERTS", raising=False)
    assert not triton_available(torch.device("cpu"))
    assert triton_available("cuda")  # device type only: nothing is launched
    monkeypatch.setenv("PIPER_TRITON_EXPERTS", "0")
    assert not triton_available("cuda")


def test_cpu_tensors_stay_on_the_torch_reference() -> None:
    assert not experts.use_triton(torch.zeros(2, 4))


def test_bad_shapes_raise_piper_errors() -> None:
    from piper_compile.nn.triton_experts import grouped_swiglu_backward_triton, grouped_swiglu_triton
    w = [torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), torch.zeros(2, 16, 8)]
    with pytest.raises(ValueError, match="^piper: grouped SwiGLU shapes"):
        grouped_swiglu_triton(torch.zeros(3, 9), [1, 2], *w)
    with pytest.raises(ValueError, match="^piper: counts has 3 entries"):
        grouped_swiglu_triton(torch.zeros(3, 8), [1, 1, 1], *w)
    with pytest.raises(TypeError, match="^piper: grouped SwiGLU needs"):
        grouped_swiglu_triton(torch.zeros(3, 8, dtype=torch.bfloat16), [1, 2], *w)
    with pytest.raises(ValueError, match="^piper: gradient buffer"):
        grouped_swiglu_backward_triton(torch.zeros(3, 8), torch.zeros(3, 8), [1, 2], *w,
                                       accumulate=(torch.zeros(1), w[1].clone(), w[2].clone()))
