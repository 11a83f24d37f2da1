"""Shared test setup: one thread per process (tests spawn several gloo ranks on 2 cores)."""
import os

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
    """Under ``-n 2``: every multi-process test (tests/dist) runs on one worker, one at a time.

    Their gloo ranks already fill both cores; the other worker runs the single-process tests.
    """
    from xdist.scheduler import LoadScopeScheduling

    class RanksApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/dist" if nodeid.startswith("tests/dist/") else nodeid

    return RanksApart(config, log)
