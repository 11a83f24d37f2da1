"""The pipelining peer of ``benchmarks/bench_ep_pipeline.py`` puts every stage on the ranks piper's
``dualpipe_v(..., groups=GROUPS)`` places it on, and its V agrees with pipelining's own stage mapping."""
from __future__ import annotations

import os
import sys

import pytest
from torch.distributed.pipelining.schedules import generate_rank_to_stage_mapping

import piper_compile as piper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import ep_pipelining  # noqa: E402


@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1, 2], [3, 4, 5], [6, 7, 8]]])
def test_peer_layout_matches_piper_placement(groups: list[list[int]]):
    pp = len(groups)
    placed = {d["filter"]["PP"]: d["devices"] for d in piper.schedules.v_shape(pp, groups=groups)}
    held: dict[int, set[int]] = {s: set() for s in placed}
    for rank in (r for g in groups for r in g):
        p, j = ep_pipelining.position(rank, groups)
        assert groups[p][j] == rank
        for s in ep_pipelining.v_stages(p, pp):
            held[s].add(rank)
    assert held == {s: set(d) for s, d in placed.items()}
    assert {p: ep_pipelining.v_stages(p, pp) for p in range(pp)} == generate_rank_to_stage_mapping(pp, 2 * pp, "v")
    # pipeline j: replica j of every group, in pipeline-rank order; every rank in exactly one pipeline
    pipes = ep_pipelining.pipelines(groups)
    assert all(pipe == [g[j] for g in groups] for j, pipe in enumerate(pipes))
    assert sorted(r for pipe in pipes for r in pipe) == sorted(r for g in groups for r in g)


def test_unknown_rank_is_an_error():
    with pytest.raises(ValueError, match="rank 7"):
        ep_pipelining.position(7, [[0, 1], [2, 3]])
