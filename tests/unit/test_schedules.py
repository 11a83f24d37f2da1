"""Shapes of the GPipe and 1F1B schedule builders for many (stages, micro-batches)."""
from __future__ import annotations

import itertools

import pytest

from piper_compile import PiperDirectiveError, schedules
from piper_compile.directives.spec import Order, parse_directives
from piper_compile.schedules.builders import stage_sequence as _stage_sequence


def stage_sequence(kind: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """``(PASS, MB)`` steps of one stage from the library's builder (steps are (pass, stage, mb))."""
    return [(p, mb) for p, _, mb in _stage_sequence(kind, stage, stages, microbatches)]


SHAPES = list(itertools.product(range(1, 9), range(1, 13)))
BUILDERS = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b}


def _sequence(order: dict, stage: int, tag: str = "PP", mb_tag: str = "MB") -> list[tuple[str, int]]:
    """The (PASS, MB) steps of one order directive, checking every filter names ``stage``."""
    assert order["op"] == "order"
    out = []
    for group in order["filters"]:
        assert len(group) == 1, group  # GPipe/1F1B have no overlap slots
        (flt,) = group
        assert set(flt) == {tag, mb_tag, "PASS"}
        assert flt[tag] == stage
        out.append((flt["PASS"], flt[mb_tag]))
    return out


def _in_flight(seq: list[tuple[str, int]]) -> list[int]:
    live: set[int] = set()
    counts = []
    for p, mb in seq:
        if p == "F":
            live.add(mb)
        else:
            live.discard(mb)
        counts.append(len(live))
    return counts


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_every_step_once_and_f_before_b(kind: str, stages: int, microbatches: int) -> None:
    orders = BUILDERS[kind](stages, microbatches)
    assert len(orders) == stages
    for s, order in enumerate(orders):
        seq = _sequence(order, s)
        expected = {(p, m) for p in ("F", "B") for m in range(microbatches)}
        assert len(seq) == 2 * microbatches and set(seq) == expected
        for m in range(microbatches):
            assert seq.index(("F", m)) < seq.index(("B", m)), (s, m, seq)
        # micro-batches go through each pass in order
        assert [m for p, m in seq if p == "F"] == list(range(microbatches))
        assert [m for p, m in seq if p == "B"] == list(range(microbatches))
        assert seq == stage_sequence(kind, s, stages, microbatches)


@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_one_f_one_b_bounds_in_flight_microbatches(stages: int, microbatches: int) -> None:
    for s, order in enumerate(schedules.one_f_one_b(stages, microbatches)):
        peak = max(_in_flight(_sequence(order, s)))
        assert peak <= stages - s, (s, _sequence(order, s))
        # and it does use the whole bound when there are enough micro-batches (no needless bubble)
        assert peak == min(stages - s, microbatches)


@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_one_f_one_b_steady_state_alternates(stages: int, microbatches: int) -> None:
    for s, order in enumerate(schedules.one_f_one_b(stages, microbatches)):
        seq = _sequence(order, s)
        warmup = min(stages - s - 1, microbatches)
        assert seq[:warmup] == [("F", m) for m in range(warmup)]
        steady = seq[warmup:warmup + 2 * (microbatches - warmup)]
        assert [p for p, _ in steady] == ["F", "B"] * (microbatches - warmup)


@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_gpipe_all_forwards_before_all_backwards(stages: int, microbatches: int) -> None:
    for s, order in enumerate(schedules.gpipe(stages, microbatches)):
        seq = _sequence(order, s)
        assert [p for p, _ in seq] == ["F"] * microbatches + ["B"] * microbatches
        assert max(_in_flight(seq)) == microbatches


def test_last_stage_of_1f1b_never_holds_more_than_one() -> None:
    order = schedules.one_f_one_b(4, 8)[-1]
    assert max(_in_flight(_sequence(order, 3))) == 1


def test_custom_tags() -> None:
    orders = schedules.one_f_one_b(2, 3, tag="STAGE", mb_tag="CHUNK")
    assert _sequence(orders[1], 1, tag="STAGE", mb_tag="CHUNK")[:2] == [("F", 0), ("B", 0)]


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_schedules_parse_as_order_directives(kind: str) -> None:
    parsed = parse_directives(BUILDERS[kind](3, 4))
    assert all(isinstance(d, Order) for d in parsed)
    assert [d.index for d in parsed] == [0, 1, 2]
    assert parsed[2].filters[0] == ({"PP": 2, "MB": 0, "PASS": "F"},)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("stages,microbatches", [(0, 4), (-1, 4), (2, 0), (2, -3), ("2", 4), (2, "4"), (2.0, 4),
                                                 (2, 1.5), (None, 4), (2, None), (True, 4), (2, True)])
def test_invalid_counts_raise(kind: str, stages: object, microbatches: object) -> None:
    with pytest.raises(PiperDirectiveError) as ei:
        BUILDERS[kind](stages, microbatches)  # type: ignore[arg-type]
    msg = str(ei.value)
    assert msg.startswith("piper:") and "Fix:" in msg
    assert ("stages" in msg) or ("microbatches" in msg)



def _plan(kind: str, **options: object):
    import torch

    import piper_compile as piper
    from piper_compile.testing.models import build_model

    model = build_model("mlp", dim=8, depth=4)
    model.annotate_stages(4 if kind != "zb_h1" else 2)
    batch = model.make_batch(8, torch.Generator().manual_seed(0))
    sched = {"zbv": lambda: piper.schedules.zbv(2, 4), "dualpipe_v": lambda: piper.schedules.dualpipe_v(2, 4),
             "zb_h1": lambda: [*piper.pipeline(2), *piper.schedules.zb_h1(2, 4)]}[kind]()
    return piper.plan(model, *batch, directives=[piper.split(4), *sched], world_size=2, options=options)


def test_overlap_partners_of_a_dualpipe_v_program() -> None:
    """The plan records the second step of a DualPipeV overlap slot as the first one's partner (the
    runtime may run it first when the first one's input is late): partners exist, are shown as a slot
    in the program's text, are independent, and never both accumulate gradients (numerics unchanged)."""
    plan = _plan("dualpipe_v")
    for prog in plan.programs:
        at = prog.positions()
        partners = {k: at[i.partner] for k, i in enumerate(prog.instrs) if i.partner}
        assert partners, prog.to_text()
        for a, b in partners.items():
            i, j = prog.instrs[a], prog.instrs[b]
            assert f"{i.short()}|{j.short()}" in prog.to_text().splitlines()[0]
            assert not (set(i.node.outputs) & set(j.node.inputs))
            assert not (i.node.op.grad_outputs() and j.node.op.grad_outputs())


@pytest.mark.parametrize("kind", ["zbv", "zb_h1", "dualpipe_v"])
def test_reorder_window_candidates_are_independent(kind: str) -> None:
    """Every filler the plan records for a step ``pos`` (run while it waits) is a sink (its results only
    accumulate into gradients or the loss), reads nothing produced by ``pos`` or the
    instructions it jumps, adds into no gradient they add into, needs only communication issued before
    ``pos`` (its own waits and the producers of its inputs, even where an earlier consumer holds the
    wait), and jumps only compute, activation traffic, all-to-alls and per-use gathers. DualPipeV (no
    split backward) is here for the ``needs`` checks."""
    from piper_compile.ir.dag import Kind
    from piper_compile.plan.reorder import accumulates, needs

    plan, narrow = _plan(kind), _plan(kind, reorder_window=1)
    fillers_found: list[str] = []
    for prog, prog1 in zip(plan.programs, narrow.programs):
        instrs = prog.instrs
        need = needs(prog)
        source = {v: i.name for i in instrs if i.is_async for v in i.node.outputs}
        at = prog.positions()
        for k, n in need.items():
            assert set(instrs[k].waits) <= set(n)
            assert {source[v] for v in instrs[k].node.inputs if v in source} <= set(n)
        for pos, ins in enumerate(instrs):
            if ins.node.kind is not Kind.COMPUTE or not ins.waits:
                assert not ins.fillers
                continue
            for name, after in ins.fillers:
                k, ran = at[name], {at[a] for a in after}
                assert ran <= {at[ins.partner] if ins.partner else -1} | {at[f] for f, _ in ins.fillers}
                assert all(pos < m < k for m in ran)
                assert k > pos and instrs[k].node.kind is Kind.COMPUTE
                assert accumulates(instrs[k]) and not set(instrs[k].node.outputs) & {  # a sink
                    v for i in instrs for v in i.node.inputs}
                between = [instrs[m] for m in range(pos, k) if m not in ran]  # what it jumps
                assert not {v for i in between for v in i.node.outputs} & set(instrs[k].node.inputs)
                assert not set().union(*(accumulates(i) for i in between)) & accumulates(instrs[k])
                assert all(at[w] < pos for w in need[k])
                assert all(i.node.kind in (Kind.COMPUTE, Kind.SEND, Kind.RECV) for i in between[1:])
                fillers_found.append(instrs[k].node.name)
                assert instrs[k].node.name in prog.to_text()
            computes_after = [instrs[k].name for k in range(pos + 1, len(instrs)) if instrs[k].node.kind is Kind.COMPUTE]
            partner = [ins.partner] if ins.partner else []
            window1 = [c for c in computes_after if c not in partner][:1]
            assert {f for f, _ in prog1.instrs[pos].fillers} <= set(window1)  # the window
    assert not any(i.fillers for p in _plan(kind, reorder_window=0).programs for i in p.instrs)
    if kind == "zbv":  # a deferred weight-gradient step of the other stage can fill a wait
        assert any("BW" in name for name in fillers_found), fillers_found
    if kind == "zb_h1":  # one stage per rank: its weight-gradient steps all add into the same weights
        assert fillers_found == []
    if kind != "zb_h1":  # a filler that reads what the overlap partner produces runs only after it
        assert any(after for p in plan.programs for i in p.instrs for _, after in i.fillers)


def test_verifier_rejects_a_recorded_reordering_that_would_deadlock() -> None:
    """A program whose recorded filler (or partner) needs communication the rank issues only after the
    step it would jump: run there it would wait forever. The verifier refuses it, naming both steps."""
    import dataclasses

    from piper_compile.errors import PiperPlanError
    from piper_compile.plan.reorder import needs
    from piper_compile.plan.verifier import verify_programs

    plan = _plan("zbv")
    verify_programs(plan.programs)  # as planned: fine
    prog = plan.programs[0]
    need = needs(prog)
    at = prog.positions()
    # a compute step that waits, and a later compute step needing communication issued after it
    pos, late = next((p, k) for p in need for k in need if k > p and prog.instrs[p].waits
                     and any(at[w] > p for w in need[k]))
    for how in ("fillers", "partner"):
        bad = dataclasses.replace(prog, instrs=list(prog.instrs))
        value = ((prog.instrs[late].name, ()),) if how == "fillers" else prog.instrs[late].name
        bad.instrs[pos] = dataclasses.replace(prog.instrs[pos], **{how: value})
        with pytest.raises(PiperPlanError, match="would wait forever \\(deadlock\\)") as e:
            verify_programs([bad, *plan.programs[1:]])
        assert prog.instrs[late].name in str(e.value) and prog.instrs[pos].short() in str(e.value)


@pytest.mark.parametrize("kind", ["zbv", "dualpipe_v"])
def test_simulator_makes_the_recorded_reorderings(kind: str) -> None:
    """The simulator times the program the plan records, reorderings included, by the executor's rule:
    with slow links a partner or filler runs ahead of a step whose input is late, only once the
    communication it needs has completed, and never later than that step; the step is no slower than
    the same programs without their recorded reorderings, and the memory/spans still cover every step."""
    import dataclasses

    from piper_compile.plan.reorder import needs
    from piper_compile.sim import UniformCost, simulate

    plan = _plan(kind)
    cost = UniformCost(f=1.0, b=2.0, bi=1.0, bw=1.0, comm=3.0)
    sim = simulate(plan.programs, cost, plan.dag)
    plain = [dataclasses.replace(p, instrs=[dataclasses.replace(i, partner=None, fillers=()) for i in p.instrs])
             for p in plan.programs]
    base = simulate(plain, cost, plan.dag)
    assert sim.step_time <= base.step_time
    early = 0
    for prog in plan.programs:
        spans = {s.pos: s for s in sim.spans if s.rank == prog.rank and s.pos is not None and s.kind != "step"}
        assert set(spans) >= {k for k, i in enumerate(prog.instrs) if not i.is_async}
        at, need = prog.positions(), needs(prog)
        for pos, ins in enumerate(prog.instrs):
            for name in ([ins.partner] if ins.partner else []) + [f for f, _ in ins.fillers]:
                k = at[name]
                if spans[k].start < spans[pos].start:  # ran ahead of pos
                    early += 1
                    assert spans[k].end <= spans[pos].start
                    ends = [s.end for s in sim.spans if s.rank == prog.rank and s.name in need[k]]
                    assert len(ends) == len(need[k]) and all(e <= spans[k].start for e in ends)
    assert early > 0, "no recorded reordering ran early although inputs were late"
