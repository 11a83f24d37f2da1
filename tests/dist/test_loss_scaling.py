"""fp16 compute with dynamic loss scaling on real gloo ranks, against eager training with a fp16 compute
copy and torch's own ``torch.amp.GradScaler`` (``testing/parity``): the same scales step by step, the
same steps skipped, updates within ~1e-7 (fp16 rounds where the reference rounds, as for bf16: see
``run_mixed_parity``); the scale survives a checkpoint, whose fp32 master weights load into fp32 and bf16
runs."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

import piper_compile as piper
from piper_compile.precision import Precision
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import (ComputeCopy, RunConfig, _global_batch, _model, eager_reference,
                                          run_mixed_parity)

pytestmark = pytest.mark.slow

ADAMW = ("AdamW", {"lr": 1e-2, "weight_decay": 0.01})
FP16 = {"param_dtype": "fp16"}
SCALING = {"init_scale": 2.0**12, "growth_interval": 2}


def test_dp2_zero2_overflow_on_one_rank_is_skipped_on_every_rank():
    """Row 0 of step 1's global batch (rank 0's replica) holds an inf: rank 0's gradients overflow; the
    world norm sum is not finite on both ranks, so both skip the update, back the scale off, and go on
    (growing it again after 2 good steps) exactly as GradScaler does on the whole batch."""
    cfg = RunConfig(model="mlp", directives=[piper.replicate(zero=2, bucket_mb=0.001), piper.split(2)], steps=5,
                    optimizer=ADAMW, mixed_precision=FP16, loss_scaling=SCALING, poison=(1, 0))
    res = run_mixed_parity(cfg, 2)
    for r in res:
        assert r["scales"] == [2.0**12, 2.0**11, 2.0**11, 2.0**12, 2.0**12], r["scales"]
        assert not math.isfinite(r["losses"][1]) and all(math.isfinite(x) for i, x in enumerate(r["losses"]) if i != 1)


def test_pp2_1f1b_fp16_unscales_before_clipping():
    """Clipping reads the unscaled global norm (a scaled one would clip every step to ~nothing)."""
    cfg = RunConfig(model="mlp", stages=2, local_batch=8, steps=4, optimizer=ADAMW, mixed_precision=FP16,
                    loss_scaling=SCALING, clip_grad_norm=0.05,
                    directives=[*piper.pipeline(2), piper.split(4), *piper.schedules.one_f_one_b(2, 4)])
    assert min(eager_reference(cfg, 2)["grad_norms"]) > cfg.clip_grad_norm  # clipping engages at every step
    res = run_mixed_parity(cfg, 2)
    assert res[0]["scales"] == [2.0**12, 2.0**13, 2.0**13, 2.0**14]
    assert res[0]["collectives"].get("gradnorm") == 1


def _cfg(precision: dict | None, scaling: dict | None = None) -> RunConfig:
    return RunConfig(model="mlp", directives=[piper.replicate(zero=1, bucket_mb=0.001)], steps=5, optimizer=ADAMW,
                     mixed_precision=precision, loss_scaling=scaling, poison=(1, 2))


def _run(rank: int, world: int, cfg: RunConfig, seed: int, path: str, load: bool, steps: range) -> dict:
    model = _model(dataclasses.replace(cfg, seed=seed))
    step = piper.compile(model, directives=cfg.directives, optimizer=cfg.make_optimizer(), codegen="eager",
                         mixed_precision=cfg.mixed_precision, loss_scaling=cfg.loss_scaling)
    if load:
        piper.load(step, path)
    total = cfg.local_batch * world
    rows = cfg.local_slice(rank, world)
    losses, out = [], {}
    for s in steps:
        losses.append(step(*(t[rows] for t in _global_batch(model, cfg, s, total))).item())
        if s == 2 and not load:
            piper.save(step, path)
            out["saved_full"] = piper.full_state_dict(step)
            out["saved_scale"] = piper.loss_scaler(step).scale
    scaler = piper.loss_scaler(step)
    return {**out, "losses": losses, "scale": scaler.scale if scaler else None,
            "skipped": scaler.skipped if scaler else None}


def test_fp16_checkpoint_keeps_the_scale_and_fp32_master_weights(tmp_path):
    """A fp16 run saves after an overflow backed its scale off; a fresh fp16 run loads it and continues
    bitwise with that scale; the checkpoint's weights are fp32 (an eager fp32 model reads them through
    DCP, equal to the run's); a bf16 run loads them too and its first loss is the eager bf16 loss on them."""
    path = str(tmp_path / "ckpt")
    fp16 = _cfg(FP16, SCALING)
    first = run_local(_run, 2, fp16, fp16.seed, path, False, range(5))
    resumed = run_local(_run, 2, fp16, fp16.seed + 7, path, True, range(3, 5))
    for a, b in zip(first, resumed):
        assert a["saved_scale"] == 2.0**11 and b["losses"] == a["losses"][3:] and b["scale"] == a["scale"]
    model = _model(fp16)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    for k, v in sd["model"].items():
        assert v.dtype is torch.float32 and torch.equal(v, first[0]["saved_full"][k]), k
    bf16 = _cfg({"param_dtype": "bf16"})
    loaded = run_local(_run, 2, bf16, bf16.seed + 11, path, True, range(3, 4))
    model.load_state_dict(sd["model"])
    prec = Precision.parse(bf16.mixed_precision, True)
    batch = _global_batch(model, bf16, 3, 2 * bf16.local_batch)
    expect = ComputeCopy(model, prec, bf16.pieces(2), bf16.dp_degree(2)).loss_and_grads(batch).item()
    for r in loaded:
        assert r["losses"][0] == pytest.approx(expect, rel=1e-5) and r["scale"] is None
