"""Sequence-parallel ``shard_tensor`` plans (planned in-process, no launch): which collectives the
rewrite puts where, which gradients are reduced over the whole group, and its errors."""
from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import piper_compile as piper
from piper_compile.capture.sequence_parallel import split_sequence
from piper_compile.errors import PiperDirectiveError, PiperError
from piper_compile.ir.dag import Kind
from piper_compile.ir.ops import GradReduce, SequenceChunk, TpCollective
from piper_compile.testing.models import build_model

TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


def _plan(directives: list, world: int = 2, model: nn.Module | None = None, **options: object) -> piper.StaticPlan:
    m = model if model is not None else build_model("gpt", 0, layers=2)
    batch = m.make_batch(4, torch.Generator().manual_seed(0))  # type: ignore[operator]
    return piper.plan(m, *batch, directives=directives, world_size=world, options=options)


def _tp(p: piper.StaticPlan, kind: Kind) -> list:
    return [n for n in p.dag.of_kind(kind) if isinstance(n.op, TpCollective)]


@pytest.mark.slow  # 5 s: keeps the fast subset under 5 min
def test_gpt_sequence_parallel_collectives():
    """Per micro-batch, 2 layers: the first block's qkv reads the whole embedding (all-reduce of its input
    gradient, the residual stream is cut to this rank's chunk at the first add); then every row-parallel
    output is reduce-scattered and every column-parallel input all-gathered along dim 1; ln_f's output is
    gathered for the LM head. The backward mirrors each (reduce-scatter <-> all-gather, cut <-> gather)."""
    p = _plan([piper.split(2), piper.shard_tensor(TP, sequence_parallel=True)])
    per_mb = {kind: len(_tp(p, kind)) / 2 for kind in (Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.ALL_REDUCE)}
    # forward: AG fc0, qkv1, fc1 + gather(ln_f); backward: AG of proj0/out0/proj1/out1 grads + gather of the cut x
    assert per_mb == {Kind.ALL_GATHER: 4 + 5, Kind.REDUCE_SCATTER: 4 + 3, Kind.ALL_REDUCE: 1}
    assert all(n.op.dim == 1 and n.op.size == 2 for n in _tp(p, Kind.ALL_GATHER) + _tp(p, Kind.REDUCE_SCATTER))
    cuts = [n for n in p.dag.of_kind(Kind.COMPUTE) if isinstance(n.op, SequenceChunk)]
    assert len(cuts) == 2 * 2  # forward: the residual x; backward: ln_f's input gradient
    partial = {f for n in p.dag.of_kind(Kind.ALL_REDUCE) if ".sp." in n.name for f in n.op.params}
    assert partial == {"blocks.0.ln2.weight", "blocks.0.ln2.bias", "blocks.0.proj.bias", "blocks.0.out.bias",
                       "blocks.1.ln1.weight", "blocks.1.ln1.bias", "blocks.1.ln2.weight", "blocks.1.ln2.bias",
                       "blocks.1.proj.bias", "blocks.1.out.bias", "ln_f.weight", "ln_f.bias"}
    assert all(n.devices == (0, 1) and not n.op.subgroups for n in p.dag.of_kind(Kind.ALL_REDUCE)
               if ".sp." in n.name)  # summed over the whole tensor-parallel group


@pytest.mark.slow  # slow: keeps the fast subset under 5 min
def test_sequence_parallel_under_dp_reduces_partial_grads_over_all_ranks():
    p = _plan([piper.replicate(), piper.shard_tensor(TP, devices=[[0, 1], [2, 3]], sequence_parallel=True)],
              world=4)
    grads = [n for n in p.dag.of_kind(Kind.ALL_REDUCE) if isinstance(n.op, GradReduce)]
    assert {n.op.subgroups for n in grads if ".sp." not in n.name} == {((0, 2), (1, 3))}
    assert {n.op.subgroups for n in grads if ".sp." in n.name} == {None}


def test_norm_shared_by_whole_and_split_activations_goes_through_tp_copy():
    """The LayerNorm reads the whole input and the split residual: its gradient is partly partial, so
    its split uses get tp_copy (two more backward all-reduces) instead of the whole-group sum that
    ``out``'s bias (read only by the split stream) gets."""
    m = build_model("shared_norm", 0)
    p = _plan([piper.shard_tensor({"fc": "colwise", "out": "rowwise"}, sequence_parallel=True)], model=m)
    assert len(_tp(p, Kind.ALL_REDUCE)) == 1 + 2  # fc's input gradient; norm weight and bias
    partial = {f for n in p.dag.of_kind(Kind.ALL_REDUCE) if ".sp." in n.name for f in n.op.params}
    assert partial == {"out.bias"}


@pytest.mark.slow  # keeps the fast subset under 5 min
def test_simulation_and_text_of_sequence_parallel_plan():
    p = _plan([piper.split(2), piper.shard_tensor(TP, sequence_parallel=True)])
    text = p.text()
    assert "AG." in text and "RS." in text
    from piper_compile.sim.cost import UniformCost
    from piper_compile.sim.simulate import simulate

    res = simulate(p.programs, UniformCost(), p.dag)
    assert res.step_time > 0


def test_sequence_parallel_errors():
    with pytest.raises(PiperError, match="seq_dim=5"):
        _plan([piper.shard_tensor(TP, sequence_parallel=True, seq_dim=5)])
    with pytest.raises(PiperError, match="needs at least one rowwise layer"):
        split_sequence(fx.symbolic_trace(nn.Linear(4, 4)), [], 1, 2)
    with pytest.raises(PiperDirectiveError, match="seq_dim must be >= 0"):
        _plan([{"op": "shard_tensor", "params": TP, "sequence_parallel": True, "seq_dim": -1}])
    with pytest.raises(PiperDirectiveError, match="true or false"):
        _plan([{"op": "shard_tensor", "params": TP, "sequence_parallel": "yes"}])


def test_sequence_length_must_split():
    m = build_model("gpt", 0, layers=2, seq=15)
    with pytest.raises(PiperError, match="does not split"):
        _plan([piper.shard_tensor(TP, sequence_parallel=True)], model=m)
