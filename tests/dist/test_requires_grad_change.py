"""Freezing or unfreezing parameters between steps (``requires_grad_``), as fine-tuning recipes do:
Dynamo compiles the step again and the new variant trains exactly like eager, where the optimizer skips a
parameter without a gradient and keeps its state. Under ZeRO the shard layout and the optimizer state are
those of the first training step's trained parameters, so a change is refused on every rank with a
``piper:`` error before anything runs, and setting the flag back resumes training where it stopped."""
from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.models import build_model

ADAMW = functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)
LOCAL, STEPS, FROZEN = 4, 5, "layers.0.weight"


def _batch(model: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return model.make_batch(2 * LOCAL, torch.Generator().manual_seed(100 + step))


def _set(model: Any, step: int, unfreeze: bool = True) -> None:
    """Freeze ``FROZEN`` before step 1; before step 3 unfreeze it (or freeze it again)."""
    if step in (1, 3):
        dict(model.named_parameters())[FROZEN].requires_grad_(step == 3 and unfreeze)


def _eager(freeze: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model("mlp", 0)
    opt, losses = ADAMW(model.parameters()), []
    for s in range(STEPS):
        if freeze:
            _set(model, s)
        loss = model(*_batch(model, s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _directives(kind: str, model: Any) -> tuple[list[Any], slice]:
    """(directives, which rows of a 2-replica global batch) of a rank's run."""
    if kind == "pp2":
        model.annotate_stages(2)
        return [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)], slice(None)
    return [piper.replicate(zero=int(kind[-1]))], slice(None)


def _worker(rank: int, world: int, kind: str) -> dict[str, Any]:
    model = build_model("mlp", 0)
    directives, rows = _directives(kind, model)
    if kind != "pp2":
        rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
    step = piper.compile(model, directives=directives, optimizer=ADAMW, codegen="eager")
    losses, refused = [], []
    for s in range(STEPS):
        x, y = (t[rows] for t in _batch(model, s))
        _set(model, s, unfreeze=kind in ("pp2", "zero0"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-line recompile message
            try:
                losses.append(float(step(x, y)))
            except piper.PiperError as e:  # under ZeRO: set it back and train the same step again
                refused.append(str(e))
                dict(model.named_parameters())[FROZEN].requires_grad_(True)
                losses.append(float(step(x, y)))
    return {"losses": losses, "refused": refused, "state": model.state_dict()}


@pytest.mark.parametrize("kind", ["zero0", "pp2"])
def test_freezing_and_unfreezing_between_steps_trains_as_eager(kind: str) -> None:
    losses, ref = _eager(freeze=True)
    out = run_local(_worker, 2, kind)
    frozen_at_1 = _eager(freeze=False)[1][FROZEN]
    assert not torch.allclose(ref[FROZEN], frozen_at_1)  # the freeze changed the eager result
    for r in out:
        assert r["refused"] == []
        assert r["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        for k, v in ref.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["zero1", "zero3"])
def test_zero_refuses_a_changed_trained_set_on_every_rank(kind: str) -> None:
    out = run_local(_worker, 2, kind)
    losses, ref = _eager(freeze=False)  # each refusal was followed by the same step unfrozen
    for r in out:
        assert len(r["refused"]) == 2, r["refused"]  # the freeze before step 1, and again before step 3
        assert all(m.startswith(f"piper: {FROZEN} get no gradient in this version of the step (requires_grad "
                                "turned off") and f"trained under replicate(zero={kind[-1]})" in m and "Fix:" in m
                   for m in r["refused"])
        assert r["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        for k, v in ref.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6)


class AuxNet(torch.nn.Module):
    """A trunk with a main head and an auxiliary head whose loss is added only while ``use_aux`` is set: a
    Python flag, so each setting is a version of the compiled step reading other parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.aux = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
        self.use_aux = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        loss = torch.nn.functional.mse_loss(self.head(h), y)
        return loss + torch.nn.functional.mse_loss(self.aux(h), y) if self.use_aux else loss


def _aux_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2 * LOCAL, 8, generator=g), torch.randn(2 * LOCAL, 4, generator=g)


def _aux_eager(flags: tuple[bool, ...]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, losses = AuxNet(), []
    opt = ADAMW(model.parameters())
    for s, flag in enumerate(flags):
        model.use_aux = flag
        loss = model(*_aux_batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _aux_worker(rank: int, world: int, api: str, zero: int, flags: tuple[bool, ...]) -> dict[str, Any]:
    model = AuxNet()
    options = {"directives": [piper.replicate(zero=zero)], "optimizer": ADAMW, "codegen": "eager"}
    step = (piper.compile(model, **options) if api == "piper.compile" else
            torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options=options))
    losses = []
    for s, flag in enumerate(flags):
        model.use_aux = flag
        x, y = (t[rank * LOCAL:(rank + 1) * LOCAL] for t in _aux_batch(s))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-line recompile message
            try:
                losses.append(float(step(x, y)))
            except piper.PiperError as e:
                return {"error": str(e)}
    return {"losses": losses, "state": model.state_dict()}


@pytest.mark.parametrize("api,flags", [
    ("piper.compile", (True, False, True, False)),  # the version without the head reads fewer parameters
    ("piper.compile", (False, True, False, True)),  # the version with it reads more
    ("torch.compile", (True, False, True, False)),  # fewer: it shares the first version's state
])
def test_a_branch_used_on_some_steps_trains_as_eager(api: str, flags: tuple[bool, ...]) -> None:
    """Each version of the step used to get a training state of its own, so its optimizer started from
    nothing and its moments went stale while the other version ran: silently wrong numbers."""
    losses, ref = _aux_eager(flags)
    for r in run_local(_aux_worker, 2, api, 0, flags):
        assert r["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        for k, v in ref.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("api,zero,says", [
    ("torch.compile", 0, "this version's forward uses 2 parameter(s) its first version did not (aux.bias, aux.weight"),
    ("piper.compile", 1, "aux.bias, aux.weight get gradients in this version of the step but not in the first"),
])
def test_a_branch_that_cannot_train_as_eager_is_refused(api: str, zero: int, says: str) -> None:
    """Under torch.compile the first version's optimizer lacks the head's weights; under ZeRO its layout."""
    for r in run_local(_aux_worker, 2, api, zero, (False, True)):
        assert says in r["error"], r["error"]
