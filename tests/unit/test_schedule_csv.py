"""Round trip with torch.distributed.pipelining's per-rank action CSV."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import piper_compile as piper
from piper_compile.errors import PiperDirectiveError
from piper_compile.testing.models import build_model

S = piper.schedules
_Action = pytest.importorskip("torch.distributed.pipelining.schedules")._Action

CASES = {
    "1f1b": lambda: [*piper.pipeline(3), *S.one_f_one_b(3, 6)],
    "zb_h1": lambda: [*piper.pipeline(2), *S.zb_h1(2, 4)],
    "interleaved": lambda: [*S.round_robin(2, 2), *S.interleaved_1f1b(2, 2, 4)],
    "zbv": lambda: S.zbv(2, 4),
    "dualpipe_v": lambda: S.dualpipe_v(2, 4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_and_torch_parses_every_cell(name, tmp_path):
    directives = CASES[name]()
    path = tmp_path / f"{name}.csv"
    S.write_csv(directives, path)
    back = S.read_csv(path)
    orders = [d for d in directives if d["op"] == "order"]
    assert [d for d in back if d["op"] == "order"] == orders
    places = sorted((d["filter"]["PP"], d["devices"]) for d in directives if d["op"] == "place")
    assert sorted((d["filter"]["PP"], d["devices"]) for d in back if d["op"] == "place") == places
    for row in S.to_rows(directives):
        for cell in row:
            action = _Action.from_str(cell)
            assert str(action) == cell  # torch reads our cells and prints them back identically


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(n: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _torch_schedule_csv(kind: str, stage_ids: tuple[int, ...], n_stages: int, m: int, path) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    stages = [PipelineStage(torch.nn.Linear(4, 4), i, n_stages, torch.device("cpu")) for i in stage_ids]
    cls = {"interleaved": ts.ScheduleInterleaved1F1B, "zbv": ts.ScheduleZBVZeroBubble}[kind]
    cls(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum())._dump_csv(str(path))


@pytest.mark.slow  # 6-26 s: keeps the fast subset under 5 min
@pytest.mark.parametrize("kind,stage_ids", [("interleaved", (0, 2)), ("zbv", (0, 3))])
def test_torch_written_schedule_plans_and_verifies_in_piper(kind, stage_ids, fake_world, tmp_path):
    fake_world(2)
    path = tmp_path / "torch.csv"
    _torch_schedule_csv(kind, stage_ids, 4, 4, path)
    dist.destroy_process_group()
    directives = S.read_csv(path)
    owners = {d["filter"]["PP"]: d["devices"][0] for d in directives if d["op"] == "place"}
    assert owners == ({0: 0, 1: 1, 2: 0, 3: 1} if kind == "interleaved" else {0: 0, 1: 1, 2: 1, 3: 0})
    model = build_model("gpt", layers=4)
    model.annotate_stages(4)
    batch = model.make_batch(8, torch.Generator().manual_seed(0))
    plan = piper.plan(model, *batch, directives=[piper.split(4), *directives], world_size=2)
    passes = {i.node.tag("PASS") for p in plan.programs for i in p.instrs if i.node.tag("PASS")}
    assert passes == ({"F", "B"} if kind == "interleaved" else {"F", "BI", "BW"})


def test_bad_cells_are_clear_errors():
    with pytest.raises(PiperDirectiveError, match="not a compute action"):
        S.read_rows([["0F0", "0X1"]])
    with pytest.raises(PiperDirectiveError, match="stage 0 appears on rank 0 and on rank 1"):
        S.read_rows([["0F0"], ["0B0"]])


@pytest.mark.parametrize("ranks,m", [(2, 4), (2, 8), (3, 6), (3, 9), (4, 8), (4, 11)])
def test_dualpipe_v_builder_is_torchs_dualpipe_v(ranks, m, fake_world, tmp_path):
    """With at least two micro-batches per stage, ``dualpipe_v`` builds exactly the per-rank order of
    torch's ScheduleDualPipeV (DeepSeek's phases), overlap slots and zero-bubble splits included."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    fake_world(ranks)
    stages = [PipelineStage(torch.nn.Linear(4, 4), i, 2 * ranks, torch.device("cpu")) for i in (0, 2 * ranks - 1)]
    ts.ScheduleDualPipeV(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum())._dump_csv(
        str(tmp_path / "torch.csv"))
    dist.destroy_process_group()
    theirs = [d for d in S.read_csv(tmp_path / "torch.csv") if d["op"] == "order"]
    assert [d for d in S.dualpipe_v(ranks, m) if d["op"] == "order"] == theirs
