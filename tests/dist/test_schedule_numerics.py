"""Advanced pipeline schedules against eager single-process training (real gloo ranks, 8 micro-batches,
the GPT whose token embedding is tied to the LM head: a weight shared by the first and last stage)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, assert_parity, eager_reference, piper_worker, run_parity

pytestmark = pytest.mark.slow
S = piper.schedules


def _gpt(stages: int, directives: list) -> RunConfig:
    return RunConfig(model="gpt", model_kwargs={"layers": stages}, stages=stages, directives=directives)


def test_interleaved_1f1b_2_ranks_2_virtual_stages():
    res = run_parity(_gpt(4, [*S.round_robin(2, 2), piper.split(8), *S.interleaved_1f1b(2, 2, 8)]), 2)
    assert "F2.mb0" in res[0]["program"] and "F3.mb0" in res[1]["program"]  # two stages per rank


@pytest.mark.parametrize("ranks", [2, 4])
def test_zb_h1(ranks):
    res = run_parity(_gpt(ranks, [*piper.pipeline(ranks), piper.split(8), *S.zb_h1(ranks, 8)]), ranks)
    assert "BI" in res[-1]["program"] and "BW" in res[-1]["program"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_zbv(ranks):
    run_parity(_gpt(2 * ranks, [piper.split(8), *S.zbv(ranks, 8)]), ranks)


@pytest.mark.parametrize("ranks", [2, 4])
def test_dualpipe_v(ranks):
    run_parity(_gpt(2 * ranks, [piper.split(8), *S.dualpipe_v(ranks, 8)]), ranks)


class _RecordedSide:
    """CPU stand-in for ``executor.SideStream``: logs what the executor asks of the second stream. Waits
    here block the host (gloo), as on one GPU shared by several ranks, so the executor only puts partners
    whose input has arrived on it."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def fork(self) -> None:
        self.log.append("fork")

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        self.log.append("enter")
        yield
        self.log.append("exit")

    def join(self) -> None:
        self.log.append("join")


def _two_stream_worker(rank: int, world: int, cfg: RunConfig) -> dict[str, Any]:
    from piper_compile.runtime import executor

    log: list[str] = []
    executor.side_stream_for = lambda device, enabled: _RecordedSide(log) if enabled else None
    out = piper_worker(rank, world, cfg)
    out["side_log"] = log
    return out


TWO_STREAMS = {
    "dualpipe_v": (lambda: _gpt(4, [piper.split(8), *S.dualpipe_v(2, 8)]), 2),
    "zbv": (lambda: _gpt(4, [piper.split(8), *S.zbv(2, 8)]), 2),
    "pp2_1f1b": (lambda: _gpt(2, [*piper.pipeline(2), piper.split(4), *S.one_f_one_b(2, 4)]), 2),
    "pp2_x_dp2_zero3": (lambda: _gpt(2, [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(4),
                                         *S.one_f_one_b(2, 4), piper.replicate({"PP": "*"}, zero=3)]), 4),
}


@pytest.mark.parametrize("case", sorted(TWO_STREAMS))
def test_overlap_partners_on_a_second_stream(case, monkeypatch):
    """The CUDA two-stream path of overlap partners, driven on CPU with waits that block the host, as on
    ranks sharing one GPU over gloo: a pair forks the side stream, runs the partner inside it and joins
    before the partner's frees; the run finishes and training matches eager. (The first GPU run hung in
    exactly these three cases: a partner was started on the side stream before its input had arrived, and
    its blocking wait held the rank before the step its peer was waiting for; the PIPER_TIMEOUT below makes
    such a deadlock fail in seconds, naming the instruction.) Every transfer goes through host buffers
    as a shared GPU's do (``PIPER_HOST_STAGING=always``)."""
    monkeypatch.setenv("PIPER_TIMEOUT", "30")
    monkeypatch.setenv("PIPER_HOST_STAGING", "always")
    make, world = TWO_STREAMS[case]
    cfg = make()
    results = run_local(_two_stream_worker, world, cfg, timeout_s=300)
    assert_parity(results, eager_reference(cfg, world))
    assert results[0]["stats"].reordered > 0  # rank 0 holds overlap partners (a V's slots, 1F1B's B|F pairs)
    for r in results:
        log = r["side_log"]
        assert log == ["fork", "enter", "exit", "join"] * (len(log) // 4)
        assert len(log) >= 4 * r["stats"].reordered  # every reordering of the last step went through it


def test_torch_pipelining_zbv_csv_runs_in_piper(tmp_path):
    """A schedule written by torch.distributed.pipelining (ScheduleZBVZeroBubble._dump_csv) loads as
    piper directives and trains to the same numbers as eager."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        stages = [PipelineStage(torch.nn.Linear(4, 4), i, 4, torch.device("cpu")) for i in (0, 3)]
        ScheduleZBVZeroBubble(stages, n_microbatches=8, loss_fn=lambda o, t: o.sum())._dump_csv(str(tmp_path / "z.csv"))
    finally:
        dist.destroy_process_group()
    run_parity(_gpt(4, [piper.split(8), *S.read_csv(tmp_path / "z.csv")]), 2)


def test_zbv_with_inductor_codegen():
    """BI/BW segments compile with Inductor (no tuple of a multi-output op crosses the BI/BW cut)."""
    cfg = _gpt(4, [piper.split(4), *S.zbv(2, 4)])
    cfg.codegen = "inductor"
    res = run_parity(cfg, 2, rtol=1e-4, atol=1e-5)
    assert [r["fallbacks"] for r in res] == [[], []]  # every segment compiled by Inductor


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zbv_x_dp2_zero(zero):
    """PP2 x DP2 (4 ranks) under ZBV with ZeRO: weight gradients computed in a BI segment (layer norms,
    whose one backward op yields the input and the weight gradients) are reduced and sharded like the
    BW ones (they once were left out of every ZeRO bucket, so each replica kept its own)."""
    groups = [[0, 1], [2, 3]]
    res = run_parity(_gpt(4, [piper.split(4), *S.zbv(2, 4, groups=groups), piper.replicate({"PP": "*"}, zero=zero)]), 4)
    assert all(r["collectives"]["grad"] >= 1 for r in res)


def _slowed_worker(rank: int, world: int, cfg: RunConfig, slow_rank: int, window: int) -> dict[str, Any]:
    """A rank of a run in which ``slow_rank`` computes 10 ms slower per segment, so its neighbour's
    inputs arrive late and that rank's reorder window has waits to fill."""
    import os
    import time

    from piper_compile.codegen.compile import CompiledSegment

    os.environ["PIPER_REORDER_WINDOW"] = str(window)
    if rank == slow_rank:
        call = CompiledSegment.__call__

        def slow(self: CompiledSegment, args: list[Any], *rest: Any, **kw: Any) -> list[Any]:
            time.sleep(0.01)
            return call(self, args, *rest, **kw)

        CompiledSegment.__call__ = slow  # type: ignore[method-assign]
    return piper_worker(rank, world, cfg)


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_reorder_window_fills_waits_with_later_steps_bitwise(slow_rank):
    """ZBV with a slow neighbour: the waiting rank runs the other stage's deferred weight-gradient steps
    while its input is in flight; training matches eager and is bitwise the same as with the window off
    (gradients and the loss are summed in program order)."""
    cfg = _gpt(4, [piper.split(8), *S.zbv(2, 8)])
    on = run_local(_slowed_worker, 2, cfg, slow_rank, 8)
    off = run_local(_slowed_worker, 2, cfg, slow_rank, 0)
    assert_parity(on, eager_reference(cfg, 2))
    waiting = 1 - slow_rank
    assert on[waiting]["stats"].filled > 0, f"rank {waiting} waited for rank {slow_rank} but ran nothing meanwhile"
    assert all(r["stats"].filled == 0 for r in off)
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), f"parameter #{k} differs with the window on"
