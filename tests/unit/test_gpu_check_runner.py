"""gpu_check runs tests/gpu's files side by side (most of their time is the host compiling): each file in
its own pytest process, every case's row in the order of the files, and a file still running at the
deadline stopped and reported with the cases that ended, while the others' rows stay."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASE = '''
import json, time
def _case(name, secs):
    t0 = time.time()
    time.sleep(secs)
    with open({log!r}, "a") as f:
        f.write(json.dumps([name, t0, time.time()]) + "\\n")
'''


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def _write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(CASE.format(log=str(tmp_path / "spans.jsonl")) + body)
    return str(path)


@pytest.mark.slow  # waits out its 10 s deadline
def test_files_run_side_by_side_and_a_late_one_is_stopped_without_losing_the_others(tmp_path):
    gc = _gpu_check()
    files = [
        _write(tmp_path, "test_slow", "def test_ends():\n    _case('slow_ends', 0.1)\n"
                                      "def test_hangs():\n    _case('hangs', 120)\n"),
        _write(tmp_path, "test_a", "def test_one():\n    _case('a', 2)\n"
                                   "def test_two():\n    assert 1 == 2\n"),
        _write(tmp_path, "test_b", "import pytest\ndef test_one():\n    _case('b', 2)\n"
                                   "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n"),
    ]
    out = tmp_path / "out"
    out.mkdir()
    rows = gc.run_files(files, out, timeout=10, jobs=3)
    got = [(check, result) for check, result, _, _ in rows]
    assert got == [("test_slow", "FAIL"), ("test_a::test_one", "PASS"), ("test_a::test_two", "FAIL"),
                   ("test_b::test_one", "PASS"), ("test_b::test_skipped", "SKIP")], rows
    assert "timed out after 10s" in rows[0][2] and "test_ends PASSED" in rows[0][2], rows[0]
    assert rows[0][3] < 30, "the stopped run is not waited for"
    spans = {name: (t0, t1) for name, t0, t1 in map(json.loads, (tmp_path / "spans.jsonl").read_text().splitlines())}
    assert "hangs" not in spans
    (a0, a1), (b0, b1) = spans["a"], spans["b"]
    assert a0 < b1 and b0 < a1, f"the files ran one after another: {spans}"


def test_one_job_runs_the_files_in_turn(tmp_path):
    gc = _gpu_check()
    files = [_write(tmp_path, "test_a", "def test_one():\n    _case('a', 0.5)\n"),
             _write(tmp_path, "test_b", "def test_one():\n    _case('b', 0.5)\n")]
    out = tmp_path / "out"
    out.mkdir()
    rows = gc.run_files(files, out, timeout=60, jobs=1)
    assert [r[:2] for r in rows] == [("test_a::test_one", "PASS"), ("test_b::test_one", "PASS")], rows
    spans = {name: (t0, t1) for name, t0, t1 in map(json.loads, (tmp_path / "spans.jsonl").read_text().splitlines())}
    assert spans["a"][1] <= spans["b"][0]


def test_the_gpu_files_are_all_of_tests_gpu_longest_first():
    files = _gpu_check()._gpu_files()
    assert sorted(files) == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert files[0] == "tests/gpu/test_shared_gpu.py" and files[-1] == "tests/gpu/test_triton_experts_cuda.py"
