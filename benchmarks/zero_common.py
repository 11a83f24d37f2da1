"""Helpers shared by ``bench_zero.py`` and ``bench_pp_zero.py``: tensor-level memory per rank, the piper ZeRO
directive (tolerant of builder versions), and a table for variants that may have failed.

Tensor-level memory (what "state MiB" and "peak MiB" mean in both benchmarks):

* **state MiB**: the bytes of every CPU tensor storage reachable from Python on the rank *between* two steps
  (``gc.get_objects()``, plain ``torch.Tensor`` / ``nn.Parameter`` only, each storage counted once; a wrapper
  subclass such as FSDP2's ``DTensor`` is counted through its local shard, fake/meta tensors are skipped).
  That is parameters + persistent gradients + optimizer state + any persistent buffer, plus the (tiny)
  pre-generated token batches. Storage held only from C++ (autograd graph, DDP's reducer buckets when
  grads are not views of them) is invisible to it, which is why the DDP peer uses
  ``gradient_as_bucket_view=True`` and ``zero_grad(set_to_none=False)``: its gradient buckets then stay
  reachable through ``param.grad``. The breakdown in ``extra`` splits it into params / grads / optimizer
  state / other.
* **peak MiB**: state MiB at the start of a step + the high-water mark of *net* CPU-allocator bytes during
  that step, from ``torch.profiler`` with ``profile_memory=True`` (c10's CPU allocator reports every
  allocation and its running total while profiling; Inductor's kernels, gloo's output tensors and the
  optimizer's temporaries all allocate through it). Two extra steps run under the profiler after the timed
  steps and the second one is measured, so blocks it frees that the first one allocated are subtracted
  (a block allocated before profiling began and freed during the step is not subtracted: the figure can
  only err high, by at most such blocks). This is the CPU analogue of ``torch.cuda.max_memory_allocated``
  over one step; it excludes the Python heap, compiled code and allocator slack, which peak RSS includes.
"""
from __future__ import annotations

import gc
import inspect
import traceback
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

MiB = float(2**20)
_MARK = 777_777  # a marker allocation of this many bytes separates the two profiled steps


def _plain_local(t: Any) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s data on this rank (a DTensor's local shard), or None."""
    if t is None:
        return None
    local = getattr(t, "_local_tensor", None)  # DTensor (incl. FSDP2's sharded nn.Parameter)
    if local is not None:
        t = local
    if type(t) not in (torch.Tensor, nn.Parameter):
        return None
    return t


def storage_bytes(tensors: Iterable[Any], seen: set[int] | None = None) -> int:
    """Bytes of the distinct CPU storages behind ``tensors`` (views and shared storages counted once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        t = _plain_local(t)
        if t is None or t.device.type != "cpu":
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        n, ptr = st.nbytes(), st.data_ptr()
        if n == 0 or ptr == 0 or ptr in seen:
            continue
        seen.add(ptr)
        total += n
    return total


def live_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter)]


def optimizer_tensors(opt: Any) -> list[Any]:
    out: list[Any] = []
    for st in getattr(opt, "state", {}).values():
        if isinstance(st, dict):
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer wraps the local shard's optimizer
    if inner is not None and inner is not opt:
        out.extend(optimizer_tensors(inner))
    return out


def state_breakdown(params: list[nn.Parameter], opt: Any) -> dict[str, float]:
    """MiB of params / grads / optimizer state / everything else reachable, right now (between steps)."""
    seen: set[int] = set()
    p = storage_bytes(params, seen)
    g = storage_bytes((q.grad for q in params), seen)
    o = storage_bytes(optimizer_tensors(opt), seen) if opt is not None else 0
    rest = storage_bytes(live_tensors(), seen)
    return {"params": round(p / MiB, 2), "grads": round(g / MiB, 2), "optim": round(o / MiB, 2),
            "other": round(rest / MiB, 2), "total": round((p + g + o + rest) / MiB, 2)}


def _alloc_events(prof: Any) -> list[tuple[int, int, int]]:
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                out.append((e.start_time_ns, f.alloc_size, f.total_allocated))
        stack.extend(e.children)
    out.sort()
    return out


def tensor_peak(run_step: Callable[[int], Any], first_index: int) -> dict[str, float]:
    """Run two steps (``run_step(first_index)``, ``run_step(first_index + 1)``) under the memory profiler and
    return {"state": MiB live before the second, "peak": state + net allocation high-water during it}."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(first_index)
        dist.barrier()
        base = storage_bytes(live_tensors())
        marker = torch.empty(_MARK, dtype=torch.uint8)
        del marker
        run_step(first_index + 1)
        dist.barrier()
    events = _alloc_events(prof)
    start = next((i for i, (_, size, _) in enumerate(events) if size == _MARK), None)
    freed = next((i for i in range(start, len(events)) if events[i][1] == -_MARK), None) if start is not None else None
    if freed is None:
        return {"state": round(base / MiB, 2), "peak": float("nan")}
    level0 = events[freed][2]  # net bytes allocated since profiling began, at the start of the measured step
    high = max((tot for _, _, tot in events[freed + 1:]), default=level0)
    return {"state": round(base / MiB, 2), "peak": round((base + max(0, high - level0)) / MiB, 2)}


def piper_replicate(filter: dict[str, Any] | None, zero: int, bucket_mb: float, prefetch: int,
                    **extra: Any) -> dict[str, Any]:
    """``piper.replicate(filter, zero=..., bucket_mb=..., prefetch=...)``; ``prefetch`` only when the builder
    takes it (the ZeRO work adds it)."""
    import piper_compile as piper

    kw: dict[str, Any] = {"zero": zero, "bucket_mb": bucket_mb, **extra}
    if "prefetch" in inspect.signature(piper.replicate).parameters:
        kw["prefetch"] = prefetch
    return piper.replicate(filter, **kw)


def block_mib(spec: Any) -> float:
    """MiB of one transformer block's parameters for ``spec``'s GPT: FSDP2's unit when fully_shard is applied per
    block, so the default piper bucket for ZeRO-2/3 (equal granularity of gathers and reduce-scatters)."""
    from piper_compile.testing.models import Block, GPTConfig

    block = Block(GPTConfig(**spec.model))
    return sum(p.numel() * p.element_size() for p in block.parameters()) / MiB


def piper_extra(step: Any) -> dict[str, Any]:
    """piper's own counters of the last step (best effort: the API may differ while ZeRO is in progress)."""
    import piper_compile as piper

    out: dict[str, Any] = {}
    try:
        stats = piper.last_stats(step)
        out.update(collectives=dict(stats.collectives), peak_live_mib=round(stats.peak_live_bytes / MiB, 1))
        cs = piper.compiled_steps(step)[0]
        out["compile_s"] = round(sum(c.compile_seconds for c in cs.compiled.values()), 1)
        out["fallbacks"] = sorted(n for n, c in cs.compiled.items() if getattr(c, "fallback", False))
    except Exception as e:  # noqa: BLE001 - counters are informative only
        out["counters_error"] = repr(e)
    return out


def piper_optimizer(step: Any) -> Any:
    import piper_compile as piper

    try:
        return piper.optimizer(step)
    except Exception:  # noqa: BLE001
        return None


def short_error(e: BaseException, lines: int = 14) -> str:
    """The tail of a failure (``run_local`` puts the failing rank's traceback in the message)."""
    text = str(e) or "".join(traceback.format_exception(e))
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return "\n".join("    | " + ln for ln in tail)


def fmt_ranks(xs: list[float], fmt: str = "{:.0f}") -> str:
    return " / ".join(fmt.format(x) for x in xs)


def mem_figure(ranks: list[Any], key: str) -> str:
    """The largest rank's tensor figure ``key`` (MiB, from ``RankResult.extra``), or n/a where a rank lacks it."""
    vals = [r.extra.get(key, float("nan")) for r in ranks]
    return f"{max(vals):.1f}" if vals and all(v == v for v in vals) else "n/a"


def ratio_line(ours: list[Any], theirs: list[Any], peer: str) -> str:
    """The report's figures of piper against ``peer`` (its name in the line): median step time, their
    ratio, peak RSS, CPU-time ratio and the tensor state and peak."""
    from common import Summary

    s, p = Summary.of(ours), Summary.of(theirs)
    return (f"piper {s.median_ms:.1f} ms  {peer} {p.median_ms:.1f} ms  ratio piper/{peer} "
            f"{s.median_ms / p.median_ms:.2f}  peakRSS piper {max(s.rss):.0f} MiB {peer} {max(p.rss):.0f} MiB"
            f"  | cpu ratio {s.cpu_ms / p.cpu_ms:.2f}, tensor state piper {mem_figure(ours, 'state')} {peer} "
            f"{mem_figure(theirs, 'state')} MiB, tensor peak piper {mem_figure(ours, 'peak')} {peer} "
            f"{mem_figure(theirs, 'peak')} MiB")


def print_report(details: list[str], title: str, lines: list[str]) -> None:
    """The per-rank details, then the summary lines under ``title``, then the machine load."""
    from common import load_note

    print("\n== details (per rank; tensor MiB: see zero_common.py)")
    print("\n".join(details))
    print(f"\n== {title}")
    print("\n".join(lines))
    print(f"after: {load_note()}")
