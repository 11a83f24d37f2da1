"""autoplan's parallel search (``autoplan/parallel.py``): what workers found is merged back in candidate
order, whichever worker planned it (the end-to-end comparison with a serial search is in test_autoplan)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from piper_compile.autoplan.parallel import Outcome, _merge, default_workers


def test_outcomes_merge_in_candidate_order():
    search = SimpleNamespace(fits=[], rejected=[], planned=0, pruned=0, closest=None, stage_counts=set())
    late = Outcome(fits={2: ["c"], 3: []}, rejected={2: [], 3: [("d", "over")]}, planned=2, pruned=0,
                   closest=(5.0, "d"), closest_at=3, stage_counts={4})
    early = Outcome(fits={0: ["a"], 1: ["b"]}, rejected={0: [], 1: [("b2", "over")]}, planned=3, pruned=1,
                    closest=(5.0, "b2"), closest_at=1, stage_counts={2})
    _merge(search, [late, early])
    assert search.fits == ["a", "b", "c"] and search.rejected == [("b2", "over"), ("d", "over")]
    assert (search.planned, search.pruned, search.stage_counts) == (5, 1, {2, 4})
    assert search.closest == (5.0, "b2")  # a tie goes to the earlier candidate, as in one process


def test_workers_default_to_one_per_core_and_group_and_to_one_beside_threads(monkeypatch):
    import os
    import threading

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    assert (default_workers(1), default_workers(3), default_workers(8)) == (1, 3, 4)
    monkeypatch.setattr(threading, "active_count", lambda: 2)  # forking a threaded process is unsafe
    assert default_workers(8) == 1
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a forked child cannot use CUDA
    assert default_workers(8) == 1
