"""Checkpoints and memory reports under expert parallelism (``piper.shard``) on real gloo ranks: each rank
writes its expert shard (and its optimizer state) as a box of the full ``[E, ...]`` tensor, a run
resumed in fresh processes continues bitwise, the checkpoint loads into another layout and into an
eager model, and full weights (``full_state_dict``, ``model.state_dict()``) are gathered from the
shards."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import _batch, _make, _train, check_sharded_resume

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, _global_batch, _model, eager_reference

pytestmark = pytest.mark.slow

ADAMW = ("AdamW", {"lr": 1e-3, "weight_decay": 0.1})
EXPERTS = ("moe.w_gate", "moe.w_up", "moe.w_down")


def _ep2(zero: int = 0) -> RunConfig:
    return RunConfig(model="moe", model_kwargs={"experts": 4}, local_batch=4, optimizer=ADAMW, steps=6,
                     directives=[piper.split(2), piper.replicate(zero=zero), piper.shard({"EP": 0})])


def _first_run(rank: int, world: int, cfg: RunConfig, path: str) -> dict:
    model, step = _make(cfg, cfg.seed)
    losses = _train(step, model, cfg, rank, world, range(3))
    piper.save(step, path)  # mid-run: the run goes on undisturbed
    losses += _train(step, model, cfg, rank, world, range(3, 6))
    st = piper.compiled_steps(step)[0].state
    local = {f: (tuple(p.shape), sl.start) for f, (p, sl) in st.experts.items()}
    report = piper.memory_report(step)
    module_sd = {k: v.clone() for k, v in model.state_dict().items()}  # experts gathered by piper's hook
    full = piper.full_state_dict(step)
    # model.load_state_dict(full) puts each rank's experts into its shard (the model's weights stay released)
    before = {f: st.experts[f][0].detach().clone() for f in EXPERTS}
    with torch.no_grad():
        for f, (p, _) in st.experts.items():
            p.zero_()
    piper.load_full_state_dict(step, full)
    reloaded = all(torch.equal(st.experts[f][0], before[f]) for f in EXPERTS)
    released = all(st.named[f].untyped_storage().nbytes() == 0 for f in EXPERTS)
    return {"losses": losses, "full": full, "module_sd": module_sd, "local": local,
            "report": report, "reloaded": reloaded, "released": released}


def _resumed_run(rank: int, world: int, cfg: RunConfig, path: str, other: list) -> dict:
    model, step = _make(cfg, cfg.seed + 7)  # other initial weights: all must come from the checkpoint
    piper.load(step, path)  # before the first call: deferred into it, after the experts are sharded
    out = {"resumed": _train(step, model, cfg, rank, world, range(3, 6)), "full": piper.full_state_dict(step)}
    # the checkpoint is per parameter, full shapes: a layout without expert parallelism loads it
    torch._dynamo.reset()
    model, step = _make(dataclasses.replace(cfg, directives=other), cfg.seed + 11)
    piper.load(step, path)
    out["other_layout"] = _train(step, model, cfg, rank, world, range(3, 6))
    return out


def _check(cfg: RunConfig, tmp_path, other: list) -> list[dict]:
    path = str(tmp_path / "ckpt")
    first = run_local(_first_run, 2, cfg, path)
    second = run_local(_resumed_run, 2, cfg, path, other)
    ref = eager_reference(cfg, 2)
    names = list(_model(cfg).state_dict())
    for rank, (a, b) in enumerate(zip(first, second)):
        assert a["local"] == {f: ((2, *_model(cfg).get_parameter(f).shape[1:]), 2 * rank) for f in EXPERTS}, a["local"]
        check_sharded_resume(rank, a, b, names, ref)
    # an eager model loads the checkpoint directly (experts assembled from both ranks' boxes)
    eager = _model(cfg)
    sd = {"model": eager.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    eager.load_state_dict(sd["model"])
    ref3 = eager_reference(dataclasses.replace(cfg, steps=3), 2)
    for (name, p), q in zip(eager.named_parameters(), ref3["params"]):
        torch.testing.assert_close(p.detach(), q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return first


def _bytes(cfg: RunConfig) -> tuple[int, int]:
    """(dense, expert) parameter bytes of the model."""
    model = _model(cfg)
    experts = sum(model.get_parameter(f).nbytes for f in EXPERTS)
    return sum(p.nbytes for p in model.parameters()) - experts, experts


def test_resume_ep2_adamw(tmp_path):
    cfg = _ep2()
    first = _check(cfg, tmp_path, other=[piper.split(2), piper.replicate()])
    dense, experts = _bytes(cfg)
    for r in first:
        m, p = r["report"].measured, r["report"].predicted
        assert m.params == dense + experts // 2, (m.params, dense, experts)  # the shard, not all experts
        assert m.grads == m.params and m.optimizer == 2 * m.params, m  # AdamW: exp_avg, exp_avg_sq
        assert (p.params, p.grads, p.optimizer) == (m.params, m.grads, m.optimizer), (p, m)
        assert p.peak_grad_buckets == m.peak_grad_buckets == m.grads, (p, m)


def test_resume_ep2_zero1(tmp_path):
    """Dense parameters ZeRO-1-sharded (flat shard pieces), experts expert-sharded (one box per rank);
    loads into EP without ZeRO."""
    cfg = _ep2(zero=1)
    first = _check(cfg, tmp_path, other=[piper.split(2), piper.replicate(), piper.shard({"EP": 0})])
    dense, experts = _bytes(cfg)
    for r in first:
        m, p = r["report"].measured, r["report"].predicted
        # ZeRO-1: full dense parameters (the fp32 shard is a view of them), the expert shard only
        assert m.params == dense + experts // 2, (m.params, dense, experts)
        assert m.optimizer < 2 * m.params, m  # AdamW state of the dense shard and the expert shard
        assert (p.params, p.grads, p.optimizer) == (m.params, m.grads, m.optimizer), (p, m)
