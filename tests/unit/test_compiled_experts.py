"""The local experts compiled by Inductor (``codegen/experts.py``) against the reference
(``nn/experts.py``): forward, backward with fresh gradients, written over stale buffers and added into
them; experts without rows; row counts that change between calls without recompiling per count."""
from __future__ import annotations

import pytest
import torch

from piper_compile.codegen import experts as compiled
from piper_compile.nn import experts as reference

E, D, H = 4, 8, 16


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, D, H, generator=g) / 4, torch.randn(E, D, H, generator=g) / 4,
            torch.randn(E, H, D, generator=g) / 4)


def _rows(counts: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


@pytest.mark.slow  # 6-26 s: keeps the fast subset under 5 min
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [1, 7, 0, 0], [4, 4, 4, 4]])
def test_compiled_experts_match_the_reference(counts: list[int]) -> None:
    w = _weights()
    x, gy = _rows(counts)
    torch.testing.assert_close(compiled.grouped_forward(x, counts, *w, "inductor"),
                               reference.grouped_swiglu(x, counts, *w), rtol=1e-5, atol=1e-6)
    want = reference.grouped_swiglu_backward(gy, x, counts, *w)
    got = compiled.grouped_backward(gy, x, counts, *w, None, False, "inductor")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    stale = tuple(torch.full_like(t, float("nan")) for t in w)  # written over: no NaN survives
    gx, *grads = compiled.grouped_backward(gy, x, counts, *w, stale, True, "inductor")
    for a, b in zip(grads, want[1:]):
        assert a.data_ptr() in {t.data_ptr() for t in stale}  # the buffers themselves
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    compiled.grouped_backward(gy, x, counts, *w, stale, False, "inductor")  # added into them
    for a, b in zip(stale, want[1:]):
        torch.testing.assert_close(a, 2 * b, rtol=1e-5, atol=1e-5)
    assert compiled.COMPILED.failed is None


def test_every_row_count_runs_one_compilation() -> None:
    """The per-expert code is compiled once per hidden sizes and dtype, for a symbolic row count: counts of
    1, of 2 and more, rows at offset 0 or not, all run it (no recompilation as routing changes)."""
    w = _weights(3)
    compiled.grouped_forward(*_rows([2, 3, 4, 5])[:1], [2, 3, 4, 5], *w, "inductor")
    kernels = dict(compiled.COMPILED.kernels)
    for counts in ([1, 2, 9, 3], [11, 1, 1, 7], [0, 3, 0, 1], [64, 1, 2, 130]):
        x, gy = _rows(counts)
        torch.testing.assert_close(compiled.grouped_forward(x, counts, *w, "inductor"),
                                   reference.grouped_swiglu(x, counts, *w), rtol=1e-5, atol=1e-6)
        for a, b in zip(compiled.grouped_backward(gy, x, counts, *w, None, False, "inductor"),
                        reference.grouped_swiglu_backward(gy, x, counts, *w)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert compiled.COMPILED.kernels == kernels  # nothing compiled again


def test_eager_codegen_computes_with_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled.COMPILED, "get", lambda *a: pytest.fail("compiled under codegen='eager'"))
    w = _weights()
    x, gy = _rows([2, 2, 2, 2])
    compiled.grouped_forward(x, [2, 2, 2, 2], *w, "eager")
    compiled.grouped_backward(gy, x, [2, 2, 2, 2], *w, None, False, "eager")


def test_an_inductor_failure_warns_once_and_computes_with_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = compiled._Compiled()
    calls = []

    def boom(*args: object) -> None:
        calls.append(args)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(broken, "_build", boom)
    monkeypatch.setattr(compiled, "COMPILED", broken)
    w = _weights()
    x, _ = _rows([1, 2, 3, 4])
    with pytest.warns(UserWarning, match="could not compile the local experts"):
        y = compiled.grouped_forward(x, [1, 2, 3, 4], *w, "inductor")
    torch.testing.assert_close(y, reference.grouped_swiglu(x, [1, 2, 3, 4], *w))
    assert broken.failed == "RuntimeError: no compiler"
    compiled.grouped_forward(x, [1, 2, 3, 4], *w, "inductor")  # no second warning, no second try
    assert len(calls) == 1


def test_low_precision_gradients_are_written_into_fp32_buffers_as_the_runtime_would_add_them() -> None:
    """Mixed precision: bf16 rows and weights, fp32 gradient buffers. The compiled backward writes the
    bf16 weight gradients into them: bitwise what returning them and ``GradBuffers.accumulate`` (copy on
    the first write, add after) gives."""
    counts = [3, 0, 6, 5]
    w = tuple(t.to(torch.bfloat16) for t in _weights(5))
    x, gy = (t.to(torch.bfloat16) for t in _rows(counts, 6))
    assert compiled.compiles(x, "inductor")
    _, *want = compiled.grouped_backward(gy, x, counts, *w, None, False, "inductor")  # bf16 gradients
    bufs = tuple(torch.full(t.shape, float("nan"), dtype=torch.float32) for t in w)
    compiled.grouped_backward(gy, x, counts, *w, bufs, True, "inductor")
    for buf, g in zip(bufs, want):
        assert buf.dtype == torch.float32
        torch.testing.assert_close(buf, g.float(), rtol=0, atol=0)
    compiled.grouped_backward(gy, x, counts, *w, bufs, False, "inductor")
    for buf, g in zip(bufs, want):
        ref = g.float()
        torch.testing.assert_close(buf, ref + g.float(), rtol=0, atol=0)


def test_the_reference_path_adds_low_precision_gradients_into_fp32_buffers_too() -> None:
    """codegen='eager' (and the Triton kernels) cannot write bf16 gradients into fp32 buffers themselves:
    ``grouped_backward`` copies, then adds, what the reference returns."""
    counts = [2, 5, 0, 3]
    w = tuple(t.to(torch.bfloat16) for t in _weights(7))
    x, gy = (t.to(torch.bfloat16) for t in _rows(counts, 8))
    gx, *want = reference.grouped_swiglu_backward(gy, x, counts, *w)
    bufs = tuple(torch.full(t.shape, float("nan"), dtype=torch.float32) for t in w)
    got_x, *got = compiled.grouped_backward(gy, x, counts, *w, bufs, True, "eager")
    torch.testing.assert_close(got_x, gx, rtol=0, atol=0)
    assert all(a is b for a, b in zip(got, bufs))
    compiled.grouped_backward(gy, x, counts, *w, bufs, False, "eager")
    for buf, g in zip(bufs, want):
        torch.testing.assert_close(buf, g.float() + g.float(), rtol=0, atol=0)
