"""Which inputs are the batch (``capture/joint._batch_symbols``): the symbolic leading size most tensor
inputs share, not that of whichever input forward happens to read first. A table read before the samples
(``x + table.mean(0)``) or a broadcast ``(1, T)`` position input used to decide it: the first was cut into
micro-batches in the samples' place and refused as "5 does not divide into 2 micro-batches", the second
refused as a static batch of 1."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class TableFirst(nn.Module):
    """``table`` (K, 8) is not per-sample; forward reads it before ``x`` (B, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, table: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x + table.mean(0)))
        return F.cross_entropy(self.b(h), t)


@pytest.mark.parametrize("rows", [5, 1])
def test_an_input_read_before_the_samples_is_not_taken_for_the_batch(rows: int) -> None:
    torch.manual_seed(0)
    model = TableFirst()
    ref = copy.deepcopy(model)
    step = piper.compile(model, directives=[piper.split(2)], codegen="eager", optimizer=SGD)
    opt = SGD(ref.parameters())
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        x, table, t = torch.randn(16, 8, generator=g), torch.randn(rows, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        got = step(x, table, t)
        opt.zero_grad()
        want = ref(x, table, t)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
