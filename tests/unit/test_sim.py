"""The simulator, cost models, traces and grid pictures (one process, no training)."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile import PiperPlanError
from piper_compile.ir.dag import Kind, Node, make_tags
from piper_compile.ir.ops import GradReduce, Recv, Segment, Send
from piper_compile.plan.program import Instr, Program
from piper_compile.runtime.trace import NullRecorder, Recorder, flush_traces
from piper_compile.sim import (FlopCost, MeasuredCost, UniformCost, draw_grid, merge_traces, read_spans, simulate,
                               simulate_plan, write_trace)
from piper_compile.sim.grid import COLORS
from piper_compile.testing.models import build_model

_PLANS: dict[tuple, piper.StaticPlan] = {}


def pp_plan(p: int, m: int, schedule: str, model: str = "mlp", batch_per_mb: int = 2) -> piper.StaticPlan:
    """``p`` pipeline stages on ranks 0..p-1, ``m`` micro-batches, GPipe or 1F1B (cached per test run)."""
    key = (p, m, schedule, model, batch_per_mb)
    if key not in _PLANS:
        net = build_model(model, depth=p) if model == "mlp" else build_model(model, layers=p)
        net.annotate_stages(p)  # type: ignore[operator]
        batch = net.make_batch(batch_per_mb * m, torch.Generator().manual_seed(0))  # type: ignore[operator]
        order = piper.schedules.gpipe if schedule == "gpipe" else piper.schedules.one_f_one_b
        _PLANS[key] = piper.plan(net, *batch, directives=[*piper.pipeline(p), piper.split(m), *order(p, m)],
                                 world_size=p)
    return _PLANS[key]


# -- analytic pipeline bubbles ---------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 3), (4, 8), (4, 2)])
def test_uniform_cost_gives_analytic_bubble(schedule: str, p: int, m: int) -> None:
    plan = pp_plan(p, m, schedule)
    for f, b in [(1.0, 1.0), (1.0, 2.0)]:
        res = simulate_plan(plan, UniformCost(f=f, b=b, comm=0.0))
        assert res.step_time == pytest.approx((m + p - 1) * (f + b))
        assert res.bubble == pytest.approx((p - 1) / (m + p - 1))
        assert all(res.busy[r] == pytest.approx(m * (f + b)) for r in range(p))


def test_1f1b_holds_fewer_activations_than_gpipe_on_stage_0() -> None:
    gpipe = simulate_plan(pp_plan(4, 8, "gpipe"), UniformCost())
    one_f = simulate_plan(pp_plan(4, 8, "1f1b"), UniformCost())
    assert 0 < one_f.peak_activation_bytes[0] < gpipe.peak_activation_bytes[0]
    # stage 0 keeps one (2, 32) fp32 activation per micro-batch between its F and B: 1F1B has at most
    # p + 1 = 5 micro-batches in flight there, GPipe all m = 8. (p + 1: 1F1B's steady state pairs each B
    # with the next F as an overlap slot, and while B's gradient is late the executor runs that F first;
    # the prediction follows the order the executor runs, as the runtime measures.)
    # Both peak in B0.mb0, which holds the same intermediates while it runs (sim/segment_memory); GPipe
    # also holds the gradient of mb1 received ahead (2 received, 1F1B 1).
    assert gpipe.peak_activation_bytes[0] - one_f.peak_activation_bytes[0] == (8 - 5 + 1) * 2 * 32 * 4
    assert one_f.param_bytes == gpipe.param_bytes and one_f.param_bytes[0] == (32 * 32 + 32) * 4
    assert one_f.grad_bytes[0] == one_f.param_bytes[0]
    assert one_f.peak_bytes[0] == one_f.peak_activation_bytes[0] + 2 * one_f.param_bytes[0]


# -- execution model on hand-made programs ---------------------------------------------------------
def _compute(name: str, rank: int, pass_: str = "F", waits: tuple[str, ...] = ()) -> Instr:
    return Instr(Node(name, Segment(name), make_tags({"PASS": pass_, "MB": 0}), (rank,)), None, waits)


def _p2p(kind: Kind, msg: str, rank: int, peer: int) -> Instr:
    op = Send(msg, (peer,)) if kind is Kind.SEND else Recv(msg, (peer,))
    return Instr(Node(f"{kind.value}.{msg}", op, (), (rank,), "pp"), peer)


def test_p2p_rendezvous_and_fifo_queues() -> None:
    send, recv = Kind.SEND, Kind.RECV
    r0 = [_compute("F0", 0), _p2p(send, "x", 0, 1), _p2p(send, "y", 0, 1), _p2p(recv, "g", 0, 1),
          _compute("B0", 0, "B", waits=("RECV.g",))]
    r1 = [_p2p(recv, "x", 1, 0), _p2p(recv, "y", 1, 0), _compute("F1", 1, waits=("RECV.x", "RECV.y")),
          _compute("B1", 1, "B"), _p2p(send, "g", 1, 0)]
    res = simulate([Program(0, r0), Program(1, r1)], UniformCost(f=1, b=2, comm=0.5))
    at = {(s.rank, s.name): s for s in res.spans}
    assert (at[(0, "SEND.x")].end, at[(0, "SEND.y")].end) == (1.5, 2.0)  # y queues behind x on one channel
    assert at[(1, "F1")].start == 2.0 and at[(1, "B1")].end == 5.0
    assert at[(0, "RECV.g")].end == 5.5 and at[(0, "B0")].end == 7.5
    assert res.step_time == 7.5 and res.busy == {0: 3.0, 1: 3.0}
    assert res.bubble == pytest.approx(1 - 6 / 15)


def test_collective_starts_when_every_member_issued_it() -> None:
    ar = Instr(Node("AR.g", GradReduce("g", ()), (), (0, 1), "dp"))
    progs = [Program(0, [_compute("B0", 0, "B"), ar]), Program(1, [_compute("B1", 1, "F"), ar])]
    res = simulate(progs, UniformCost(f=1, b=3, comm=0.0, collective=0.25))
    assert res.step_time == 3.25 and res.rank_end == {0: 3.25, 1: 3.25}


def test_deadlock_raises_the_verifier_grid() -> None:
    r0 = [_p2p(Kind.RECV, "a", 0, 1), _compute("F0", 0, waits=("RECV.a",)), _p2p(Kind.SEND, "b", 0, 1)]
    r1 = [_p2p(Kind.RECV, "b", 1, 0), _compute("F1", 1, waits=("RECV.b",)), _p2p(Kind.SEND, "a", 1, 0)]
    with pytest.raises(PiperPlanError, match="deadlock"):
        simulate([Program(0, r0), Program(1, r1)], UniformCost())


# -- cost models -----------------------------------------------------------------------------------
def test_flop_cost_counts_matmuls_at_the_microbatch_size() -> None:
    plan = pp_plan(2, 4, "1f1b", batch_per_mb=3)  # local batch 12, micro-batch 3
    cost = FlopCost(flops_per_s=1e9, bytes_per_s=1e9)
    res = simulate_plan(plan, cost)
    assert cost.flops["F.PP0"] == 2 * 3 * 32 * 32  # one Linear(32, 32) on a (3, 32) micro-batch
    assert cost.flops["B.PP0"] == 2 * 3 * 32 * 32  # weight gradient only (the input needs none)
    assert cost.flops["B.PP1"] == 2 * 2 * 3 * 32 * 32  # weight and input gradients
    send = next(i for i in plan.programs[0].instrs if i.node.kind is Kind.SEND)
    assert cost.duration(send, 0) == pytest.approx(3 * 32 * 4 / 1e9)  # a (3, 32) fp32 activation
    assert res.step_time > 0 and 0 < res.bubble < 1


def test_flop_cost_counts_attention() -> None:
    cost = FlopCost()
    simulate_plan(pp_plan(2, 2, "1f1b", model="gpt"), cost)
    cfg: Any = build_model("gpt").cfg
    b, t, c = 2, cfg.seq, cfg.dim
    per_block = 2 * b * t * c * (3 * c + c + 4 * c + 4 * c) + 4 * b * t * t * c  # linears + QK^T and PV
    assert cost.flops["F.PP0"] == per_block
    assert cost.flops["F.PP1"] == per_block + 2 * b * t * c * cfg.vocab  # + the tied LM head
    assert cost.flops["B.PP0"] > cost.flops["F.PP0"]


def test_measured_cost_from_a_trace_reproduces_the_step(tmp_path: Path) -> None:
    plan = pp_plan(2, 4, "gpipe")
    first = simulate_plan(plan, UniformCost(f=1e-3, b=2e-3, update=1e-4))
    path = write_trace(first, tmp_path / "sim.json")
    cost = MeasuredCost.from_trace(path)
    assert cost.segments == pytest.approx({"F.PP0": 1e-3, "F.PP1": 1e-3, "B.PP0": 2e-3, "B.PP1": 2e-3})
    again = simulate_plan(plan, cost)
    assert again.step_time == pytest.approx(first.step_time)
    with pytest.raises(piper.PiperError, match="no measurement of segment"):
        simulate_plan(pp_plan(3, 3, "gpipe"), cost)
    fallback = MeasuredCost.from_trace(path, fallback=UniformCost(f=5e-3, b=5e-3))
    assert simulate_plan(pp_plan(3, 3, "gpipe"), fallback).step_time > 0


# -- traces and grids ------------------------------------------------------------------------------
def test_sim_trace_is_well_formed_with_send_recv_flows(tmp_path: Path) -> None:
    plan = pp_plan(2, 4, "1f1b")
    res = simulate_plan(plan, UniformCost(f=1e-3, b=2e-3, comm=1e-4))
    obj = json.loads(Path(write_trace(res, tmp_path / "t.json")).read_text())
    events = obj["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    n_instrs = sum(len(p.instrs) for p in plan.programs)
    assert len(spans) == n_instrs + 2  # + one step span per rank
    for e in spans:
        assert {"name", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0 and e["pid"] in (0, 1)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[(0, 0)] == "compute" and "pp_fwd:up" in names.values() and "pp_bwd:down" in names.values()
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    n_recv = sum(1 for p in plan.programs for i in p.instrs if i.node.kind is Kind.RECV)
    assert len(starts) == len(ends) == n_recv and starts.keys() == ends.keys()
    for fid, s in starts.items():
        assert s["pid"] != ends[fid]["pid"] and ends[fid]["ts"] >= s["ts"] and ends[fid]["bp"] == "e"
    back = read_spans(tmp_path / "t.json")
    assert sorted((s.rank, s.name, round(s.end, 9)) for s in back) == \
        sorted((s.rank, s.name, round(s.end, 9)) for s in res.spans)


def test_grid_svg_is_well_formed(tmp_path: Path) -> None:
    p, m = 3, 4
    res = simulate_plan(pp_plan(p, m, "1f1b"), UniformCost(f=1, b=2))
    root = ET.parse(draw_grid(res, tmp_path / "grid.svg")).getroot()
    assert root.tag.endswith("svg")
    rects = [r for r in root.iter() if r.tag.endswith("rect")]
    assert sum(r.get("fill") == COLORS["F"] for r in rects) == p * m + 1  # + the legend
    assert sum(r.get("fill") == COLORS["B"] for r in rects) == p * m + 1
    labels = [t.text for t in root.iter() if t.tag.endswith("text")]
    assert {"rank 0", "rank 1", "rank 2"} <= set(labels) and {"0", "1", "2", "3"} <= set(labels)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(piper.PiperError, match="matplotlib"):
            draw_grid(res, tmp_path / "grid.png")
    else:
        assert Path(draw_grid(res, tmp_path / "grid.png")).stat().st_size > 0


def test_recorder_is_a_noop_without_env_and_writes_rank_files_with_it(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    program = pp_plan(2, 2, "1f1b").programs[0]
    monkeypatch.delenv("PIPER_TRACE", raising=False)
    assert type(Recorder.from_env(program)) is NullRecorder
    monkeypatch.setenv("PIPER_TRACE", str(tmp_path))
    rec = Recorder.from_env(program)
    assert isinstance(rec, Recorder)
    for _ in range(2):  # drive the hooks the way the executor does
        rec.step_begin()
        for pos, ins in enumerate(program.instrs):
            for w in ins.waits:
                rec.complete(w, rec.now())
            rec.begin()
            rec.end(pos, ins, (None, ins, pos) if ins.is_async else None)
        rec.step_end()
    flush_traces()
    obj = json.loads((tmp_path / "rank0.json").read_text())
    assert obj["otherData"]["step"] == 2
    spans = read_spans(tmp_path)
    assert len(spans) == len(program.instrs) + 1
    assert all(s.end >= s.start for s in spans)
    merged = json.loads(Path(merge_traces(tmp_path)).read_text())
    assert sum(e["ph"] == "X" for e in merged["traceEvents"]) == len(spans)


def test_merge_traces_joins_per_rank_files_with_flows(tmp_path: Path) -> None:
    res = simulate_plan(pp_plan(2, 2, "1f1b"), UniformCost(comm=0.1))
    for r in (0, 1):
        write_trace([s for s in res.spans if s.rank == r], tmp_path / f"rank{r}.json")
    events = json.loads(Path(merge_traces(tmp_path)).read_text())["traceEvents"]
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert flows and len({e["id"] for e in flows}) * 2 == len(flows)
    assert re.search(r"rank 1", json.dumps(events))


def test_real_single_process_steps_write_a_trace_that_predicts_them(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPER_TRACE", str(tmp_path))
    model = build_model("mlp", depth=2)
    options: dict[str, Any] = {"directives": [piper.split(2)], "codegen": "eager"}
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options=options)
    batch = model.make_batch(8, torch.Generator().manual_seed(0))  # type: ignore[operator]
    for _ in range(3):
        step(*batch)
    flush_traces()
    spans = read_spans(tmp_path / "rank0.json")
    assert sorted(s.label for s in spans if s.kind == "COMPUTE") == ["B.mb0", "B.mb1", "F.mb0", "F.mb1"]
    assert [s.label for s in spans if s.kind == "STEP"] == ["step 3"]
    plan = piper.compiled_steps(step)[0].plans[False]
    res = simulate(plan.programs, MeasuredCost.from_trace(tmp_path), plan.dag)
    measured = next(s for s in spans if s.kind == "STEP").duration
    assert res.step_time == pytest.approx(measured, rel=0.5)
