"""The optimizer step's temporaries (``runtime/optimizer_memory.py``): what a dispatch mode measures on a
real step against what the fitted model predicts, for torch's implementations of several optimizers."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from piper_compile.runtime.optimizer_memory import Allocations, implementation, step_transient

CASES = [
    ("AdamW", {"foreach": True}), ("AdamW", {"foreach": False}), ("AdamW", {"fused": True}),
    ("Adam", {"weight_decay": 0.1, "foreach": False}), ("Adam", {"amsgrad": True, "foreach": True}),
    ("SGD", {"momentum": 0.9, "foreach": False}), ("SGD", {"momentum": 0.9, "foreach": True}),
    ("RMSprop", {"foreach": True}), ("Adagrad", {"foreach": False}), ("RMSprop", {"foreach": False}),
]


def _measured(factory: functools.partial, sizes: list[int]) -> int:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    opt = factory(params)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 0:
            opt.step()
    with Allocations() as seen:
        opt.step()
    return seen.peak


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{sorted(k.items())}" for n, k in CASES])
def test_the_prediction_bounds_the_measured_temporaries(name: str, kw: dict) -> None:
    """foreach and fused: exact (the temporaries are all tensors at once, or none); the per-tensor loop:
    an order-free upper bound (the two largest tensors as if updated one after the other), at most 1.5x."""
    factory = functools.partial(getattr(torch.optim, name), lr=1e-3, **kw)
    for sizes in ([300_000, 1_000_000, 50_000, 2_000_000], [2_000_000, 1_500_000, 10], [777_777]):
        measured = _measured(factory, sizes)
        predicted = step_transient(factory, [4 * n for n in sizes])
        if kw.get("foreach") or kw.get("fused"):
            assert predicted == pytest.approx(measured, rel=1e-3, abs=64), (sizes, measured, predicted)
        else:
            assert measured - 64 <= predicted <= 1.5 * measured + 64, (sizes, measured, predicted)


def test_a_built_optimizer_predicts_like_its_factory() -> None:
    params = [nn.Parameter(torch.randn(1000)), nn.Parameter(torch.randn(3000))]
    opt = torch.optim.Adam(params, lr=0.01, weight_decay=0.1, foreach=False)
    factory = functools.partial(torch.optim.Adam, lr=0.01, weight_decay=0.1, foreach=False)
    assert step_transient(opt, [4000, 12000]) == step_transient(factory, [4000, 12000]) > 0
    assert step_transient(None, [4000]) == 0 and step_transient(factory, []) == 0


def test_the_implementation_is_the_one_the_run_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """piper builds fused AdamW where known correct; torch's default elsewhere: the loop on CPU, foreach on
    CUDA; a factory's own choice wins."""
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    assert implementation(adamw, "cpu", torch.float32) == {"fused": True, "foreach": False}
    assert implementation(adamw, "cpu", torch.bfloat16) == {"fused": False, "foreach": False}
    assert implementation(functools.partial(torch.optim.AdamW, foreach=True), "cpu", torch.float32)["foreach"]
    assert implementation(functools.partial(torch.optim.AdamW, fused=False), "cpu", torch.float32) == \
        {"fused": False, "foreach": False}  # chosen by the factory: built as given, torch's default
    assert implementation(functools.partial(torch.optim.AdamW, foreach=None), "cuda", torch.float32)["foreach"]
    assert implementation(torch.optim.Adagrad, "cuda", torch.float32) == {"fused": False, "foreach": True}
    monkeypatch.setenv("PIPER_FUSED_OPTIMIZER", "0")
    assert implementation(adamw, "cpu", torch.float32) == {"fused": False, "foreach": False}


def test_allocations_count_new_tensors_until_they_die() -> None:
    x = torch.zeros(1000)
    with Allocations() as seen:
        x.add_(1)  # in place: nothing new
        y = x * 2  # 4000 bytes
        z = y + 1  # 8000 at once
        del y
        w = z.sqrt()  # 8000 again
    assert (seen.peak, seen.live) == (8000, 8000)
    del z, w
    assert seen.live == 0
