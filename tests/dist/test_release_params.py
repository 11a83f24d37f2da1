"""A pipeline rank keeps only the parameters its own program reads (other stages' weights give their
memory back after the first training plan), with or without ZeRO: training still matches eager, the
parameter memory each rank holds is what the plan predicts, and ``model.state_dict()``,
``piper.full_state_dict``, ``piper.save``/``piper.load`` and forward-only calls still see every weight."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, _global_batch, _model, eager_reference, run_parity


def _pp(stages: int, m: int, ranks: list[list[int]] | None = None) -> list[Any]:
    return [*piper.pipeline(stages, ranks=ranks), piper.split(m), *piper.schedules.one_f_one_b(stages, m)]


PP2 = RunConfig(model="gpt", model_kwargs={"layers": 4}, stages=2, directives=_pp(2, 4), local_batch=8,
                no_grad_eval=True)


def _assert_params_as_predicted(res: list[dict[str, Any]]) -> None:
    """Every rank holds exactly the parameter bytes the plan predicts (its own stage's weights), and no
    rank holds the whole model."""
    whole = sum(p.numel() * p.element_size() for p in _model(PP2).parameters())
    for rank, r in enumerate(res):
        m, p = r["memory"].measured, r["memory"].predicted
        assert m.params == p.params, (rank, m.params, p.params)
        assert m.params < whole, (rank, m.params, whole)


@pytest.mark.slow
def test_pp2_1f1b_gpt_releases_the_other_stage():
    """PP2 1F1B on the 4-layer GPT (tied wte on both stages): parity with eager, a forward-only call after
    training, and each rank's parameter memory is its stage's (was the whole model on both ranks)."""
    res = run_parity(PP2, 2)
    _assert_params_as_predicted(res)
    assert "SEND.grad:wte.weight" in res[0]["program"]  # the tied weight stays on both stages


@pytest.mark.slow
def test_pp2_x_dp2_releases_the_other_stage():
    cfg = dataclasses.replace(PP2, directives=[*_pp(2, 4, ranks=[[0, 2], [1, 3]]), piper.replicate({"PP": "*"})])
    _assert_params_as_predicted(run_parity(cfg, 4))


# interleaved 1F1B and ZBV (several stages per rank): tests/dist/test_memory_matrix.py checks their
# parameter bytes against the plan, and tests/dist/test_schedule_numerics.py their training, released alike


TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


@pytest.mark.slow
def test_pp2_x_tp2_gets_no_piece_of_the_other_stage():
    """PP2 x TP2: a rank holds pieces of its own stage's split layers only (it held the other stage's
    pieces, and every full weight, before). Within 1% of the plan: stage 1 also holds blocks.0.out.bias,
    which its program reads (the rowwise bias add after stage 0's all-reduce lands in stage 1)."""
    groups = [[0, 1], [2, 3]]
    cfg = RunConfig(model="gpt", model_kwargs={"layers": 2}, stages=2, local_batch=4, tp=2, directives=[
        *_pp(2, 4, ranks=groups), piper.shard_tensor(TP, devices=groups)])
    for rank, r in enumerate(run_parity(cfg, 4)):
        m, p = r["memory"].measured, r["memory"].predicted
        assert p.params <= m.params <= 1.01 * p.params, (rank, m.params, p.params)


@pytest.mark.slow
def test_pp2_x_ep2_releases_the_other_stage():
    groups = [[0, 1], [2, 3]]
    cfg = RunConfig(model="moegpt", model_kwargs={"layers": 2, "experts": 4}, stages=2, local_batch=4, directives=[
        *_pp(2, 4, ranks=groups), piper.replicate({"PP": "*"}), piper.shard({"EP": "*"})])
    for rank, r in enumerate(run_parity(cfg, 4)):
        assert r["memory"].measured.params == r["memory"].predicted.params, (rank, r["memory"])


def test_a_program_reading_a_released_weight_is_refused():
    """The guard every call runs: a program that reads a weight this rank released is a piper: error
    naming the weight (a released tensor-parallel weight is fine: programs read the rank's piece)."""
    from piper_compile.plan.residency import Reads, check_resident
    from piper_compile.runtime.state import TrainState

    st = TrainState([torch.nn.Parameter(torch.zeros(2))], None)
    st.released = {"a.weight", "tp.weight"}
    st.released_buffers = {"c.mask"}
    st.shards = {"tp.weight": object()}  # type: ignore[dict-item]
    check_resident(Reads(frozenset({"tp.weight", "b"}), frozenset({"d.mask"})), st, 1, "forward-only program")
    with pytest.raises(piper.PiperError, match=r"piper: rank 1's forward-only program reads a\.weight"):
        check_resident(Reads(frozenset({"a.weight", "b"})), st, 1, "forward-only program")
    with pytest.raises(piper.PiperError, match=r"piper: rank 1's forward-only program reads c\.mask"):
        check_resident(Reads(frozenset({"b"}), frozenset({"c.mask"})), st, 1, "forward-only program")


def _make(cfg: RunConfig, seed: int) -> tuple[torch.nn.Module, Any]:
    model = _model(dataclasses.replace(cfg, seed=seed))
    model.annotate_stages(cfg.stages)  # type: ignore[operator]
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": cfg.directives, "optimizer": cfg.make_optimizer(), "codegen": "eager"})
    return model, step


def _batch(model: torch.nn.Module, cfg: RunConfig, s: int) -> tuple[torch.Tensor, ...]:
    return _global_batch(model, cfg, s, cfg.local_batch)


def _state_worker(rank: int, world: int, cfg: RunConfig, path: str) -> dict[str, Any]:
    """Train, then read every weight back three ways (and check that reading left nothing resident);
    save, load into a fresh model with other initial weights, and evaluate it."""
    model, step = _make(cfg, cfg.seed)
    for s in range(cfg.steps):
        step(*_batch(model, cfg, s))
    st = piper.compiled_steps(step)[0].state
    released = sorted(st.released)
    module_sd = {k: v.clone() for k, v in model.state_dict().items()}
    full = piper.full_state_dict(step)
    still_released = all(st.named[f].untyped_storage().nbytes() == 0 for f in released)
    with torch.no_grad():
        eval_loss = step(*_batch(model, cfg, cfg.steps)).item()
    piper.save(step, path)
    torch._dynamo.reset()
    model2, step2 = _make(cfg, cfg.seed + 7)
    piper.load(step2, path)  # before the first call: deferred into it
    with torch.no_grad():
        eval2 = step2(*_batch(model2, cfg, cfg.steps)).item()
    full2 = piper.full_state_dict(step2)
    return {"released": released, "module_sd": module_sd, "full": full, "still_released": still_released,
            "eval": eval_loss, "eval2": eval2, "full2": full2}


@pytest.mark.slow
def test_state_dict_and_checkpoint_see_every_weight(tmp_path):
    """After PP2 training, model.state_dict() and piper.full_state_dict(step) are the eager reference's
    weights on both ranks (each rank released the other stage's); reading them gives no memory back; a
    save/load round trip into a fresh model restores them and its forward-only loss."""
    cfg = dataclasses.replace(PP2, model_kwargs={"layers": 2}, directives=_pp(2, 2), no_grad_eval=False)
    res = run_local(_state_worker, 2, cfg, str(tmp_path / "ckpt"))
    ref = eager_reference(dataclasses.replace(cfg, no_grad_eval=True), 1)
    names = list(_model(cfg).state_dict())
    assert res[0]["released"] and res[1]["released"] and not set(res[0]["released"]) & set(res[1]["released"])
    for rank, r in enumerate(res):
        assert r["still_released"], rank
        assert list(r["full"]) == names and list(r["module_sd"]) == names
        for name, p in zip(names, ref["params"]):
            torch.testing.assert_close(r["full"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{rank} {n}: {m}")
            assert torch.equal(r["module_sd"][name], r["full"][name]), (rank, name)
            assert torch.equal(r["full2"][name], r["full"][name]), (rank, name)
        torch.testing.assert_close(r["eval"], ref["eval_loss"], rtol=1e-5, atol=1e-6)
        assert r["eval2"] == r["eval"], rank
