"""Optimizer parameter groups over ZeRO shards (``ShardBucket.group_runs``): a shard is cut into runs of one
group each, views of the shard that the optimizer updates in place; the multi-rank tests are in
tests/dist/test_zero.py and test_checkpoint.py."""
from __future__ import annotations

import torch
from torch import nn

from piper_compile.runtime.zero import ZeroState


def _bucket(rank: int, world: int = 2):
    """Parameters a (6 elements), b (2), c (3): 11 elements, padded to 12, shards of 6."""
    params = {"a": nn.Parameter(torch.arange(6.0).view(2, 3)), "b": nn.Parameter(torch.tensor([6.0, 7.0])),
              "c": nn.Parameter(torch.tensor([8.0, 9.0, 10.0]))}
    z = ZeroState.build({"g.b0": (("a", "b", "c"), tuple(range(world)), 3, "dp_gather")}, params, rank)
    z.shard_(params)
    return z.buckets["g.b0"]


def _runs(b) -> list[tuple[int, int, int]]:
    return [(r.group, r.start, r.length) for r in b.runs]


def test_a_shard_is_cut_into_runs_of_one_group_each():
    b0, b1 = _bucket(0), _bucket(1)
    b0.group_runs({"a": 0, "b": 1, "c": 0})
    b1.group_runs({"a": 0, "b": 1, "c": 0})
    assert _runs(b0) == [(0, 0, 6)] and b0.runs[0].param is b0.shard  # all of a: the shard itself
    assert _runs(b1) == [(1, 0, 2), (0, 2, 3)]  # b, then c; the padding element is in no run
    for r in b1.runs:
        assert r.param.is_leaf and r.param.requires_grad
        assert r.param.data_ptr() == b1.shard.data_ptr() + r.start * b1.shard.element_size()
    grads = b1.opt_grads(torch.arange(6.0))
    assert [g.tolist() for _, g in grads] == [[0.0, 1.0], [2.0, 3.0, 4.0]]


def test_an_optimizer_step_on_the_runs_updates_the_shard_in_place_with_each_groups_settings():
    b = _bucket(1)
    b.group_runs({"a": 0, "b": 1, "c": 0})
    before = b.shard.detach().clone()
    opt = torch.optim.SGD([{"params": [b.runs[1].param]}, {"params": [b.runs[0].param], "lr": 0.5}], lr=1.0)
    for p, g in b.opt_grads(torch.ones(6)):
        p.grad = g
    opt.step()
    assert (before - b.shard.detach()).tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 0.0]


def test_a_parameter_in_no_group_is_in_no_run_and_leaves_a_gap():
    b = _bucket(1)
    b.group_runs({"b": 0, "c": 0})
    assert _runs(b) == [(0, 0, 6)] and b.runs[0].param is b.shard  # every piece this shard holds: the shard
    b = _bucket(0, world=1)
    b.group_runs({"a": 0, "c": 0})
    assert _runs(b) == [(0, 0, 6), (0, 8, 3)]  # b is in no group: two runs of one group around it
    b = _bucket(0)
    b.group_runs({"b": 0})
    assert b.runs == [] and b.opt_params() == []  # rank 0's shard holds only a
