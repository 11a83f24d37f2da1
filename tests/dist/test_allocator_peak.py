"""The memory plan against the CPU allocator itself (issue 17): on two gloo ranks, each rank's peak as the
allocator saw it over two training steps (``testing/allocator.py``: every allocation the profiler
records, Inductor's C++ buffers included) within 10% of the plan's ``peak_total``, across DP (ZeRO-1,
ZeRO-3), pipelines (GPipe, 1F1B, with selective and full checkpointing), segments run eagerly and as
Inductor's code. The runtime's own accounting (``test_memory_matrix.py``) cannot see what a segment
holds while it runs; the allocator can: before the plan counted segments' intermediates and views
(``sim/segment_memory.py``) it was 11% over on DP (a saved tensor and its ``detach`` counted twice) and
half the allocator's figure on the loss stage of a checkpointed pipeline (the recomputed logits).

Expert and tensor parallelism are not in the matrix: gloo's all-to-all and all-reduce drop tensors on
gloo's own worker threads, which the profiler's CPU memory records do not follow, so their running total
drifts up (EP2 rank 1: 15.13 MiB over the start with one step profiled, 18.12 with four). Each step is
profiled on its own (``testing/allocator``), which keeps the drift of one step out of the next, but not
out of the step itself: TP2 rank 1 measured -0.0% to -4.8% in four runs and -10.3% in a fifth, EP2 rank 1
-8.1% to -11.6% (its rank also receives ~1.5x the rows balanced routing gives it). Both plans are checked
against the runtime's own accounting (``test_memory_matrix.py``)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.memory import MiB
from piper_compile.testing.allocator import allocator_peak
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, build_step

pytestmark = pytest.mark.slow
GPT = {"vocab": 2048, "seq": 64, "dim": 128, "heads": 4, "layers": 2}  # the logits dwarf the allocator's noise
ADAMW = ("AdamW", {"lr": 1e-3})


def _cases() -> dict[str, RunConfig]:
    S = piper.schedules

    def pp(schedule: list, *extra: Any, codegen: str = "eager") -> RunConfig:
        return RunConfig(model="gpt", model_kwargs=GPT, optimizer=ADAMW, stages=2, local_batch=16,
                         codegen=codegen, directives=[*piper.pipeline(2), piper.split(4), *schedule, *extra])

    def v(directives: list) -> RunConfig:  # four stages, two per rank
        return RunConfig(model="gpt", model_kwargs={**GPT, "layers": 4}, optimizer=ADAMW, stages=4, local_batch=16,
                         codegen="eager", directives=directives)

    def dp(zero: int, codegen: str = "eager", **kw: Any) -> RunConfig:
        return RunConfig(model="gpt", model_kwargs=GPT, optimizer=ADAMW, local_batch=16, codegen=codegen, **kw,
                         directives=[piper.replicate(zero=zero, bucket_mb=0.25), piper.split(2)])

    one_f = S.one_f_one_b(2, 4)
    return {"DP2 ZeRO-1": dp(1), "DP2 ZeRO-3": dp(3), "DP2 ZeRO-3 bf16": dp(3, mixed_precision={"param_dtype": "bf16"}),
            "PP2 GPipe": pp(S.gpipe(2, 4)), "PP2 1F1B": pp(one_f),
            "PP2 1F1B selective": pp(one_f, piper.checkpoint({"PP": "*"}, policy="selective")),
            "PP2 1F1B full": pp(one_f, piper.checkpoint({"PP": "*"})),
            "DP2 ZeRO-1 inductor": dp(1, "inductor"),
            "PP2 1F1B selective inductor": pp(one_f, piper.checkpoint({"PP": "*"}, policy="selective"),
                                              codegen="inductor"),
            "DP2 ZeRO-2": dp(2), "PP2 ZB-H1": pp(S.zb_h1(2, 4)),
            "PP2 interleaved": v([*S.round_robin(2, 2), piper.split(4), *S.interleaved_1f1b(2, 2, 4)]),
            "PP2 ZBV": v([piper.split(4), *S.zbv(2, 4)]), "DualPipeV": v([piper.split(4), *S.dualpipe_v(2, 4)])}


def _worker(rank: int, world: int, cases: dict[str, RunConfig]) -> dict[str, tuple[int, int, str]]:
    out = {}
    for name, cfg in cases.items():
        torch._dynamo.reset()
        model, step = build_step(cfg)
        rows = cfg.local_slice(rank, world)
        batch = tuple(t[rows] for t in model.make_batch(sum(cfg.replica_batches(world)), torch.Generator().manual_seed(0)))
        out[name] = allocator_peak(step, batch)
        del model, step, batch
    return out


def test_cpu_allocator_peak_per_rank_within_ten_percent_of_the_plan():
    results = run_local(_worker, 2, _cases(), backend="gloo")
    rows = [(name, rank, m, p, d) for rank, cases in enumerate(results) for name, (m, p, d) in cases.items()]
    print(f"\n{'case':28} rank {'allocator MiB':>14} {'plan MiB':>9}  error")
    for name, rank, m, p, _ in rows:
        print(f"{name:28} {rank:4} {m / MiB:14.2f} {p / MiB:9.2f}  {(p - m) / m:+6.1%}")
    bad = [f"{name} rank {rank}: {d}" for name, rank, m, p, d in rows if abs(m - p) > 0.10 * m]
    assert not bad, "\n".join(bad)
    # Measured 0.6% on average (the worst -3.0%: DP2 ZeRO-3 rank 1, which varies by ~1 MiB from run to
    # run). With sends freed on the reaper thread (test_send_release.py) it was 3.3%.
    mean = sum(abs(m - p) / m for _, _, m, p, _ in rows) / len(rows)
    assert mean < 0.025, f"the plan is {mean:.1%} off the allocator on average"

