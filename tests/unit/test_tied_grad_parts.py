"""A tied weight's gradient under pipelining (planning only, no processes): each holder stage accumulates
its own part over the micro-batches and the parts are exchanged once per step -- no gradient part
crosses stages per micro-batch (``capture/grad_parts.py``, ``passes/lower.py: _exchange_parts``)."""
from __future__ import annotations

import functools

import pytest
import torch

import piper_compile as piper
from piper_compile.ir.dag import Kind
from piper_compile.ir.ops import RecvPart
from piper_compile.sim.shapes import Sizes
from piper_compile.testing.models import build_model

S = piper.schedules
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CFG = {"dim": 32, "heads": 4, "layers": 4, "seq": 16, "vocab": 512}
TIED = "wte.weight"


def _plan(directives: list, stages: int = 2, world: int = 2, m: int = 4) -> piper.StaticPlan:
    torch._dynamo.reset()
    model = build_model("gpt", **CFG)
    model.annotate_stages(stages)  # type: ignore[operator]
    x, y = model.make_batch(2 * m, torch.Generator().manual_seed(0))  # type: ignore[operator]
    return piper.plan(model, x, y, directives=[piper.split(m), *directives], world_size=world,
                      options={"optimizer": ADAMW})


def _gradient_sends(plan: piper.StaticPlan) -> tuple[list[str], list[str], list[str]]:
    """(SENDs of a value some compute step accumulates as a gradient, part sends, finished-gradient sends)."""
    grad_values = {v for n in plan.dag.of_kind(Kind.COMPUTE) for v, _ in n.op.grad_outputs()}
    sends = list(plan.dag.of_kind(Kind.SEND))
    per_mb = [n.name for n in sends if set(n.inputs) & grad_values]
    parts = [n.name for n in sends if n.op.state == TIED and n.op.msg.startswith("part:")]  # type: ignore[attr-defined]
    final = [n.name for n in sends if n.op.state == TIED and n.op.msg.startswith("grad:")]  # type: ignore[attr-defined]
    return per_mb, parts, final


@pytest.mark.slow  # ~4 s: keeps the fast subset under 5 min
def test_pp2_exchanges_the_tied_gradient_parts_once_per_step():
    plan = _plan([*piper.pipeline(2), *S.one_f_one_b(2, 4)])
    per_mb, parts, final = _gradient_sends(plan)
    assert per_mb == []  # no gradient part crosses stages per micro-batch
    assert len(parts) == 1 and len(final) == 1  # last stage -> stage 0 once, the sum back once
    recvs = [n for n in plan.dag.of_kind(Kind.RECV) if isinstance(n.op, RecvPart)]
    assert [n.devices for n in recvs] == [(0,)]
    # both stages write their own part of the gradient (accumulated over the micro-batches)
    writers = {n.devices for n in plan.dag.of_kind(Kind.COMPUTE) if TIED in {f for _, f in n.op.grad_outputs()}}
    assert writers == {(0,), (1,)}
    # every weight-sized message of the step: the part and the finished gradient, nothing per micro-batch
    sizes = Sizes.from_dag(plan.dag)
    big = [n.name for n in plan.dag.of_kind(Kind.SEND) if sizes.messages[n.op.msg] >= sizes.params[TIED]]  # type: ignore[attr-defined]
    assert sorted(big) == sorted(parts + final)
    prog = {p.rank: [i.short() for i in p.instrs] for p in plan.programs}
    assert prog[1].index(f"SEND.part:{TIED}.r1->r0") > max(i for i, s in enumerate(prog[1]) if s.startswith("B"))
    assert prog[0].index(f"RECV.part:{TIED}.r1<-r1") > max(i for i, s in enumerate(prog[0]) if s.startswith("B"))


@pytest.mark.slow  # 6-26 s: keeps the fast subset under 5 min
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_other_schedules_exchange_once(schedule: str):
    plan = _plan([*piper.pipeline(2), *getattr(S, schedule)(2, 4)])
    per_mb, parts, final = _gradient_sends(plan)
    assert per_mb == [] and len(parts) == 1 and len(final) == 1


def test_pp2_x_dp2_zero3_exchanges_per_replica_pair():
    plan = _plan([*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.05),
                  *S.one_f_one_b(2, 4)], world=4)
    per_mb, parts, final = _gradient_sends(plan)
    assert per_mb == [] and len(parts) == 1 and len(final) == 1  # one SPMD pair over both replicas
    # the holder that completes the sum reduces it over its replicas after the parts came in; the other
    # holder does not reduce its part (it is summed into the completing holder's gradient)
    reduce_of = [n for n in plan.dag if n.kind is Kind.ALL_REDUCE and TIED in getattr(n.op, "params", ())]
    assert [n.devices for n in reduce_of] == [(0, 2)]
    recv = next(n for n in plan.dag.of_kind(Kind.RECV) if isinstance(n.op, RecvPart))
    assert recv.name in plan.dag.predecessors()[reduce_of[0].name]


@pytest.mark.slow  # slow: keeps the fast subset under 5 min
def test_dualpipe_v_holds_both_ends_on_one_rank_and_exchanges_nothing():
    plan = _plan(S.dualpipe_v(2, 4), stages=4)
    per_mb, parts, final = _gradient_sends(plan)
    assert per_mb == [] and parts == [] and final == []


def test_the_roots_receive_buffer_is_counted_until_the_step_that_waits_for_it():
    plan = _plan([*piper.pipeline(2), *S.one_f_one_b(2, 4)])
    sizes = Sizes.from_dag(plan.dag)
    prog = next(p for p in plan.programs if p.rank == 0)
    at = next(i for i, ins in enumerate(prog.instrs) if isinstance(ins.node.op, RecvPart))
    recv = prog.instrs[at].node
    assert recv.op.allocates(recv, sizes) == [(f"held:{recv.name}", sizes.params[TIED], False)]
    # a later step waits for it: the memory walk frees the buffer there (the runtime once it is added in)
    assert any(recv.name in ins.waits for ins in prog.instrs[at + 1:])
