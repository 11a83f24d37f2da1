"""``shard_tensor`` plans and errors, planned in-process (no launch)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper
from piper_compile.ir.shard import ParamShard
from piper_compile.errors import PiperDirectiveError, PiperError
from piper_compile.ir.dag import Kind
from piper_compile.ir.ops import GradReduce, NormReduce, ParamGather, TpCollective
from piper_compile.testing.models import build_model

TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


def _plan(directives: list, world: int = 2, model: nn.Module | None = None, **options: object) -> piper.StaticPlan:
    m = model if model is not None else build_model("gpt", 0, layers=2)
    batch = m.make_batch(4, torch.Generator().manual_seed(0))  # type: ignore[operator]
    return piper.plan(m, *batch, directives=directives, world_size=world, options=options)


def test_tp_plan_all_reduces_and_local_shapes():
    p = _plan([piper.split(2), piper.shard_tensor(TP)])
    ars = [n for n in p.dag.of_kind(Kind.ALL_REDUCE) if isinstance(n.op, TpCollective)]
    assert len(ars) == 2 * 2 * 2 * 2  # micro-batches x layers x (fwd proj, out; bwd qkv, fc)
    assert all(n.op.subgroups == ((0, 1),) and n.stream == "tp" for n in ars)
    assert not [n for n in p.dag.of_kind(Kind.ALL_REDUCE) if isinstance(n.op, GradReduce)]  # one replica


def test_tp_shard_take_and_assemble_round_trip():
    full = torch.arange(24.0).view(12, 2)
    for spec in (ParamShard("w", 0, 3, 2), ParamShard("w", 0, 1, 2), ParamShard("w", 1, 1, 2)):
        pieces = [spec.take(full, r) for r in range(2)]
        assert pieces[0].shape == spec.local_shape(tuple(full.shape))
        assert torch.equal(spec.assemble(pieces), full)
    q0 = ParamShard("w", 0, 3, 2).take(full, 0)  # first half of each fused block (q, k, v)
    assert torch.equal(q0, torch.cat([full[0:2], full[4:6], full[8:10]]))


@pytest.mark.parametrize("spec", [ParamShard("w", 0, 3, 2), ParamShard("w", 0, 1, 3), ParamShard("w", 1, 1, 2)])
def test_tp_shard_boxes_tile_the_full_tensor(spec):
    """The boxes a checkpoint writes for each rank's piece: together every element of the full tensor once,
    each box the matching slice of the piece."""
    full = torch.arange(72.0).view(12, 6)
    seen = torch.zeros_like(full)
    for r in range(spec.size):
        piece = spec.take(full, r)
        boxes = spec.boxes(tuple(full.shape), r)
        assert len(boxes) == spec.parts
        for off, start, n in boxes:
            target = full.narrow(spec.dim, off[spec.dim], n)
            assert torch.equal(piece.narrow(spec.dim, start, n), target)
            seen.narrow(spec.dim, off[spec.dim], n).add_(1)
    assert torch.equal(seen, torch.ones_like(full))


class _FixedHeads(nn.Module):
    """Attention whose head reshape fixes the head count (``view(b, t, heads, 4)``, not ``-1``)."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads, c = heads, 4 * heads
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        return F.mse_loss(self.proj(a), y)

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        c = 4 * self.heads
        return torch.randn(n, 8, c, generator=gen), torch.randn(n, 8, c, generator=gen)


def test_fixed_head_count_is_rewritten_to_the_local_one():
    p = _plan([piper.shard_tensor({"qkv": "colwise:3", "proj": "rowwise"})], model=_FixedHeads())
    # the forward all-reduce after proj; x needs no gradient, so no backward one before qkv
    assert len([n for n in p.dag.of_kind(Kind.ALL_REDUCE) if isinstance(n.op, TpCollective)]) == 1


def test_head_count_that_does_not_split_gets_a_clear_error():
    """3 heads of 4 features: the 12 features split over 2 ranks, the heads do not."""
    with pytest.raises(PiperError, match=r"(?s)view.*z.view\(b, t, self.heads, 4\).*does not divide over 2 ranks"):
        _plan([piper.shard_tensor({"qkv": "colwise:3", "proj": "rowwise"})], model=_FixedHeads(heads=3))


def test_params_matching_no_linear_layer():
    with pytest.raises(PiperError, match=r"match no linear layer.*blocks.0.qkv"):
        _plan([piper.shard_tensor({"blocks.*.mlp": "colwise"})])


def test_indivisible_features():
    with pytest.raises(PiperError, match="do not split into"):
        _plan([piper.shard_tensor({"blocks.*.fc": "colwise"})], world=3)


@pytest.mark.parametrize("zero", [2, 3])
def test_tp_with_zero_2_and_3_is_rejected(zero):
    with pytest.raises(PiperDirectiveError, match=f"ZeRO-{zero} with shard_tensor.*use zero=1"):
        _plan([piper.replicate(zero=zero), piper.shard_tensor(TP, devices=[[0, 1], [2, 3]])], world=4,
              optimizer=torch.optim.AdamW)


def test_tp_zero1_shards_within_each_data_parallel_subgroup():
    """DP2 x TP2 ZeRO-1: buckets reduced over the data-parallel subgroups [0, 2] and [1, 3], and each
    bucket's updated shards all-gathered within each of them (one node per subgroup)."""
    p = _plan([piper.replicate(zero=1, bucket_mb=0.01), piper.shard_tensor(TP, devices=[[0, 1], [2, 3]])], world=4,
              optimizer=torch.optim.AdamW)
    ars = [n for n in p.dag.of_kind(Kind.ALL_REDUCE) if isinstance(n.op, GradReduce)]
    assert ars and all(n.op.level == 1 and n.op.subgroups == ((0, 2), (1, 3)) for n in ars)
    ags = [n for n in p.dag.of_kind(Kind.ALL_GATHER) if isinstance(n.op, ParamGather)]
    assert sorted(n.devices for n in ags) == sorted([(0, 2), (1, 3)] * len(ars))
    assert {n.op.bucket for n in ags} == {n.op.bucket for n in ars}


def test_tp_zero1_without_data_parallel_replicas_shards_nothing():
    """TP2 alone: every data-parallel subgroup is one rank, so zero=1 has no one to shard with."""
    p = _plan([piper.replicate(zero=1), piper.shard_tensor(TP)], optimizer=torch.optim.AdamW)
    assert not p.dag.of_kind(Kind.ALL_GATHER) and not p.dag.meta.zero
    assert not next(iter(p.dag.of_kind(Kind.UPDATE))).op.shards


def test_tp_with_clipping_plans_one_world_norm_all_reduce():
    p = _plan([piper.replicate(), piper.shard_tensor(TP, devices=[[0, 1], [2, 3]])], world=4,
              optimizer=torch.optim.AdamW, clip_grad_norm=1.0)
    norm = [n for n in p.dag.of_kind(Kind.ALL_REDUCE) if isinstance(n.op, NormReduce)]
    assert len(norm) == 1 and norm[0].devices == (0, 1, 2, 3)
    upd = next(iter(p.dag.of_kind(Kind.UPDATE)))
    assert (norm[0].name, upd.name) in p.dag.order_edges  # every rank clips before its update


def test_bad_sharding_kind_and_groups():
    with pytest.raises(PiperDirectiveError, match="colwise:N"):
        _plan([piper.shard_tensor({"blocks.*.fc": "diagonal"})])
    with pytest.raises(PiperDirectiveError, match="disjoint tensor-parallel groups"):
        _plan([piper.shard_tensor(TP, devices=[[0, 1], [1, 2]])], world=4)


def test_groups_must_partition_the_region():
    with pytest.raises(PiperDirectiveError, match="do not partition"):
        _plan([piper.replicate(), piper.shard_tensor(TP, devices=[[0, 1]])], world=4)


@pytest.mark.slow  # ~4 s: keeps the fast subset under 5 min
def test_graph_passes_are_named_timed_and_dumped(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """shard_tensor's transforms of Dynamo's graph run as named graph passes under the driver's rules:
    timed, the FX graph dumped after each with PIPER_DEBUG (here the split layers' markers show)."""
    from piper_compile.api import capture_step

    monkeypatch.setenv("PIPER_DEBUG", "1")
    m = build_model("gpt", 0, layers=1, dim=8, heads=2, vocab=16, seq=4)
    batch = m.make_batch(4, torch.Generator().manual_seed(0))
    step = capture_step(m, *batch, directives=[piper.shard_tensor(TP, sequence_parallel=True)], world_size=2)
    step.initial_dag(False)
    assert list(step.graph_timings)[:3] == ["specialize_floats", "shard_linears", "sequence_parallel"]
    err = capsys.readouterr().err
    after_tp = err.split("FX graph after shard_linears", 1)[1].split("FX graph after sequence_parallel", 1)[0]
    assert "piper.tp_allreduce" in after_tp, after_tp[:2000]  # the rowwise layers' marker
    assert "FX graph after sequence_parallel" in err
