"""Expert-parallel plans (``shard``), planned in-process for several ranks: the DAG's all-to-all chains,
the gradient reduction that skips expert shards, verification, and the errors for bad input."""
from __future__ import annotations

import pytest
import torch

import piper_compile as piper
from piper_compile.errors import PiperDirectiveError
from piper_compile.ir.dag import Kind
from piper_compile.ir.meta import ExpertShard
from piper_compile.ir.ops import ExpertA2A, ExpertCounts, ExpertStep, GradReduce, Segment
from piper_compile.sim.shapes import Sizes
from piper_compile.sim.simulate import simulate_plan
from piper_compile.testing.models import build_model


def _plan(directives: list, world: int = 2, model: str = "moe", **kw: object) -> piper.StaticPlan:
    m = build_model(model, 0, **kw)
    batch = m.make_batch(4, torch.Generator().manual_seed(0))  # type: ignore[operator]
    return piper.plan(m, *batch, directives=directives, world_size=world)


def _a2a_costs(p: piper.StaticPlan) -> dict[str, float]:
    """Rank 0's all-to-alls (counts exchanges included) -> their time at 1 GB/s without latency."""
    from piper_compile.sim.cost import FlopCost

    cost = FlopCost(bytes_per_s=1e9, latency_s=0.0)
    cost.bind(p.dag)
    return {ins.node.name: cost.duration(ins, 0) for ins in p.programs[0].instrs if ins.node.kind is Kind.ALL_TO_ALL}


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
    rows_bytes = 2 * 8 * 2 * 16 * 4
    costs = _a2a_costs(p)
    for ins in p.programs[0].instrs:
        if isinstance(ins.node.op, ExpertCounts):  # a few integers: latency only
            assert costs[ins.node.name] < 0.01 * 0.75 * rows_bytes / 1e9
        elif isinstance(ins.node.op, ExpertA2A):
            assert costs[ins.node.name] == pytest.approx(0.75 * rows_bytes / 1e9)
    assert sum(isinstance(op, ExpertCounts) for op in (i.node.op for i in p.programs[0].instrs)) == 2  # one per forward mb


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


def test_a_load_sizes_the_rows_an_experts_rank_receives_and_their_time():
    """``shard(load=1.5)``: the busiest rank receives 1.5x balanced routing's rows. The plan holds 1.5x the
    dispatched rows (forward and backward) and the experts' outputs, keeps the combined rows (each token's
    own slots, back at its rank) as they were, holds more while the experts step runs, and the simulator
    charges the all-to-alls and the experts step 1.5x."""
    base = _plan([piper.split(2), piper.replicate(), piper.shard({"EP": 0})])
    skew = _plan([piper.split(2), piper.replicate(), piper.shard({"EP": 0}, load=1.5)])
    held = {}  # node -> (bytes of its first output, what it holds while it runs)
    for name, p in (("base", base), ("skew", skew)):
        sizes = Sizes.from_dag(p.dag)
        held[name] = {n.name: (n.op.allocates(n, sizes)[0][1], n.op.transient(n, sizes))
                      for n in p.dag.nodes.values() if isinstance(n.op, (ExpertA2A, ExpertStep))}
    assert held["base"].keys() == held["skew"].keys()
    for node, (rows, transient) in held["base"].items():
        role = base.dag.nodes[node].op.role
        scaled = role in ("dispatch", "experts")  # what the experts' side receives and computes on
        assert rows > 0 and held["skew"][node][0] == (int(1.5 * rows) if scaled else rows), node
        if role == "experts":
            assert held["skew"][node][1] > transient > 0, node
    b, s = base.memory[0].figures, skew.memory[0].figures
    assert s.peak_activations > b.peak_activations and s.peak_held > b.peak_held
    cb, cs = _a2a_costs(base), _a2a_costs(skew)
    assert set(cb) == set(cs)
    for name in cb:  # the rows' all-to-alls 1.5x; the counts exchange (a few integers) as it was
        factor = 1.5 if isinstance(skew.dag.nodes[name].op, ExpertA2A) else 1.0
        assert cs[name] == pytest.approx(factor * cb[name], rel=1e-6), name
    steps = {n.name: n.op for n in skew.dag.of_kind(Kind.COMPUTE) if n.op.NAME == "expert_step"}
    assert steps and all(op.load == 1.5 for op in steps.values())
    assert all(n.op.load == 1.5 for n in skew.dag.of_kind(Kind.ALL_TO_ALL) if isinstance(n.op, ExpertA2A))
    assert simulate_plan(skew).step_time > simulate_plan(base).step_time


@pytest.mark.parametrize("load, match", [(0.5, "at least 1; got 0.5"), ("big", "must be a number >= 1"),
                                         (True, "must be a number >= 1"), (float("nan"), "at least 1"),
                                         (3, "load 3.0 is more rows than a rank can receive")])
def test_a_bad_load_is_a_directive_error(load, match):
    with pytest.raises(PiperDirectiveError, match=match):
        _plan([piper.replicate(), {"op": "shard", "filter": {"EP": 0}, "load": load}])


def test_a_step_over_the_planned_load_is_measured_and_warned_once_per_layer(caplog):
    from piper_compile.runtime import expert

    def route(recv: list[int]) -> expert.Route:
        e = torch.empty(0, dtype=torch.long)
        return expert.Route(e, e, tokens=8, top_k=2, send_splits=[8, 8], recv_splits=recv, local_perm=e,
                            local_inv=e, local_counts=recv)

    expert._warned.discard("moe.test")
    with caplog.at_level("WARNING", logger="piper_compile"):
        assert expert.check_load(route([8, 9]), 1.0, "moe.test") == pytest.approx(17 / 16)  # within 10%: quiet
        assert not caplog.records
        assert expert.check_load(route([12, 12]), 1.0, "moe.test") == 1.5
        assert expert.check_load(route([12, 13]), 1.0, "moe.test") == pytest.approx(25 / 16)
        assert expert.check_load(route([12, 12]), 1.5, "moe.other") == 1.5  # as planned: quiet
    assert len(caplog.records) == 1, caplog.records
    msg = caplog.records[0].getMessage()
    assert msg.startswith("piper: expert-parallel layer moe.test received 24 rows") and "load=1.50" in msg, msg
