"""scripts/gpu_check.sh runs on a machine without a GPU (as CI runs it): the GPU parts say SKIP, the CPU
smoke parts (host staging, the benchmark on a tiny GPT with its trace) pass, and the table is written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_part(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| SKIP |" in table and "FAIL" not in table, table
    assert "host staging on CPU" in table and "bench_gpu (CPU smoke" in table and "trace yes" in table, table
    assert (tmp_path / "trace" / "rank0.json").exists() and (tmp_path / "bench_gpu.json").exists()
    assert "split1 ratio" in table and "batch2x ratio" in table, table
    assert "host returned after" in table and "error" not in table, table
    for name in ("piper", "peer1", "split1", "batch2x", "peer_batch2x"):  # each profiled step's table of host ops
        assert "Self CPU" in (tmp_path / f"profile_{name}.txt").read_text()
