"""A pipeline rank keeps only the buffers its own program reads, as it keeps only its stage's weights
(``plan/residency.py``): other stages' buffers give their memory back after the first training plan, and
a model built on the meta device never allocates them. Training still matches eager, and
``model.state_dict()``, ``piper.full_state_dict``, ``model.load_state_dict``, ``piper.save`` /
``piper.load`` and forward-only calls still see every buffer (fetched from the rank that holds it)."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, _global_batch, _meta_model, _model, eager_reference

CFG = RunConfig(model="buffered_mlp", model_kwargs={"dim": 16, "depth": 4}, stages=2, local_batch=8,
                directives=[*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)],
                no_grad_eval=True)
BUFFERS = [f"layers.{i}.{b}" for i in range(4) for b in ("gain", "shift")]


def _make(cfg: RunConfig, seed: int) -> tuple[torch.nn.Module, Any]:
    cfg = dataclasses.replace(cfg, seed=seed)
    model = _meta_model(cfg) if cfg.meta else _model(cfg)
    model.annotate_stages(cfg.stages)  # type: ignore[operator]
    options = {"directives": cfg.directives, "optimizer": cfg.make_optimizer(), "codegen": "eager"}
    if cfg.meta:
        return model, piper.compile(model, init_seed=seed, **options)
    return model, torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options=options)


def _held(model: torch.nn.Module) -> list[str]:
    return [n for n, b in model.named_buffers() if b.untyped_storage().nbytes()]


def _worker(rank: int, world: int, cfg: RunConfig, path: str) -> dict[str, Any]:
    """Train and evaluate; read every buffer back four ways (checking that reading left the other stage's
    released); load a changed state dict; save, and load into a fresh model built with other values."""
    from piper_compile.init import deferred

    filled: list[int] = []
    fill_whole = deferred.Deferred.fill_whole
    deferred.Deferred.fill_whole = lambda self, t: (filled.append(id(t)), fill_whole(self, t))[1]  # type: ignore
    model, step = _make(cfg, cfg.seed)
    ids = {id(b): n for n, b in model.named_buffers()}
    losses = [step(*_global_batch(model, cfg, s, cfg.local_batch)).item() for s in range(cfg.steps)]
    with torch.no_grad():
        eval_loss = step(*_global_batch(model, cfg, cfg.steps, cfg.local_batch)).item()
    held = _held(model)
    module_sd = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("gain")}
    full = {k: v for k, v in piper.full_state_dict(step).items() if k.endswith("gain")}
    changed = {k: v * 2 for k, v in full.items()}
    model.load_state_dict({**piper.full_state_dict(step), **changed})
    after_load = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("gain")}
    held_after_load = _held(model)
    with torch.no_grad():
        eval_doubled = step(*_global_batch(model, cfg, cfg.steps, cfg.local_batch)).item()
    piper.save(step, path)
    torch._dynamo.reset()
    model2, step2 = _make(dataclasses.replace(cfg, meta=False), cfg.seed + 7)
    with torch.no_grad():
        for n, b in model2.named_buffers():
            if n.endswith("gain"):  # persistent: must come from the checkpoint (shift is in none)
                b.fill_(-1.0)
    piper.load(step2, path)  # before the first call: deferred into it
    with torch.no_grad():
        eval2 = step2(*_global_batch(model2, cfg, cfg.steps, cfg.local_batch)).item()
    full2 = {k: v for k, v in piper.full_state_dict(step2).items() if k.endswith("gain")}
    return {"losses": losses, "eval": eval_loss, "held": held, "filled": sorted(ids[i] for i in filled if i in ids),
            "module_sd": module_sd, "full": full, "after_load": after_load, "held_after_load": held_after_load,
            "eval_doubled": eval_doubled, "eval2": eval2, "full2": full2, "held2": _held(model2)}


def _check(res: list[dict[str, Any]], cfg: RunConfig) -> None:
    ref = eager_reference(cfg, 1)
    gains = {f"layers.{i}.gain": torch.full((16,), 1.0 + 0.25 * i) for i in range(4)}
    for rank, r in enumerate(res):
        stage = [f"layers.{i}.{b}" for i in (2 * rank, 2 * rank + 1) for b in ("gain", "shift")]
        assert r["held"] == stage and r["held_after_load"] == stage, (rank, r["held"], r["held_after_load"])
        assert r["held2"] == BUFFERS, rank  # only forward-only calls: no training plan released anything
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["eval"], ref["eval_loss"], rtol=1e-5, atol=1e-6)
        for k, v in gains.items():
            assert torch.equal(r["module_sd"][k], v) and torch.equal(r["full"][k], v), (rank, k)
            assert torch.equal(r["after_load"][k], 2 * v) and torch.equal(r["full2"][k], 2 * v), (rank, k)
        assert r["eval2"] == r["eval_doubled"] != r["eval"], rank  # the doubled gains, saved and loaded


@pytest.mark.slow
def test_pp2_releases_the_other_stages_buffers(tmp_path):
    """A model built normally: each rank's buffers after training are its stage's only (it held all
    eight); every way of reading the state sees all of them, with the values eager has."""
    res = run_local(_worker, 2, CFG, str(tmp_path / "ckpt"))
    _check(res, CFG)
    assert res[0]["filled"] == [] and res[1]["filled"] == []


@pytest.mark.slow
def test_pp2_meta_model_never_allocates_the_other_stages_buffers(tmp_path):
    """Built on the meta device: each rank initializes its own stage's buffers only (the other stage's
    never get storage), with the values the single-device model has."""
    cfg = dataclasses.replace(CFG, meta=True)
    res = run_local(_worker, 2, cfg, str(tmp_path / "ckpt"))
    _check(res, cfg)
    for rank, r in enumerate(res):
        assert r["filled"] == [f"layers.{i}.{b}" for i in (2 * rank, 2 * rank + 1) for b in ("gain", "shift")], r
