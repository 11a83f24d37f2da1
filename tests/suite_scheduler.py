"""How ``pytest -n 2`` shares the suite between its two workers (``tests/conftest.py`` installs it).

Each multi-process test (``tests/dist``) starts gloo ranks that fill both cores, so one worker, the
ranks worker, runs those files one at a time while the other runs the single-process tests. Once none
of those is left, the other worker takes multi-process files from the back of the queue (the ones with
fewest tests, after xdist's reorder), so neither worker idles while the other still has a queue. Files
whose tests sleep or time their ranks (they race a timeout or measure a run) go to the ranks worker
first, and nothing is taken from the back until they are done: such a file never shares the cores with
another multi-process file.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling

_CLOCK = re.compile(r"\btime\.(sleep|perf_counter|monotonic|time)\(")


def runs_ranks(nodeid: str) -> bool:
    """Whether a test (or a file's scope) is a multi-process one."""
    return nodeid.startswith("tests/dist/")


@functools.cache
def reads_clock(path: Path) -> bool:
    """Whether a test file sleeps or reads the wall clock."""
    return _CLOCK.search(path.read_text(encoding="utf-8")) is not None


class RanksApart(LoadScopeScheduling):
    """xdist's load-scope scheduling with the rules of the module docstring (scopes: one per
    multi-process file, one per single-process test)."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.root = Path(config.rootpath)
        self.ranks_node: Any = None

    def _split_scope(self, nodeid: str) -> str:
        return nodeid.split("::", 1)[0] if runs_ranks(nodeid) else nodeid

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        for idle in self.nodes:  # a worker that was left nothing it may take looks again
            if idle is not node and self.workqueue and not idle.shutting_down \
                    and self._pending_of(self.assigned_work.get(idle, {})) == 0:
                self._assign_work_unit(idle)

    def _assign_work_unit(self, node: Any) -> None:
        scope = self._next_scope(node)
        if scope is not None:
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    def _next_scope(self, node: Any) -> str | None:
        self.ranks_node = self.ranks_node or node
        ranks = [s for s in self.workqueue if runs_ranks(s)]
        first_unit = next((s for s in self.workqueue if not runs_ranks(s)), None)
        if node is self.ranks_node:
            timed = [s for s in ranks if self._timed(s)]
            return (timed or ranks or [first_unit])[0]
        if first_unit is not None or not ranks or self._timed_left():
            return first_unit
        return ranks[-1]

    def _timed(self, scope: str) -> bool:
        return runs_ranks(scope) and reads_clock(self.root / scope)

    def _timed_left(self) -> bool:
        """Whether a timed file is still queued, or assigned to the ranks worker and not done."""
        running = self.assigned_work.get(self.ranks_node, {})
        return any(self._timed(s) for s in self.workqueue) or any(
            self._timed(s) and not all(done.values()) for s, done in running.items())
