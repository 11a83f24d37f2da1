"""Each distinct segment is compiled, and the joint graph captured, once per job (``codegen/cache.py``): data-parallel replicas take turns
per segment through Inductor's on-disk FX graph cache, so one rank compiles a segment and the others
load it; results are bitwise those of every rank compiling for itself; a second run of the job loads
every segment and compiles none."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.disk import TESTED_TORCH, torch_version
from piper_compile.testing.launch import run_local
from piper_compile.testing.models import build_model

pytestmark = pytest.mark.slow


def _dp2(rank: int, world: int) -> dict[str, Any]:
    model = build_model("gpt", 0, layers=2)
    step = piper.compile(model, directives=[piper.replicate(zero=1), piper.split(2)],
                         optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    losses = []
    for s in range(2):
        x, y = model.make_batch(8, torch.Generator().manual_seed(s))
        losses.append(step(x[rank * 4:(rank + 1) * 4].clone(), y[rank * 4:(rank + 1) * 4].clone()).item())  # own tensors, as a loader gives
    m = piper.stats(step)
    segs = {n: c.outcomes for n, c in piper.compiled_steps(step)[0].compiled.items()}
    return {"losses": losses, "hits": m.cache_hits, "misses": m.cache_misses, "reused": m.reused, "segments": segs,
            "fallbacks": m.fallbacks, "params": [p.detach().clone() for p in model.parameters()], "capture": m.capture,
            "forward": m.forward}


def test_replicas_compile_each_segment_once_and_a_second_run_compiles_none(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("PIPER_CAPTURE_CACHE", "turns")  # as where ranks outnumber cores
    if torch_version() < TESTED_TORCH:  # 'auto' is off there (the GPU machine's 2.11): asked for by name
        monkeypatch.setenv("PIPER_FORWARD_CACHE", "on")
    cold = run_local(_dp2, 2)
    assert set(cold[0]["segments"]) == set(cold[1]["segments"]) and not any(r["fallbacks"] for r in cold)
    # the graphs each rank compiles or loads (a segment's repeated blocks are one graph, reused in-process)
    distinct = cold[0]["hits"] + cold[0]["misses"]
    assert distinct == cold[1]["hits"] + cold[1]["misses"] and distinct >= len(cold[0]["segments"])
    assert all(r["reused"] >= 1 for r in cold), [r["segments"] for r in cold]  # the GPT's second block
    # each graph compiled by exactly one of the two ranks, loaded by the other
    assert sum(r["misses"] for r in cold) == distinct, [r["segments"] for r in cold]
    # the joint graph too (capture/cache.py): one rank exports it, the other loads it
    assert sorted(r["capture"] for r in cold) == ["captured", "loaded"]
    assert all(r["forward"] == "traced" for r in cold)
    warm = run_local(_dp2, 2)
    assert all(r["misses"] == 0 and r["hits"] == distinct for r in warm), [(r["hits"], r["misses"]) for r in warm]
    assert all(r["capture"] == "loaded" for r in warm)
    assert all(r["forward"] == "loaded" for r in warm)  # no Dynamo trace either (capture/forward_cache.py)
    monkeypatch.setenv("PIPER_INDUCTOR_CACHE", "0")  # every rank compiles, captures and traces for itself
    monkeypatch.setenv("PIPER_CAPTURE_CACHE", "off")
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    alone = run_local(_dp2, 2)
    assert all(set(o for v in r["segments"].values() for o in v) == {"off", "reused"} for r in alone)
    assert all(r["capture"] == "off" and r["forward"] == "dynamo" for r in alone)
    for a, b, c in zip(cold, warm, alone):
        assert a["losses"] == b["losses"] == c["losses"]
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a["params"], b["params"], c["params"]))


def _pp2(rank: int, world: int) -> dict[str, Any]:
    model = build_model("gpt", 0, layers=4)
    model.annotate_stages(2)
    step = piper.compile(model, directives=[*piper.pipeline(2), piper.split(4), *piper.schedules.one_f_one_b(2, 4)],
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    losses = []
    for s in range(2):
        x, y = model.make_batch(8, torch.Generator().manual_seed(s))
        losses.append(step(x, y).item())
    m = piper.stats(step)
    segs = piper.compiled_steps(step)[0].compiled.values()
    return {"losses": losses, "compiled": m.cache_hits + m.cache_misses, "misses": m.cache_misses,
            "unused": sum(c.unused_ahead for c in segs),
            "fallbacks": m.fallbacks,  # this stage's parameters (the other stage's are released here)
            "params": [p.detach().clone() for p in model.parameters() if p.untyped_storage().nbytes()]}


def test_pipeline_stages_compile_ahead_what_their_run_uses_and_train_the_same(tmp_path, monkeypatch):
    """PIPER_PRECOMPILE: each stage compiles its segments from their input shapes before its first step
    waits on the other; the run uses every graph compiled ahead (same layouts), compiles nothing more, and
    trains exactly as compiling at first use does. The second run compiles at first use over the first's
    cache: it finds every graph there, so the graphs compiled ahead are exactly those a first use asks for."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    ahead = run_local(_pp2, 2)
    monkeypatch.setenv("PIPER_PRECOMPILE", "0")
    lazy = run_local(_pp2, 2)
    for a, b in zip(ahead, lazy):
        assert a["unused"] == 0 and a["fallbacks"] == b["fallbacks"] == 0
        assert a["compiled"] == b["compiled"] and a["misses"] > 0 and b["misses"] == 0, (a["misses"], b["misses"])
        assert a["losses"] == b["losses"]
        assert len(a["params"]) == len(b["params"]) > 0
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
