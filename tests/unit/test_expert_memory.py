"""The experts step's memory rule (``sim/expert_memory``) against the CPU allocator: what the eager
reference holds while it runs (``runtime/expert.compute``), beyond its inputs and outputs, is what the
plan's rule says at the same rows per expert, forward and backward, including an expert without rows."""
from __future__ import annotations

import gc

import pytest
import torch

from piper_compile.runtime import expert
from piper_compile.runtime.expert import Route
from piper_compile.runtime.zero import tensor_bytes
from piper_compile.sim.expert_memory import expected_counts, step_transient
from piper_compile.testing.allocator import cpu_peak

D, H = 64, 256


@pytest.mark.parametrize("counts", [[96, 32], [128, 0], [40, 40, 48]])
@pytest.mark.parametrize("forward", [True, False])
def test_the_experts_step_holds_what_the_rule_says(counts, forward):
    g = torch.Generator().manual_seed(0)
    rows, local = sum(counts), len(counts)
    perm = torch.randperm(rows, generator=g)
    route = Route(perm, perm, rows, 1, [rows], [rows], perm, torch.argsort(perm), counts)
    wg, wu, wd = (torch.randn(local, D, H, generator=g) * 0.1, torch.randn(local, D, H, generator=g) * 0.1,
                  torch.randn(local, H, D, generator=g) * 0.1)
    recv, grecv = torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)
    inputs = [recv, route, wg, wu, wd] if forward else [grecv, route, recv, wg, wu, wd]
    gc.collect()
    peak, out = cpu_peak(lambda: expert.compute("experts", forward, inputs, codegen="eager"))
    held = peak - sum(map(tensor_bytes, out))
    rule = step_transient(counts, D, H, torch.float32, forward, fused=False)
    assert abs(held - rule) <= 0.01 * held, (held, rule)  # measured: equal to a few bytes (0-d scalars)


def test_the_plan_expects_the_busiest_expert_above_the_mean():
    counts = expected_counts(512, 4)
    assert sum(counts) <= 512 and len(counts) == 4
    assert counts[0] > 128 > counts[1]  # mean 128: the busiest expert at the expected maximum of 4 loads
    assert expected_counts(100, 1) == [100]
