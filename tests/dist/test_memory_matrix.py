"""The memory plan against measurement across strategies: for every case, each rank's runtime-measured
figures (``piper.memory_report``: the runtime's own accounting of parameters, gradients, optimizer
state, peak activations, gathered ZeRO-3 parameters) against the simulator's prediction for the same
programs. One process tree per world size runs every case in turn (Dynamo reset in between), and the
test prints the table (``pytest -s``). Checkpointing changes the measured peak as predicted (full <
selective < none on the first stage of the 1F1B pipeline)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.memory import MiB
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, piper_worker

pytestmark = pytest.mark.slow
S = piper.schedules
GPT = {"layers": 4}
TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
ADAMW = ("AdamW", {"lr": 1e-3})
ADAMW_FOREACH = ("AdamW", {"lr": 1e-3, "foreach": True})  # torch's CUDA default: temporaries of every tensor
FIELDS = ("params", "grads", "optimizer", "peak_activations", "peak_gathered_params", "optimizer_step", "peak_held")
# One P2P activation of the pipeline cases (2 rows of 16 x 32 fp32). Whether a sent activation is still
# held at a rank's peak depends on when its peer posts the receive: run timing, which the plan predicts
# from its cost model. Under full checkpointing a stage's peak is a few such messages plus the largest
# gradient a backward segment writes into its buffer (held while it is written), and it falls at a
# backward step, where one or two of stage 0's forward sends may still wait for the peer's receive
# (measured: one or the other over three runs); so two messages are allowed on top of the 10%.
# TP2 likewise: whether a forward step runs ahead (a filler, while an all-reduce is in flight) before the
# backward step holding the largest gradient temporary depends on when the all-reduce completes; rank 1
# measured 0.1948 (= predicted) in most runs and 0.2185 in some (4 runs beside a busy core: 2 of 8 ranks).
MESSAGE = 2 * 16 * 32 * 4 / MiB
SLACK = 2 * MESSAGE


def _pp(schedule: list, **kw: Any) -> RunConfig:
    return RunConfig(model="gpt", model_kwargs=GPT, stages=2, local_batch=8, steps=2,
                     directives=[*piper.pipeline(2), piper.split(4), *schedule], **kw)


def _cases_2() -> dict[str, RunConfig]:
    dp = lambda zero, **kw: RunConfig(model="gpt", model_kwargs=GPT, local_batch=8, steps=2,  # noqa: E731
                                      directives=[piper.replicate(zero=zero, bucket_mb=0.05), piper.split(2)],
                                      **{"optimizer": ADAMW, **kw})
    return {
        "DP2": dp(0), "DP2 ZeRO-1": dp(1), "DP2 ZeRO-2": dp(2), "DP2 ZeRO-3": dp(3),
        "DP2 AdamW foreach": dp(0, optimizer=ADAMW_FOREACH), "DP2 ZeRO-1 AdamW foreach": dp(1, optimizer=ADAMW_FOREACH),
        "DP2 ZeRO-3 bf16": dp(3, mixed_precision={"param_dtype": "bf16"}),
        "PP2 GPipe": _pp(S.gpipe(2, 4)), "PP2 1F1B": _pp(S.one_f_one_b(2, 4)), "PP2 ZB-H1": _pp(S.zb_h1(2, 4)),
        "PP2 1F1B selective": _pp([*S.one_f_one_b(2, 4), piper.checkpoint({"PP": "*"}, policy="selective")]),
        "PP2 1F1B checkpoint": _pp([*S.one_f_one_b(2, 4), piper.checkpoint({"PP": "*"})]),
        "PP2 interleaved": RunConfig(model="gpt", model_kwargs=GPT, stages=4, local_batch=8, steps=2,
                                     directives=[*S.round_robin(2, 2), piper.split(4), *S.interleaved_1f1b(2, 2, 4)]),
        "PP2 ZBV": RunConfig(model="gpt", model_kwargs=GPT, stages=4, local_batch=8, steps=2,
                             directives=[piper.split(4), *S.zbv(2, 4)]),
        "TP2": RunConfig(model="gpt", model_kwargs={"layers": 2}, local_batch=4, tp=2, steps=2,
                         directives=[piper.split(2), piper.shard_tensor(TP)]),
        "EP2": RunConfig(model="moegpt", model_kwargs={"layers": 2, "experts": 4}, local_batch=4, steps=2,
                         directives=[piper.split(2), piper.replicate(), piper.shard({"EP": "*"})]),
    }


def _cases_4() -> dict[str, RunConfig]:
    cfg = _pp(S.one_f_one_b(2, 4), optimizer=ADAMW)
    cfg.directives[:2] = piper.pipeline(2, ranks=[[0, 2], [1, 3]])
    cfg.directives.append(piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.05))
    return {"PP2 x DP2 ZeRO-3": cfg}


def _matrix_worker(rank: int, world: int, cases: dict[str, RunConfig]) -> dict[str, Any]:
    out = {}
    for name, cfg in cases.items():
        torch._dynamo.reset()
        mem = piper_worker(rank, world, cfg)["memory"]
        out[name] = (mem.measured, mem.predicted)
    return out


def _table(results: dict[int, list[dict[str, Any]]]) -> list[tuple[str, int, str, float, float]]:
    rows = []
    for world, per_rank in results.items():
        for rank, cases in enumerate(per_rank):
            for name, (m, p) in cases.items():
                for f in FIELDS:
                    rows.append((name, rank, f, getattr(m, f) / MiB, getattr(p, f) / MiB))
    print(f"\n{'case':22} rank {'figure':22} {'measured MiB':>13} {'predicted MiB':>14}  error")
    for name, rank, f, m, p in rows:
        err = abs(p - m) / m if m else (0.0 if p == 0 else float("inf"))
        print(f"{name:22} {rank:4} {f:22} {m:13.4f} {p:14.4f}  {err:6.1%}")
    return rows


def test_prediction_within_ten_percent_of_measurement_on_every_case():
    results = {2: run_local(_matrix_worker, 2, _cases_2()), 4: run_local(_matrix_worker, 4, _cases_4())}
    rows = _table(results)
    assert len({r[0] for r in rows}) >= 12
    slack = lambda r: SLACK if r[2] == "peak_activations" and ("PP" in r[0] or "TP" in r[0]) else 0.0  # noqa: E731
    bad = [r for r in rows if abs(r[4] - r[3]) > 0.10 * r[3] + slack(r) + 1e-6]
    assert not bad, bad
    # Checkpointing, measured: stage 0 keeps every micro-batch in flight between its F and B, and full <
    # selective < none there. The loss stage holds one micro-batch under 1F1B and peaks inside its backward,
    # where the recomputed logits are live beside their gradient: checkpointing raises its peak (the CPU
    # allocator agrees, tests/dist/test_allocator_peak.py). On both, the plan predicts the order measured.
    for rank, cases in enumerate(results[2]):
        names = ("PP2 1F1B checkpoint", "PP2 1F1B selective", "PP2 1F1B")
        acts, pred = ([cases[c][i].peak_activations for c in names] for i in (0, 1))
        assert sorted(range(3), key=acts.__getitem__) == sorted(range(3), key=pred.__getitem__), (rank, acts, pred)
        if rank == 0:
            assert acts == sorted(acts) and acts[0] < 0.6 * acts[2], (rank, acts)
