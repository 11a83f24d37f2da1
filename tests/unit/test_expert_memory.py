"""The experts step's memory rule (``sim/expert_memory``) against the CPU allocator: what the eager
reference holds while it runs (``runtime/expert.compute``), beyond its inputs and outputs, is what the
plan's rule says at the same rows per expert, forward and backward, including an expert without rows."""
from __future__ import annotations

import gc

import pytest
import torch
from torch._C._profiler import _EventType

from piper_compile.runtime import expert
from piper_compile.runtime.expert import Route
from piper_compile.sim.expert_memory import balanced_counts, step_transient

D, H = 64, 256


def _peak_over_start(fn) -> tuple[int, object]:
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
        stack.extend(e.children)
    events.sort()
    start = events[0][1] - events[0][2]
    return max(t for _, t, _ in events) - start, out


def _nbytes(out) -> int:
    return sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor))


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
    peak, out = _peak_over_start(lambda: expert.compute("experts", forward, inputs, codegen="eager"))
    held = peak - _nbytes(out)
    rule = step_transient(counts, D, H, torch.float32, forward, fused=False)
    assert abs(held - rule) <= 0.01 * held, (held, rule)  # measured: equal to a few bytes (0-d scalars)


def test_the_plan_expects_the_busiest_expert_above_the_mean():
    counts = balanced_counts(512, 4)
    assert sum(counts) <= 512 and len(counts) == 4
    assert counts[0] > 128 > counts[1]  # mean 128: the busiest expert at the expected maximum of 4 loads
    assert balanced_counts(100, 1) == [100]
