"""Eager single-process training as the reference for tests of models defined in the test itself (the
built-in models go through ``testing/parity.py``'s ``RunConfig``)."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn


def eager_losses(model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
                 batches: Iterable[tuple[Any, ...]]) -> list[float]:
    """Train ``model`` in place, one step per batch (forward, backward, step, zero_grad); the losses."""
    opt, losses = optimizer(model.parameters()), []
    for batch in batches:
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def assert_like_eager(results: list[dict[str, Any]], losses: list[float], expected: dict[str, torch.Tensor],
                      rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every rank's ``"losses"`` are eager's, and the ranks' ``"params"`` together (``piper.trained_parameters``)
    are exactly ``expected``'s names, each close to eager's value."""
    import pytest  # a test dependency: only where a test asserts

    params: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["losses"] == pytest.approx(losses, rel=rtol, abs=atol)
        params.update(r["params"])
    assert sorted(params) == sorted(expected)
    for k, v in params.items():
        torch.testing.assert_close(v, expected[k].detach(), rtol=rtol, atol=atol)


def two_rank_plan(kind: str, model: nn.Module, rank: int, local: int) -> tuple[list[Any], slice]:
    """(directives, this rank's rows of a two-replica global batch) for ``kind``: "dp2" or "zero3"
    (replicate, two micro-batches) or "pp2" (``model.blocks`` split into two 1F1B stages, which read the
    whole batch)."""
    import piper_compile as piper

    if kind == "pp2":
        blocks = list(model.blocks)  # type: ignore[arg-type]
        for i, b in enumerate(blocks):
            piper.annotate(b, PP=i * 2 // len(blocks))
        return [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)], slice(None)
    if kind not in ("dp2", "zero3"):
        raise ValueError(f"unknown plan kind {kind!r}")
    return [piper.replicate(zero=3 if kind == "zero3" else 0), piper.split(2)], slice(rank * local, (rank + 1) * local)
