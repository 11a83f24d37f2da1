"""The allocator's own peak over training steps, set against the memory plan (issue 17's check): on CUDA
``torch.cuda.max_memory_allocated`` (Inductor's Triton buffers included), on CPU the CPU allocator's
running total as the profiler records it at every allocation (``profile_memory=True``), which sees every
tensor the step makes, C++ Inductor code's buffers too. What is allocated but not the model's (the
batch, cuBLAS's workspace, compiled constants) is measured before the measured steps and taken off, and
the state the plan counts as persistent is added back, so the figure compares with ``peak_total``."""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch
from torch._C._profiler import _EventType

import piper_compile as piper
from piper_compile.memory import MiB


def _cpu_totals(prof: Any) -> list[tuple[int, int, int]]:
    """(time, total allocated after, bytes) of each CPU allocation and free the profiler recorded."""
    out: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            out.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
        stack.extend(e.children)
    return sorted(out)


def cpu_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(the most bytes the CPU allocator held during ``fn()`` over what it held before, ``fn()``'s result).
    The profiler records the memory events of its own thread only: a tensor another thread frees stays
    counted until the session ends."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = _cpu_totals(prof)
    if not events:
        return 0, out
    start = events[0][1] - events[0][2]  # allocated before the first allocation recorded
    return max(total for _, total, _ in events) - start, out


def _cpu_peak_over_start(step: Any, batch: tuple[torch.Tensor, ...], steps: int) -> int:
    """The most any of ``steps`` calls held over what it started with, each call profiled on its own
    (:func:`cpu_peak`): what gloo's worker threads free (what their collectives held) stays in the running
    total, and one session per call keeps that drift from adding up over the calls."""
    return max(cpu_peak(lambda: step(*batch))[0] for _ in range(steps))


def _cuda_peak_over_start(step: Any, batch: tuple[torch.Tensor, ...], steps: int) -> int:
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        step(*batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def allocator_peak(step: Any, batch: tuple[torch.Tensor, ...], steps: int = 2) -> tuple[int, int, str]:
    """(the allocator's peak over ``steps`` training calls as the plan counts it, the plan's predicted
    ``peak_total``, a report) for ``step`` on ``batch`` (its device's allocator). One call runs first:
    it compiles and makes the optimizer state."""
    cuda = batch[0].is_cuda
    if cuda:  # cuBLAS's workspace for this stream: allocated once, kept (not the model's)
        w = torch.randn(256, 256, device="cuda")
        (w @ w).sum().item()
        del w
    step(*batch)
    gc.collect()
    report = piper.memory_report(step)
    over = (_cuda_peak_over_start if cuda else _cpu_peak_over_start)(step, batch, steps)
    measured = over + report.measured.persistent
    predicted = piper.memory_report(step).predicted.peak_total
    detail = (f"allocator peak {measured / MiB:.2f} MiB ({over / MiB:.2f} over what the step started with, "
              f"persistent state {report.measured.persistent / MiB:.2f}) vs plan {predicted / MiB:.2f} MiB\n"
              f"{report.format()}")
    return measured, predicted, detail
