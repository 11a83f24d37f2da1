"""autoplan's candidates planned side by side: one group per captured graph (data-parallel and tensor-parallel
degree, ``_Search.capture_key``), groups spread over forked worker processes, results merged in search order.

A group is what one capture serves, so no capture is made twice; a worker plans its group's candidates
exactly as the serial search does (``_Search.evaluate``), and the merge puts every fit and every rejection
back at its candidate's place: the ranking, its tie-breaks and the rejection list are those of the serial
search. Workers are forked (the model, the batch and the block costs are inherited, nothing is pickled on
the way in) and only where that is safe: a platform that forks, a process with no other thread (a forked
copy of a threaded process can inherit a lock some thread held) and no CUDA context."""
from __future__ import annotations

import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from piper_compile.disk import usable_cores

__all__ = ["Outcome", "default_workers", "evaluate_groups"]


@dataclass
class Outcome:
    """What planning some candidates added to a search: per candidate (by index) its fits and rejections,
    and the counters."""

    fits: dict[int, list[Any]] = field(default_factory=dict)
    rejected: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    planned: int = 0
    pruned: int = 0
    closest: tuple[float, str] | None = None
    closest_at: int = -1  # the index of the candidate that set ``closest`` (ties go to the earlier one)
    stage_counts: set[int] = field(default_factory=set)


def default_workers(groups: int) -> int:
    """Worker processes for ``groups`` capture groups: one per usable core, at most one per group; 1 where
    forking is unavailable or unsafe (another thread is running, or CUDA is initialized: a forked child
    cannot use it)."""
    import torch

    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1 \
            or torch.cuda.is_initialized():
        return 1
    return max(1, min(usable_cores(), groups))


def _evaluate(search: Any, items: list[tuple[int, Any]], t0: float, limit: float | None) -> Outcome:
    """Plan ``items`` (index, candidate) on ``search``; what each added, by index."""
    out = Outcome()
    for i, cand in items:
        nf, nr = len(search.fits), len(search.rejected)
        if limit is not None and time.perf_counter() - t0 > limit:
            search.rejected.append((cand.label(), f"not planned: the search passed time_limit_s={limit:g}"))
        else:
            before = search.closest
            search.evaluate(cand)
            if search.closest is not before:
                out.closest_at = i
        out.fits[i], out.rejected[i] = search.fits[nf:], search.rejected[nr:]
    search.close()
    out.planned, out.pruned, out.closest, out.stage_counts = (search.planned, search.pruned, search.closest,
                                                              set(search.stage_counts))
    return out


_FORKED: Any = None  # the search a forked worker inherits


def _in_worker(args: tuple[list[tuple[int, Any]], float, float | None]) -> Outcome:
    import torch

    torch.set_num_threads(1)  # planning is host work; a forked OpenMP pool must not be entered
    search = _FORKED
    search.fits, search.rejected, search.planned, search.pruned = [], [], 0, 0
    search.closest, search.stage_counts = None, set()
    return _evaluate(search, *args)


def evaluate_groups(search: Any, groups: list[list[tuple[int, Any]]], workers: int, t0: float,
                    limit: float | None) -> None:
    """Plan every group's candidates, in ``workers`` forked processes (in this one if 1), and merge what
    they found into ``search`` in candidate order."""
    global _FORKED
    if workers <= 1 or len(groups) <= 1:
        outcomes = [_evaluate(search, [item for g in groups for item in g], t0, limit)]
    else:
        _FORKED = search
        try:
            with multiprocessing.get_context("fork").Pool(min(workers, len(groups))) as pool:
                ordered = sorted(groups, key=len, reverse=True)  # the largest groups first: balance
                outcomes = pool.map(_in_worker, [(g, t0, limit) for g in ordered], chunksize=1)
        finally:
            _FORKED = None
    _merge(search, outcomes)


def _merge(search: Any, outcomes: list[Outcome]) -> None:
    fits: dict[int, list[Any]] = {}
    rejected: dict[int, list[tuple[str, str]]] = {}
    search.fits, search.rejected, search.planned, search.pruned = [], [], 0, 0
    closest = [(o.closest[0], o.closest_at, o.closest) for o in outcomes if o.closest is not None]
    search.closest = min(closest)[2] if closest else None
    for o in outcomes:
        fits.update(o.fits)
        rejected.update(o.rejected)
        search.planned += o.planned
        search.pruned += o.pruned
        search.stage_counts |= o.stage_counts
    for i in sorted(fits):
        search.fits += fits[i]
        search.rejected += rejected[i]
