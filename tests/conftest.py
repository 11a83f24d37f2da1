"""Shared test setup: one thread per process (tests spawn several gloo ranks on 2 cores)."""
import os
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
    ones with fewest tests), so neither worker idles while the other still has a queue.
    """
    from xdist.scheduler import LoadScopeScheduling

    class RanksApart(LoadScopeScheduling):
        ranks_node = None

        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0] if _runs_ranks(nodeid) else nodeid

        def _assign_work_unit(self, node) -> None:
            self.workqueue.move_to_end(self._next_scope(node), last=False)
            super()._assign_work_unit(node)

        def _next_scope(self, node) -> str:
            if self.ranks_node is None:
                self.ranks_node = node
            first_unit = next((s for s in self.workqueue if not _runs_ranks(s)), None)
            if node is self.ranks_node:
                return next((s for s in self.workqueue if _runs_ranks(s)), first_unit)
            return first_unit if first_unit is not None else next(reversed(self.workqueue))

    return RanksApart(config, log)


def _runs_ranks(nodeid: str) -> bool:
    return nodeid.startswith("tests/dist/")


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
