"""Consistency fuzz: random per-rank call sequences -- training calls, no_grad calls, batch sizes (uneven,
indivisible, empty) and argument counts -- on 2-4 gloo ranks. Every call either matches single-process
training on the concatenated batch, or raises a piper error on every rank, at the same call, within the
timeout; nothing after it runs. ``PIPER_FUZZ_EXAMPLES=N`` runs a longer soak and prints the outcome counts."""
from __future__ import annotations

import collections
import functools
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.knobs import knob

pytestmark = pytest.mark.slow

TIMEOUT = 8.0
EXAMPLES = knob("PIPER_FUZZ_EXAMPLES")
OUTCOMES: collections.Counter[str] = collections.Counter()
Call = tuple[str, int, int]  # (train | eval, local batch, argument count 2 | 3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x)))
        if w is not None:
            out = out * w
        return F.mse_loss(out, y)


def _data(call: int, rank: int, n: int, nargs: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(100 * call + rank)
    x, y = torch.randn(n, 8, generator=gen), torch.randn(n, 8, generator=gen)
    return (x, y) if nargs == 2 else (x, y, torch.full((n, 1), 0.5))


def _worker(rank: int, world: int, scripts: list[list[Call]], zero: int) -> list[Any]:
    script = scripts[rank]
    model = Net()
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": [piper.replicate(zero=zero), piper.split(2)], "codegen": "eager",
                                  "timeout": TIMEOUT, "optimizer": functools.partial(torch.optim.SGD, lr=0.1)})
    out: list[Any] = []
    for i, (kind, n, nargs) in enumerate(script):
        t0 = time.perf_counter()
        try:
            with torch.no_grad() if kind == "eval" else torch.enable_grad():
                out.append(step(*_data(i, rank, n, nargs)).item())
        except piper.PiperError as e:
            out.append(("error", str(e).splitlines()[0], time.perf_counter() - t0))
            break
    return out


def _expected(scripts: list[list[Call]]) -> tuple[list[float], int | None]:
    """Eager losses of the calls every rank agrees on and can run, and the index of the first call that
    must raise (None: all of them run)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, calls in enumerate(zip(*scripts)):
        kinds = {(k, a) for k, _, a in calls}
        if len(kinds) > 1 or any(n <= 0 or n % 2 for _, n, _ in calls):
            return losses, i
        kind, nargs = next(iter(kinds))
        batch = [torch.cat(t) for t in zip(*(_data(i, r, n, nargs) for r, (_, n, _) in enumerate(calls)))]
        if kind == "eval":
            with torch.no_grad():
                losses.append(model(*batch).item())
            continue
        loss = model(*batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, None


_call = st.tuples(st.sampled_from(["train", "train", "eval"]), st.sampled_from([2, 4, 6, 4, 3, 0]),
                  st.sampled_from([2, 2, 2, 3]))


@st.composite
def _scenario(draw: Any) -> tuple[int, int, list[list[Call]]]:
    world, length = draw(st.sampled_from([2, 3, 4])), draw(st.integers(2, 4))
    base = draw(st.lists(_call, min_size=length, max_size=length))
    scripts = []
    for _ in range(world):  # each rank: the common script, sometimes changed at one call
        mine = list(base)
        if draw(st.integers(0, 2)) == 0:
            mine[draw(st.integers(0, length - 1))] = draw(_call)
        scripts.append(mine)
    return world, draw(st.sampled_from([0, 1])), scripts


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example is a multi-process run
@given(_scenario())
def test_random_call_sequences_match_eager_or_raise_everywhere(scenario: tuple[int, int, list[list[Call]]]) -> None:
    world, zero, scripts = scenario
    results = run_local(_worker, world, scripts, zero, timeout_s=600)
    losses, bad = _expected(scripts)
    for rank, out in enumerate(results):
        ran = [x for x in out if not isinstance(x, tuple)]
        assert ran == pytest.approx(losses, rel=1e-5, abs=1e-6), (rank, scripts, out, losses)
        if bad is None:
            assert len(ran) == len(scripts[rank]), (rank, scripts, out)
            continue
        assert len(out) == bad + 1 and isinstance(out[-1], tuple), (rank, scripts, out)
        _, msg, waited = out[-1]
        assert msg.startswith("piper:") and waited < TIMEOUT + 5, (rank, scripts, out)
    OUTCOMES["exact" if bad is None else "raised everywhere"] += 1
    if EXAMPLES > 6:
        print(f"\nfuzz outcomes so far: {dict(OUTCOMES)}")
