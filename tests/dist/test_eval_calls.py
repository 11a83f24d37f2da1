"""Evaluating between training steps under ``torch.no_grad`` or ``torch.inference_mode``, as every
training loop does: the eval loss is eager's on the same global batch and training goes on exactly.

Under ZeRO-3 this crashed: ``piper.compile``'s no-grad version of a model with repeated blocks was a
capture without the blocks' backward (its forward-only plan disagreed with the training layout), an
inference-mode capture had no backward at all (no parameter gathers: released weights were read), and a
no-grad capture could load the inference-mode one from the capture cache. ``piper.compile`` now runs such
calls on the training version with its forward-only plan (``callmode.py``: no second trace or capture);
``torch.compile(backend="piper")`` captures each version with gradients, keyed by its mode."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.models import build_model

ADAMW = functools.partial(torch.optim.AdamW, lr=0.01)
LOCAL, STEPS = 4, 3
MODES = {"no_grad": torch.no_grad, "inference": torch.inference_mode}
KW = {"gpt": {"layers": 2, "dim": 32, "heads": 2, "seq": 8, "vocab": 64}, "mlp": {}}


def _batch(model: Any, step: int) -> tuple[torch.Tensor, ...]:
    return model.make_batch(2 * LOCAL, torch.Generator().manual_seed(100 + step))


def _eager(name: str, evals: tuple[str, ...]) -> list[Any]:
    """Eager losses: each step's eval calls on the global batch (before the step trains), then the step."""
    model = build_model(name, 0, **KW[name])
    opt, out = ADAMW(model.parameters()), []
    for s in range(STEPS):
        batch = _batch(model, s)
        if s == 1:
            with torch.no_grad():
                out += [model(*batch).item() for _ in evals]
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _worker(rank: int, world: int, name: str, api: str, evals: tuple[str, ...]) -> dict[str, Any]:
    model = build_model(name, 0, **KW[name])
    options = {"directives": [piper.replicate(zero=3)], "optimizer": ADAMW, "codegen": "eager"}
    step = (piper.compile(model, **options) if api == "piper.compile" else
            torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options=options))
    out = []
    for s in range(STEPS):
        x, y = (t[rank * LOCAL:(rank + 1) * LOCAL] for t in _batch(model, s))
        if s == 1:
            for mode in evals:
                with MODES[mode]():
                    loss = step(x, y)
                assert not loss.requires_grad
                out.append(float(loss))
        out.append(float(step(x, y)))
    return {"losses": out, "versions": len(piper.compiled_steps(step)), "state": model.state_dict()}


@pytest.mark.parametrize("name,api,evals", [
    ("gpt", "piper.compile", ("no_grad", "inference")),  # repeated blocks: nested compile regions
    ("mlp", "torch.compile", ("inference", "no_grad")),  # the no-grad version once loaded the inference one
])
def test_eval_between_zero3_steps_matches_eager(name: str, api: str, evals: tuple[str, ...]) -> None:
    want = _eager(name, evals)
    ref = build_model(name, 0, **KW[name])
    opt = ADAMW(ref.parameters())
    for s in range(STEPS):
        ref(*_batch(ref, s)).backward()
        opt.step()
        opt.zero_grad()
    for r in run_local(_worker, 2, name, api, evals):
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        if api == "piper.compile":  # no-grad calls ran on the training version (torch.compile: their own)
            assert r["versions"] == 1
        for k, v in ref.state_dict().items():  # AdamW after DP2's reduction: a few ulps of the step apart
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=5e-5)
