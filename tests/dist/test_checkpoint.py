"""Checkpoints (piper.save / piper.load through torch.distributed.checkpoint, full_state_dict,
load_full_state_dict, model.state_dict() under ZeRO-3) on real gloo ranks: a run resumed in fresh
processes continues bitwise like an uninterrupted one."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, _global_batch, _model, eager_reference

pytestmark = pytest.mark.slow

ADAMW = ("AdamW", {"lr": 1e-2, "weight_decay": 0.1})


def _dp(zero: int) -> RunConfig:
    return RunConfig(model="mlp", directives=[piper.replicate(zero=zero, bucket_mb=0.001)], optimizer=ADAMW, steps=6)


def _pp_dp_zero3() -> RunConfig:
    return RunConfig(model="mlp", stages=2, optimizer=ADAMW, steps=6,
                     directives=[*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(4),
                                 *piper.schedules.one_f_one_b(2, 4),
                                 piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.01)])


def _make(cfg: RunConfig, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = _model(dataclasses.replace(cfg, seed=seed))
    if cfg.stages > 1:
        model.annotate_stages(cfg.stages)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": cfg.directives, "optimizer": cfg.make_optimizer(), "codegen": "eager"})
    return model, step


def _batch(model: torch.nn.Module, cfg: RunConfig, rank: int, world: int, s: int) -> tuple[torch.Tensor, ...]:
    dp, rep = cfg.dp_degree(world), cfg.replica_of(rank, world)
    return tuple(t[rep * cfg.local_batch:(rep + 1) * cfg.local_batch]
                 for t in _global_batch(model, cfg, s, dp * cfg.local_batch))


def _train(step: torch.nn.Module, model: torch.nn.Module, cfg: RunConfig, rank: int, world: int,
           steps: range) -> list[float]:
    return [step(*_batch(model, cfg, rank, world, s)).item() for s in steps]


def _first_run(rank: int, world: int, cfg: RunConfig, path: str) -> dict:
    model, step = _make(cfg, cfg.seed)
    losses = _train(step, model, cfg, rank, world, range(3))
    piper.save(step, path)  # mid-run: the run goes on undisturbed
    losses += _train(step, model, cfg, rank, world, range(3, 6))
    state = piper.compiled_steps(step)[0].state
    hooks = state.hooks_installed  # installed by the first sharded call, before any checkpoint API call
    module_sd = {k: v.clone() for k, v in model.state_dict().items()}  # ZeRO-3: gathered by piper's hook
    owned = sorted(piper.trained_parameters(step))
    full = piper.full_state_dict(step)
    n_compiled = len(piper.compiled_steps(step))
    return {"losses": losses, "full": full, "module_sd": module_sd, "owned": owned, "hooks": hooks,
            "n_compiled": n_compiled}


def _resumed_run(rank: int, world: int, cfg: RunConfig, path: str, other: list, eval_first: bool) -> dict:
    model, step = _make(cfg, cfg.seed + 7)  # other initial weights: all must come from the checkpoint
    piper.load(step, path)  # before the first call: deferred into it
    out = {}
    if eval_first:  # a forward-only first call (under ZeRO-1/2 it has no shard layout yet)
        with torch.no_grad():
            out["eval"] = step(*_batch(model, cfg, rank, world, 3)).item()
    out["resumed"] = _train(step, model, cfg, rank, world, range(3, 6))
    out["full"] = piper.full_state_dict(step)
    # into a live run through DCP itself: shards, parameters and optimizer state are overwritten in place
    dcp.load(piper.sharded_state_dict(step), checkpoint_id=path)
    out["reloaded"] = _train(step, model, cfg, rank, world, range(3, 6))
    # materialising the optimizer state before the first update changes nothing, bitwise
    torch._dynamo.reset()
    model, step = _make(cfg, cfg.seed)
    piper.materialize_optimizer_state(step)
    st = piper.steps.training_state(step, create=True)
    st.pending.append(  # runs after the deferred materialisation, before the first update
        lambda cs: out.setdefault("state_steps", [float(s.get("step", 0)) for s in st.optimizer.state.values()]))
    out["materialized"] = _train(step, model, cfg, rank, world, range(6))
    # the checkpoint is per parameter: another layout (zero level, buckets, no ZeRO) loads it
    torch._dynamo.reset()
    model, step = _make(dataclasses.replace(cfg, directives=other), cfg.seed + 11)
    piper.load(step, path)
    out["other_layout"] = _train(step, model, cfg, rank, world, range(3, 6))
    return out


def check_sharded_resume(rank: int, a: dict, b: dict, names: list[str], ref: dict) -> None:
    """A run whose layers are split across ranks (experts, tensor-parallel pieces), ``a``, and its resumption
    in fresh processes, ``b``: bitwise continuation, another layout close, losses and full weights (gathered
    by ``full_state_dict`` and ``model.state_dict()``) as eager trained them, the resumed run's bitwise."""
    assert b["resumed"] == a["losses"][3:], (rank, b["resumed"], a["losses"][3:])  # bitwise
    torch.testing.assert_close(torch.tensor(b["other_layout"]), torch.tensor(a["losses"][3:]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-6)
    assert a["reloaded"] and a["released"], rank
    assert list(a["full"]) == names and list(a["module_sd"]) == names
    for name, p in zip(names, ref["params"]):
        assert a["full"][name].shape == p.shape, name
        torch.testing.assert_close(a["full"][name], p, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"rank {rank} {n}: {m}")
        assert torch.equal(a["full"][name], b["full"][name]), (rank, name)
        assert torch.equal(a["module_sd"][name], a["full"][name]), (rank, name)


def _check_resume(cfg: RunConfig, world: int, tmp_path, other: list, eval_first: bool = False) -> list[dict]:
    path = str(tmp_path / "ckpt")
    first = run_local(_first_run, world, cfg, path)
    second = run_local(_resumed_run, world, cfg, path, other, eval_first)
    ref = eager_reference(cfg, world)
    names = list(_model(cfg).state_dict())
    zero = any(d.get("zero", 0) for d in cfg.directives)
    for rank, (a, b) in enumerate(zip(first, second)):
        # hooks only where ZeRO shards or pipeline stages release the other stages' weights
        assert a["hooks"] == (zero or cfg.stages > 1) and a["n_compiled"] == 1, rank
        assert b["resumed"] == a["losses"][3:], (rank, b["resumed"], a["losses"][3:])  # bitwise
        assert b["reloaded"] == a["losses"][3:], rank
        assert b["materialized"] == a["losses"], rank
        assert b["state_steps"] and all(s == 0.0 for s in b["state_steps"]), b["state_steps"]
        torch.testing.assert_close(torch.tensor(b["other_layout"]), torch.tensor(a["losses"][3:]), rtol=1e-6, atol=1e-7)
        if eval_first:
            torch.testing.assert_close(b["eval"], a["losses"][3], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        # full_state_dict: every parameter on every rank, as eager trained it; the resumed run's is bitwise
        assert list(a["full"]) == names
        for name, p in zip(names, ref["params"]):
            torch.testing.assert_close(a["full"][name], p, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
            assert torch.equal(a["full"][name], b["full"][name]), (rank, name)
        # model.state_dict(): the parameters this rank trains are full and current (ZeRO-3: gathered by the hook)
        assert list(a["module_sd"]) == names
        assert a["owned"]
        for k in a["owned"]:
            assert torch.equal(a["module_sd"][k], a["full"][k]), (rank, k)
    return first


def test_resume_dp2_zero1_forward_only_first(tmp_path):
    _check_resume(_dp(1), 2, tmp_path, other=[piper.replicate(zero=3, bucket_mb=0.01)], eval_first=True)


def test_resume_dp2_zero2(tmp_path):
    _check_resume(_dp(2), 2, tmp_path, other=[piper.replicate()])


def test_resume_dp2_zero3(tmp_path):
    first = _check_resume(_dp(3), 2, tmp_path, other=[piper.replicate(zero=1, bucket_mb=0.01)])
    assert all(len(r["owned"]) == len(r["full"]) for r in first)  # DP: model.state_dict() is all full
    # full shapes per parameter: an eager model loads the checkpoint directly
    eager = _model(_dp(3))
    sd = {"model": eager.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    eager.load_state_dict(sd["model"])
    ref3 = eager_reference(dataclasses.replace(_dp(3), steps=3), 2)
    for p, q in zip(eager.parameters(), ref3["params"]):
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6)


def test_resume_dp2_zero3_two_parameter_groups(tmp_path):
    """Two optimizer groups (``parity.two_groups``) over ZeRO-3 shards whose buckets hold both: the state
    is saved per parameter, resumes bitwise, and loads into other buckets under ZeRO-1."""
    cfg = dataclasses.replace(_dp(3), param_groups=True)
    _check_resume(cfg, 2, tmp_path, other=[piper.replicate(zero=1, bucket_mb=0.01)])


def test_resume_pp2_x_dp2_zero3(tmp_path):
    cfg = _pp_dp_zero3()
    _check_resume(cfg, 4, tmp_path, other=[*cfg.directives[:-1], piper.replicate({"PP": "*"})])


def test_resume_pp2_no_zero_sgd_momentum(tmp_path):
    cfg = RunConfig(model="mlp", stages=2, steps=6,  # SGD with momentum: another optimizer state
                    directives=[*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)])
    _check_resume(cfg, 2, tmp_path, other=[piper.replicate(zero=2, bucket_mb=0.001)])


def _eager_snapshots(cfg: RunConfig, world: int, steps: int) -> tuple[list[dict], list[float]]:
    """The eager model's state_dict before each step, and its losses."""
    eager = _model(cfg)
    opt = cfg.make_optimizer()(eager.parameters())
    snapshots, losses = [], []
    for s in range(steps):
        snapshots.append({k: v.clone() for k, v in eager.state_dict().items()})
        loss = eager(*_global_batch(eager, cfg, s, cfg.dp_degree(world) * cfg.local_batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return snapshots, losses


def _load_full_run(rank: int, world: int, cfg: RunConfig, snapshots: list[dict], eager_ckpt: str) -> dict:
    model, step = _make(cfg, cfg.seed + 3)
    piper.load_full_state_dict(step, snapshots[2])  # before the first call: into the module's parameters
    at2 = step(*_batch(model, cfg, rank, world, 2)).item()
    piper.load_full_state_dict(step, snapshots[3])  # sharded now: the ZeRO-3 shards are updated
    sd3 = {k: v.clone() for k, v in model.state_dict().items()}
    at3 = step(*_batch(model, cfg, rank, world, 3)).item()
    # a DCP checkpoint of the eager model's state_dict (no optimizer state) loads too
    torch._dynamo.reset()
    model, step = _make(cfg, cfg.seed + 5)
    piper.load(step, eager_ckpt)
    from_ckpt = step(*_batch(model, cfg, rank, world, 2)).item()
    return {"at2": at2, "at3": at3, "sd3": sd3, "from_ckpt": from_ckpt}


def test_load_full_state_dict_into_zero3(tmp_path):
    cfg = _dp(3)
    snapshots, eager_losses = _eager_snapshots(cfg, 2, 4)
    dcp.save({"model": snapshots[2]}, checkpoint_id=str(tmp_path / "eager"))  # one process, no process group
    for r in run_local(_load_full_run, 2, cfg, snapshots, str(tmp_path / "eager")):
        torch.testing.assert_close(r["at2"], eager_losses[2], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["at3"], eager_losses[3], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["from_ckpt"], eager_losses[2], rtol=1e-6, atol=1e-7)
        assert list(r["sd3"]) == list(snapshots[3])  # model.state_dict() under ZeRO-3: full and exact
        for k, v in snapshots[3].items():
            assert torch.equal(r["sd3"][k], v), k
