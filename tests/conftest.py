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
    """Under ``-n 2``: multi-process files on one worker, one at a time (``tests/suite_scheduler.py``)."""
    from suite_scheduler import RanksApart

    return RanksApart(config, log)


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
