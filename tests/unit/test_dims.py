"""Dimension expressions as the shape environment prints them, read back and made concrete: every function
torch's symbolic shapes print (CUDA's efficient attention rounds its log-sum-exp length up with
``CeilToInt(IntTrueDiv(...))``), and a clear error for a symbol without a value."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import piper_compile as piper
from piper_compile.ir.dims import parse_dim
from piper_compile.sim.shapes import concrete


def _sym(value: int) -> torch.SymInt:
    env = ShapeEnv()
    return env.create_symintnode(env.create_symbol(value, ConstantSource("x")), hint=value)


@pytest.mark.parametrize("make", [
    lambda s: math.ceil(s / 32) * 32,
    lambda s: s // 32,
    lambda s: s % 7,
    lambda s: (s + 31) // 32 * 32,
    lambda s: torch.sym_max(s, 5),
    lambda s: -(-s // 32),
    lambda s: s * s - 3,
], ids=["ceil_div", "floordiv", "mod", "round_up", "max", "neg_floordiv", "poly"])
@pytest.mark.parametrize("value", [2, 31, 100])
def test_printed_dimension_reads_back_to_its_value(make, value: int):
    s = _sym(value)
    text = str(make(s))
    name = str(s.node.expr)
    assert concrete(text, {name: value}) == make(value), text
    assert {x.name for x in parse_dim(text).free_symbols} == {name}


def test_dimension_with_an_unknown_symbol_is_a_clear_error():
    with pytest.raises(ValueError, match=r"piper: dimension 32\*CeilToInt\(IntTrueDiv\(s9, 32\)\).*s9 unknown"):
        concrete("32*CeilToInt(IntTrueDiv(s9, 32))", {"s0": 4})


class _PadToMultiple(torch.nn.Module):
    """Pads the sequence up to a multiple of 32 (as CUDA's efficient attention sizes its log-sum-exp)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        padded = h.new_zeros(h.shape[0], math.ceil(h.shape[1] / 32) * 32, h.shape[2])
        padded[:, : h.shape[1]] = h
        return torch.nn.functional.mse_loss(padded[:, : h.shape[1]].tanh(), y)


def test_memory_report_of_a_graph_with_rounded_up_dimensions():
    """The memory plan makes such shapes concrete (it raised 'Cannot convert symbols to int' on CUDA)."""
    torch.manual_seed(0)
    model = _PadToMultiple()
    step = piper.compile(model, directives=[piper.split(2)], optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    x, y = torch.randn(4, 40, 8), torch.randn(4, 40, 8)
    step(x, y)
    report = piper.memory_report(step)
    # the padded buffer of one micro-batch: 2 x 64 x 8 fp32 values are among the activations
    assert report.predicted.peak_activations >= 2 * 64 * 8 * 4
