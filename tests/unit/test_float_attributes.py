"""The model's float attributes (RMSNorm eps, attention scaling) are compiled as constants (passes/graph.py
``specialize_floats``): Inductor then compiles every segment of a transformers Llama (before: the forward
segments fell back to eager on ``aten._local_scalar_dense``); a changed attribute is a piper: error, never a
silently stale constant; a float passed to forward stays an input. Under piper.compile of a forward that
takes no float, Dynamo itself traces the attributes as constants (``capture/dynamo.capture_settings``): a
changed one compiles the step again, with piper's one-line message."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper
from piper_compile.errors import PiperError

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.eps = 1e-5

    def forward(self, x: torch.Tensor, y: torch.Tensor, temp: float) -> torch.Tensor:
        h = self.fc(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return F.mse_loss(h / temp, y)


def _eager_losses(temps: list[float]) -> list[float]:
    torch.manual_seed(0)
    m = Scaled()
    opt = SGD(m.parameters())
    out = []
    for i, t in enumerate(temps):
        x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), torch.zeros(4, 8)
        loss = m(x, y, t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_float_attribute_is_a_constant_and_a_forward_float_stays_an_input():
    torch.manual_seed(0)
    m = Scaled()
    step = piper.compile(m, codegen="eager", optimizer=SGD)
    temps = [0.5, 2.0, 1.0]
    losses = []
    for i, t in enumerate(temps):
        x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), torch.zeros(4, 8)
        losses.append(step(x, y, t).item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_eager_losses(temps)), rtol=1e-6, atol=1e-7)
    cs = piper.compiled_steps(step)[0]
    assert [src for src, _ in cs.float_constants.values()] == ["L['self'].eps"], cs.float_constants
    m.eps = 1e-3
    with pytest.raises(PiperError, match=r"L\['self'\].eps was 1e-05 when this step was compiled and is 0.001 now"):
        step(torch.randn(4, 8), torch.zeros(4, 8), 1.0)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.eps = 1e-5

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return F.mse_loss(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps), y)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), torch.full((4, 8), 0.5)


def test_a_changed_float_attribute_compiles_the_step_again_and_trains_exactly():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Normed()
    ref = Normed()
    ref.load_state_dict(m.state_dict())
    step = piper.compile(m, codegen="eager", optimizer=SGD)
    opt = SGD(ref.parameters())
    got, want = [], []
    for i, eps in enumerate([1e-5, 1e-5, 0.5, 0.5]):
        m.eps = ref.eps = eps
        if i == 2:
            with pytest.warns(UserWarning, match=r"piper: Dynamo compiles the piper step again: a guard failed: "
                                                 r".*eps.*"):
                got.append(step(*_batch(i)).item())
        else:
            got.append(step(*_batch(i)).item())
        loss = ref(*_batch(i))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert piper.compiled_steps(step)[0].float_constants == {}  # no float reached piper's graph as an input
    assert piper.stats(step).recompiles == 1
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-7)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_llama_compiles_every_segment_with_inductor():
    from piper_compile.testing.parity import RunConfig, eager_reference, piper_worker
    from piper_compile.testing import hf  # noqa: F401 - registers "llama"

    cfg = RunConfig(model="llama", steps=2, local_batch=2, optimizer=("SGD", {"lr": 0.1}), codegen="inductor",
                    directives=[piper.split(2)])
    r = piper_worker(0, 1, cfg)
    assert r["fallbacks"] == []
    ref = eager_reference(cfg, 1)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)


def test_capture_settings_specialize_floats_only_inside_and_only_without_a_float_argument():
    import torch._dynamo.config as dynamo_config

    from piper_compile.capture.dynamo import capture_settings

    x = torch.zeros(2)
    assert dynamo_config.specialize_float is False
    with pytest.raises(ValueError), capture_settings((x, x), {}):
        assert dynamo_config.specialize_float is True
        raise ValueError  # a failed trace puts the setting back too
    assert dynamo_config.specialize_float is False
    with capture_settings((x,), {"opts": {"temp": [0.5]}}):  # a float at any depth stays an input
        assert dynamo_config.specialize_float is False
