"""Models built on the meta device (``init/deferred.py``): for every strategy, each rank allocates and
initializes only what its plan holds, trains to parity with the single-device reference built by
``piper.materialize`` from the same meta model and seed, and its parameter, gradient and optimizer
bytes after the first steps are the plan's (within 2%). One process tree per world size runs every case
in turn (Dynamo reset in between)."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, assert_parity, eager_reference, piper_worker

pytestmark = pytest.mark.slow
S = piper.schedules
GPT = {"layers": 4}
TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
FIELDS = ("params", "grads", "optimizer")


def _cfg(directives: list[Any], **kw: Any) -> RunConfig:
    # SGD with momentum (state to count): AdamW turns the ~1e-9 noise of gradients that are zero in exact
    # arithmetic (the attention key bias) into +-lr steps, on any strategy
    base = {"model": "gpt", "model_kwargs": GPT, "local_batch": 8, "steps": 3, "meta": True}
    return RunConfig(directives=directives, **{**base, **kw})


def _dp(zero: int) -> RunConfig:
    return _cfg([piper.replicate(zero=zero, bucket_mb=0.05), piper.split(2)])


def _cases_2() -> dict[str, RunConfig]:
    return {
        "PP2 1F1B": _cfg([*piper.pipeline(2), piper.split(4), *S.one_f_one_b(2, 4)], stages=2),
        "PP2 interleaved": _cfg([*S.round_robin(2, 2), piper.split(4), *S.interleaved_1f1b(2, 2, 4)], stages=4),
        "PP2 ZBV": _cfg([piper.split(4), *S.zbv(2, 4)], stages=4),
        "DP2 ZeRO-1": _dp(1), "DP2 ZeRO-2": _dp(2), "DP2 ZeRO-3": _dp(3),
        "TP2": _cfg([piper.split(2), piper.shard_tensor(TP)], model_kwargs={"layers": 2}, local_batch=4, tp=2),
        "EP2": _cfg([piper.split(2), piper.replicate(), piper.shard({"EP": "*"})], model="moegpt",
                    model_kwargs={"layers": 2, "experts": 4}, local_batch=4),
    }


def _cases_4() -> dict[str, RunConfig]:
    groups = [[0, 2], [1, 3]]
    return {
        "PP4 1F1B": _cfg([*piper.pipeline(4), piper.split(4), *S.one_f_one_b(4, 4)], stages=4),
        "PP2 x DP2 ZeRO-3": _cfg([*piper.pipeline(2, ranks=groups), piper.split(4), *S.one_f_one_b(2, 4),
                                  piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.05)], stages=2),
    }


def _worker(rank: int, world: int, cases: dict[str, RunConfig]) -> dict[str, Any]:
    out = {}
    for name, cfg in cases.items():
        torch._dynamo.reset()
        out[name] = piper_worker(rank, world, cfg)
    return out


def _check(world: int, cases: dict[str, RunConfig]) -> None:
    per_rank = run_local(_worker, world, cases)
    for name, cfg in cases.items():
        results = [r[name] for r in per_rank]
        assert_parity(results, eager_reference(cfg, world))
        for rank, r in enumerate(results):
            m, p = r["memory"].measured, r["memory"].predicted
            for f in FIELDS:
                got, want = getattr(m, f), getattr(p, f)
                assert abs(got - want) <= 0.02 * want + 1, (name, rank, f, got, want)


def test_meta_models_train_like_their_reference_on_two_ranks():
    _check(2, _cases_2())


def test_meta_models_train_like_their_reference_on_four_ranks():
    _check(4, _cases_4())


BIG = {"layers": 2, "vocab": 8192, "dim": 256, "heads": 4}  # wte: 8 MiB, a ZeRO-3 bucket of its own


def _init_allocations(rank: int, world: int, hf_dir: str | None) -> dict[str, Any]:
    """The first call of DP2 ZeRO-3 on a meta GPT under the profiler: the bytes of every allocation made
    while piper initialized (``piper::initialize``: materializing, sharding, a deferred load), and the
    size of the largest parameter and of its shard."""
    from piper_compile.testing.models import build_model

    with torch.device("meta"):
        model = build_model("gpt", **BIG)
    step = piper.compile(model, directives=[piper.replicate(zero=3, bucket_mb=1), piper.split(2)], codegen="eager",
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), init="checkpoint" if hf_dir else "module")
    if hf_dir:
        piper.load(step, hf_dir)
    x, y = model.make_batch(8, torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
    events = prof.events()
    inside = [e for e in events if e.name == "piper::initialize"]
    assert len(inside) == 1
    lo, hi = inside[0].time_range.start, inside[0].time_range.end
    sizes = [e.self_cpu_memory_usage for e in events
             if e.self_cpu_memory_usage > 0 and lo <= e.time_range.start and e.time_range.end <= hi]
    full = model.wte.weight.numel() * 4
    return {"sizes": sizes, "full": full, "held": piper.memory_report(step).measured.params}


def _hf_source(path: str) -> None:
    from piper_compile.init.replay import materialize
    from piper_compile.testing.models import build_model

    with torch.device("meta"):
        model = build_model("gpt", **BIG)
    materialize(model, seed=0)
    from safetensors.torch import save_model

    os.makedirs(path, exist_ok=True)
    save_model(model, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("load", [False, True], ids=["init", "hf-load"])
def test_zero3_never_allocates_a_full_parameter_while_initializing_or_loading(tmp_path, load):
    hf_dir = None
    if load:
        hf_dir = str(tmp_path / "hf")
        _hf_source(hf_dir)
    for r in run_local(_init_allocations, 2, hf_dir):
        assert r["sizes"], "nothing was allocated while initializing: the check saw nothing"
        assert max(r["sizes"]) < r["full"] / 2 + 2**16, (max(r["sizes"]), r["full"])  # never a whole wte
        assert max(r["sizes"]) >= r["full"] / 2 - 2**16  # its shard was (the check can see it)


def test_meta_model_under_bf16_mixed_precision_matches_its_reference():
    """DP2 ZeRO-3 with a bf16 compute copy: the ranks' fp32 master shards are initialized pieces (the
    compute copy is cast from them), and training follows the bf16 reference of piper.materialize."""
    from piper_compile.testing.parity import run_mixed_parity

    cfg = _cfg([piper.replicate(zero=3, bucket_mb=0.05), piper.split(2)], model_kwargs={"layers": 2}, local_batch=4,
               optimizer=("AdamW", {"lr": 1e-3}), mixed_precision={"param_dtype": "bf16"})
    run_mixed_parity(cfg, 2)
