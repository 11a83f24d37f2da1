"""Ops relating samples of the batch to each other (``capture/coupling.py``): a contrastive loss with
in-batch negatives is refused where the plan cuts the batch, runs exactly where it does not, and runs
per piece when the user accepts that meaning (``options["local_batch_ops"]``)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper

SGD = functools.partial(torch.optim.SGD, lr=0.5)


class Contrastive(nn.Module):
    """CLIP-style: two encoders, a similarity matrix over the batch, each sample's pair as its class."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        za, zb = F.normalize(self.a(x), dim=-1), F.normalize(self.b(y), dim=-1)
        logits = za @ zb.t() * 10
        return F.cross_entropy(logits, torch.arange(x.shape[0]))


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)


def test_cutting_in_batch_negatives_into_micro_batches_is_refused() -> None:
    """Before: split(2) returned 1.447 where eager's loss is 2.239, with no message."""
    torch.manual_seed(0)
    step = piper.compile(Contrastive(), directives=[piper.split(2)], codegen="eager", optimizer=SGD)
    with pytest.raises(piper.PiperError, match=r"relates samples of the batch to each other at matmul.*"
                                               r"`logits = za @ zb.t\(\) \* 10`.*into 2 micro-batches.*local_batch_ops"):
        step(*_batch())


def test_data_parallel_plans_are_refused_too() -> None:
    torch.manual_seed(0)
    with pytest.raises(piper.PiperError, match="into 2 data-parallel replicas"):
        piper.plan(Contrastive(), *_batch(), directives=[piper.replicate()], world_size=2)


def _eager(model: nn.Module, pieces: int, steps: int = 2) -> list[float]:
    opt = SGD(model.parameters())
    losses = []
    for s in range(steps):
        opt.zero_grad()
        parts = [model(*(t.chunk(pieces)[k] for t in _batch(s))) for k in range(pieces)]
        loss = sum(parts) / pieces
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("split", [1, 2])
def test_whole_batch_exact_and_local_meaning_on_request(split: int) -> None:
    """One micro-batch: exactly eager's step (nothing cut). split(2) with local_batch_ops: each half's
    own contrastive loss, averaged -- what DDP computes."""
    torch.manual_seed(0)
    model = Contrastive()
    ref = copy.deepcopy(model)
    directives = [piper.split(split)]
    step = piper.compile(model, directives=directives, codegen="eager", optimizer=SGD, local_batch_ops=split > 1)
    got = [step(*_batch(s)).item() for s in range(2)]
    assert got == pytest.approx(_eager(ref, split), rel=1e-6)
