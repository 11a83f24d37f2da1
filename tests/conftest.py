"""Shared test setup: one thread per process (tests spawn several gloo ranks on 2 cores)."""
import functools
import os
import re
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/unit/golden/*.txt from the current passes (review the diff)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n 2``: one worker runs the multi-process files (tests/dist) one at a time.

    Their gloo ranks already fill both cores, so the other worker runs the single-process tests.
    Once none of those is left, it takes multi-process files from the back of the queue (the
    ones with fewest tests), so neither worker idles while the other still has a queue. Files
    whose tests sleep or time their ranks go first, and nothing is taken from the back until
    they are done: two of them, or one and another multi-process file, never share the cores.
    """
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class RanksApart(LoadScopeScheduling):
        ranks_node = None

        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0] if _runs_ranks(nodeid) else nodeid

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for idle in self.nodes:  # a worker that was left nothing it may take looks again
                if idle is not node and self.workqueue and not idle.shutting_down \
                        and self._pending_of(self.assigned_work.get(idle, {})) == 0:
                    self._assign_work_unit(idle)

        def _assign_work_unit(self, node) -> None:
            scope = self._next_scope(node)
            if scope is not None:
                self.workqueue.move_to_end(scope, last=False)
                super()._assign_work_unit(node)

        def _next_scope(self, node) -> str | None:
            self.ranks_node = self.ranks_node or node
            ranks = [s for s in self.workqueue if _runs_ranks(s)]
            first_unit = next((s for s in self.workqueue if not _runs_ranks(s)), None)
            if node is self.ranks_node:
                timed = [s for s in ranks if _reads_clock(root / s)]
                return (timed or ranks or [first_unit])[0]
            if first_unit is not None or not ranks or self._timed_left():
                return first_unit
            return ranks[-1]

        def _timed_left(self) -> bool:
            running = self.assigned_work.get(self.ranks_node, {})
            return any(_reads_clock(root / s) for s in self.workqueue if _runs_ranks(s)) or any(
                _runs_ranks(s) and _reads_clock(root / s) and not all(done.values())
                for s, done in running.items())

    return RanksApart(config, log)


def _runs_ranks(nodeid: str) -> bool:
    return nodeid.startswith("tests/dist/")


_CLOCK = re.compile(r"\btime\.(sleep|perf_counter|monotonic|time)\(")


@functools.cache
def _reads_clock(path) -> bool:
    """Whether a test file sleeps or reads the wall clock (its tests race a timeout or time a run)."""
    return _CLOCK.search(path.read_text(encoding="utf-8")) is not None


_LAST_REPORT: dict[str, float] = {}
_START = [time.monotonic()]


def pytest_sessionstart(session: pytest.Session) -> None:
    _START[0] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the xdist controller: when each worker finished its last test (see the summary)."""
    node = getattr(report, "node", None)
    if node is not None and report.when == "teardown":
        _LAST_REPORT[node.gateway.id] = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """One line: how long each worker was busy, so an idle tail shows in every suite run."""
    if _LAST_REPORT:
        busy = ", ".join(f"{w} {t - _START[0]:.0f} s" for w, t in sorted(_LAST_REPORT.items()))
        terminalreporter.write_line(f"workers' last test ended at: {busy}")
