"""Custom ``torch.autograd.Function``s in the model (a hand-written SiLU that saves its input, a
straight-through rounding, a gradient reversal with a Python float): AOTAutograd leaves the ops of their
``backward`` without a forward/backward tag, and piper's cut read an untagged op as forward, so a plain
data-parallel step raised a region-cycle error naming regions the user never tagged
(``capture/regions._passes``). Each strategy trains as eager does."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper
from piper_compile.testing.eager import assert_like_eager, eager_losses, two_rank_plan
from piper_compile.testing.launch import run_local

ADAMW = functools.partial(torch.optim.AdamW, lr=0.01)
LOCAL, STEPS = 8, 3


class HandSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class RoundThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return -ctx.scale * g, None


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.fc, self.index = nn.Linear(16, 16), index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = HandSiLU.apply(h) if self.index % 2 == 0 else RoundThrough.apply(h)
        if self.index == 2:
            h = Reverse.apply(h, 0.5)
        return x + h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x), y)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2 * LOCAL, 16, generator=g), torch.randint(0, 4, (2 * LOCAL,), generator=g)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _worker(rank: int, world: int, kind: str) -> dict[str, Any]:
    model = _model()
    directives, rows = two_rank_plan(kind, model, rank, LOCAL)
    step = piper.compile(model, directives=directives, optimizer=ADAMW)
    losses = [float(step(*(t[rows] for t in _batch(s)))) for s in range(STEPS)]
    return {"losses": losses, "params": piper.trained_parameters(step)}


@pytest.mark.parametrize("kind", ["dp2", "zero3", pytest.param("pp2", marks=pytest.mark.slow)])  # 11 s cold
def test_custom_autograd_functions_train_as_eager(kind: str) -> None:
    ref = _model()
    losses = eager_losses(ref, ADAMW, [_batch(s) for s in range(STEPS)])
    assert_like_eager(run_local(_worker, 2, kind), losses, dict(ref.named_parameters()))
