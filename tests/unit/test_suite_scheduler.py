"""The suite's xdist scheduler (``tests/suite_scheduler.py``), driven by a simulated two-worker run: every
test runs once, a file that sleeps or times its ranks never overlaps another multi-process file, and
the worker that runs out of single-process tests takes multi-process files instead of idling."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from suite_scheduler import RanksApart


class _Node:
    """A worker as the scheduler sees it: it is sent test indices and can be shut down."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.queue: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _suite(root: Path) -> tuple[list[str], dict[str, float]]:
    """Collection and durations: 3 timed dist files (60 s), 4 plain ones, 20 single-process tests (30 s:
    they end while timed files still run, so the other worker must wait, then be woken)."""
    files = {"test_clock_a": 3, "test_clock_b": 1, "test_clock_c": 2,
             "test_big": 6, "test_mid": 4, "test_small": 2, "test_one": 1}
    (root / "tests" / "dist").mkdir(parents=True)
    ids, secs = [], {}
    for name, n in files.items():
        body = "import time\ntime.sleep(1)\n" if "clock" in name else "import time\n"
        (root / "tests" / "dist" / f"{name}.py").write_text(body)
        for i in range(n):
            ids.append(f"tests/dist/{name}.py::test_{i}")
            secs[ids[-1]] = 10.0
    for i in range(20):
        ids.append(f"tests/unit/test_u{i}.py::test")
        secs[ids[-1]] = 1.5
    return ids, secs


def _run(root: Path) -> tuple[list[tuple[float, float, str, str]], RanksApart, list[str]]:
    """Run the simulated suite: (start, end, worker, test) for each test in completion order, the
    scheduler and the collection."""
    ids, secs = _suite(root)
    config = SimpleNamespace(getvalue=lambda key: ["2*popen"], option=SimpleNamespace(loadscopereorder=True),
                             rootpath=root)
    sched, nodes = RanksApart(config), [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, ids)
    sched.schedule()
    free = {n: 0.0 for n in nodes}  # when each worker's head test starts
    done = []
    while any(n.queue for n in nodes):
        node = min((n for n in nodes if n.queue), key=lambda n: free[n] + secs[ids[n.queue[0]]])
        index = node.queue.pop(0)
        start, end = free[node], free[node] + secs[ids[index]]
        free[node] = end
        idle = [n for n in nodes if not n.queue]
        done.append((start, end, node.gateway.id, ids[index]))
        sched.mark_test_complete(node, index)
        for other in idle:  # work sent to an idle worker starts now
            free[other] = max(free[other], end)
    assert sched.tests_finished
    return done, sched, ids


def test_every_test_runs_once_and_timed_files_never_share_the_cores(tmp_path):
    done, _, ids = _run(tmp_path)
    assert sorted(t for *_, t in done) == sorted(ids)
    dist = [(s, e, w, t) for s, e, w, t in done if t.startswith("tests/dist/")]
    for s, e, w, t in dist:
        if "clock" in t:
            overlapping = [u for s2, e2, w2, u in dist if w2 != w and s2 < e and s < e2]
            assert not overlapping, (t, overlapping)


def test_the_worker_out_of_single_process_tests_takes_multi_process_files_from_the_back(tmp_path):
    done, sched, _ = _run(tmp_path)
    ranks = sched.ranks_node.gateway.id
    other = [t for _, _, w, t in done if w != ranks]
    stolen = [t.split("::")[0] for t in other if t.startswith("tests/dist/")]
    assert stolen and not any("clock" in f for f in stolen), stolen
    assert all(t.startswith("tests/unit/") for t in other[:20])  # its own tests first
    ends = {w: max(e for _, e, w2, _ in done if w2 == w) for w in ("gw0", "gw1")}
    serial_dist = sum(e - s for s, e, _, t in done if t.startswith("tests/dist/"))
    assert max(ends.values()) < serial_dist  # without taking files it would end after all of them
    first = [t for _, _, w, t in done if w == ranks and t.startswith("tests/dist/")][:6]
    assert all("clock" in t for t in first), first  # the timed files run first
