"""GradBuffers: buffers are not cleared between steps; the first write of a step overwrites, reads settle."""
from __future__ import annotations

import torch
from torch import nn

from piper_compile.nn.experts import grouped_swiglu_backward
from piper_compile.runtime.grads import GradBuffers


def _params() -> dict[str, nn.Parameter]:
    return {"a": nn.Parameter(torch.zeros(2, 3)), "b": nn.Parameter(torch.zeros(4)),
            "c": nn.Parameter(torch.zeros(5)), "d": nn.Parameter(torch.zeros(3))}


def _buffers() -> GradBuffers:
    # bucket b0 (a, b) all-reduced; bucket z (d) reduce-scattered (lazy, padded to 4); c on its own
    return GradBuffers(_params(), {"b0": (["a", "b"], 10, False), "z": (["d"], 4, True)}, ["c"])


def _stale(g: GradBuffers) -> None:
    """A step that writes garbage everywhere, then a new step begins."""
    g.zero_()
    for f in ("a", "b", "c", "d"):
        g.accumulate(f, torch.full_like(g.params[f], float("nan")))
    g.zero_()


def test_first_write_overwrites_then_adds() -> None:
    g = _buffers()
    _stale(g)
    g.accumulate("a", torch.ones(2, 3))
    g.accumulate("a", torch.ones(2, 3))
    assert torch.equal(g.view("a"), torch.full((2, 3), 2.0))


def test_reads_zero_what_nothing_wrote() -> None:
    g = _buffers()
    _stale(g)
    g.accumulate("a", torch.ones(2, 3))
    flat = g.bucket("b0")  # b got no gradient this step: zeros, not last step's values
    assert torch.equal(flat, torch.cat([torch.ones(6), torch.zeros(4)]))
    assert torch.equal(g.view("c"), torch.zeros(5))
    g.accumulate("c", torch.ones(5))  # written after a read: adds to the zeros the read left
    assert torch.equal(g.view("c"), torch.ones(5))


def test_lazy_bucket_padding_is_zero() -> None:
    g = _buffers()
    _stale(g)
    g.accumulate("d", torch.ones(3))
    assert torch.equal(g.bucket("z"), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    g.release("z")
    assert torch.equal(g.bucket("z"), torch.zeros(4))  # reallocated: nothing written since


def test_claim_overwrites_only_fresh() -> None:
    g = _buffers()
    _stale(g)
    (ta, tb), overwrite = g.claim(["a", "b"])
    assert overwrite and ta.data_ptr() == g.views["a"].data_ptr()
    ta.fill_(1.0)
    tb.fill_(1.0)
    (ta, tb), overwrite = g.claim(["a", "b"])
    assert not overwrite
    g.accumulate("c", torch.ones(5))
    g.zero_()
    g.accumulate("a", torch.ones(2, 3))
    (ta, tb), overwrite = g.claim(["a", "b"])  # a written already: add into a, b zeroed first
    assert not overwrite and torch.equal(tb, torch.zeros(4)) and torch.equal(ta, torch.ones(2, 3))


def test_grouped_backward_overwrite_matches_accumulate_into_zeros() -> None:
    torch.manual_seed(0)
    e, d, h = 4, 8, 16
    w = [torch.randn(e, d, h), torch.randn(e, d, h), torch.randn(e, h, d)]
    counts = [3, 0, 5, 2]  # expert 1 gets no rows
    x, gy = torch.randn(10, d), torch.randn(10, d)
    zeros = tuple(torch.zeros_like(t) for t in w)
    want = grouped_swiglu_backward(gy, x, counts, *w, accumulate=zeros)
    stale = tuple(torch.full_like(t, float("nan")) for t in w)
    got = grouped_swiglu_backward(gy, x, counts, *w, accumulate=stale, overwrite=True)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
