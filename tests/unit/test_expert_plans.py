"""Expert-parallel plans (``shard``), planned in-process for several ranks: the DAG's all-to-all chains,
the gradient reduction that skips expert shards, verification, and the errors for bad input."""
from __future__ import annotations

import pytest
import torch

import piper_compile as piper
from piper_compile.errors import PiperDirectiveError
from piper_compile.ir.dag import Kind
from piper_compile.ir.meta import ExpertShard
from piper_compile.ir.ops import ExpertA2A, ExpertCounts, GradReduce, Segment
from piper_compile.sim.simulate import simulate_plan
from piper_compile.testing.models import build_model


def _plan(directives: list, world: int = 2, model: str = "moe", **kw: object) -> piper.StaticPlan:
    m = build_model(model, 0, **kw)
    batch = m.make_batch(4, torch.Generator().manual_seed(0))  # type: ignore[operator]
    return piper.plan(m, *batch, directives=directives, world_size=world)


def test_ep_chain_per_microbatch_and_no_reduction_of_expert_shards():
    p = _plan([piper.split(2), piper.replicate(), piper.shard({"EP": 0})])
    a2a = p.dag.of_kind(Kind.ALL_TO_ALL)
    # 2 micro-batches x ((dispatch, combine) x (forward, backward) + the forward's counts exchange)
    assert len(a2a) == 2 * 5
    assert {"counts" if isinstance(n.op, ExpertCounts) else n.op.role for n in a2a} == {"counts", "dispatch",
                                                                                          "combine"}
    assert all(isinstance(n.op, (ExpertCounts, ExpertA2A)) for n in a2a)
    # the counts have a group of their own (never queued behind rows in flight on the "ep" group)
    assert all(n.devices == (0, 1) and n.stream == ("ep_counts" if isinstance(n.op, ExpertCounts) else "ep")
               for n in a2a)
    for n in a2a:  # each forward dispatch reads its counts exchange's result
        if isinstance(n.op, ExpertA2A) and n.op.role == "dispatch" and n.tag("PASS") == "F":
            counts = [c for c in a2a if isinstance(c.op, ExpertCounts) and c.outputs[0] in n.inputs]
            assert len(counts) == 1 and counts[0].op.mb == n.op.mb, n.name
    reduced = {f for n in p.dag.of_kind(Kind.ALL_REDUCE) if isinstance(n.op, GradReduce) for f in n.op.params}
    assert not any(f.startswith("moe.w_") for f in reduced), reduced  # expert grads are local
    assert "moe.router.weight" in reduced and "inp.weight" in reduced
    upd = p.dag.of_kind(Kind.UPDATE)[0]
    assert set(upd.op.ep_params) == {"moe.w_gate", "moe.w_up", "moe.w_down"}
    assert p.dag.meta.ep_params["moe.w_gate"] == ExpertShard((0, 1), 4, "ep")
    text = p.programs[0].to_text()
    assert "dispatch" in text and "combine" in text


def test_ep_plan_simulates_and_costs_the_routed_rows():
    """The simulator charges each all-to-all for every (token, choice) row: micro-batch of 2 sequences x 8
    tokens, top-2, 16 features, fp32, of which 3/4 leave the rank on EP4."""
    from piper_compile.sim.cost import FlopCost

    p = _plan([piper.split(2), piper.replicate(), piper.shard({"EP": 0})], world=4)
    assert simulate_plan(p).step_time > 0
    cost = FlopCost(bytes_per_s=1e9, latency_s=0.0)
    cost.bind(p.dag)
    a2a = [i for i in p.programs[0].instrs if i.node.kind is Kind.ALL_TO_ALL]
    rows_bytes = 2 * 8 * 2 * 16 * 4
    for ins in a2a:
        if isinstance(ins.node.op, ExpertCounts):  # a few integers: latency only
            assert cost.duration(ins, 0) < 0.01 * 0.75 * rows_bytes / 1e9
        else:
            assert cost.duration(ins, 0) == pytest.approx(0.75 * rows_bytes / 1e9)
    assert sum(isinstance(ins.node.op, ExpertCounts) for ins in a2a) == 2  # one per forward micro-batch


def test_single_rank_shard_keeps_the_op():
    p = _plan([piper.shard({"EP": 0})], world=1)
    assert not p.dag.of_kind(Kind.ALL_TO_ALL)
    assert any(isinstance(n.op, Segment) and n.op.boundary == "moe_fwd" for n in p.dag.of_kind(Kind.COMPUTE))


def test_shard_without_moe_op_is_rejected():
    with pytest.raises(PiperDirectiveError, match="matches no MoE experts op"):
        _plan([piper.replicate(), piper.shard({})], model="mlp")


def test_experts_not_divisible_by_group():
    with pytest.raises(PiperDirectiveError, match="3 experts do not split evenly over 2 ranks"):
        _plan([piper.replicate(), piper.shard({"EP": 0})], experts=3)


def test_shard_devices_must_be_the_replica_group():
    with pytest.raises(PiperDirectiveError, match="expert parallelism shares the ranks"):
        _plan([piper.replicate(), piper.shard({"EP": 0}, devices=[0, 1])], world=4)


def test_shard_devices_outside_world():
    with pytest.raises(PiperDirectiveError, match="outside the world"):
        _plan([piper.replicate(), piper.shard({"EP": 0}, devices=[0, 7])])
