"""scripts/gpu_check.py's bench row: the verdict against the single-GPU target (piper >= 0.95x
torch.compile's throughput), by default or with options["cuda_graph"] (said so), and a run stopped in
the variants still reporting the main figures."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _result(ratio: float, graph: float | None) -> dict:
    side = {"tokens_per_s": 1.0, "mfu": 0.4, "peak_bytes": 2**30, "host_s": 0.05}
    return {"batch": 16, "seq": 1024, "microbatches": 2, "ratio": ratio, "ratio_accum": 0.9, "peak_tflops": 989.0,
            "peak_source": "table: H200", "piper": dict(side), "peer": dict(side),
            "variants": {} if graph is None else {"cudagraph": {"ratio": graph}}}


@pytest.mark.parametrize("ratio, graph, verdict", [
    (1.02, None, "PASS"), (1.102, None, "BELOW TARGET"), (1.102, 0.98, "PASS with options['cuda_graph']"),
    (1.102, 1.08, "BELOW TARGET")])
def test_the_verdict_names_how_the_target_was_met(ratio, graph, verdict):
    what, got, detail, _ = _gpu_check()._bench_row(_result(ratio, graph), True, 1.0, "")
    assert got.startswith(verdict) and "350M" in what, (got, detail)


def test_a_run_stopped_in_the_variants_reports_the_main_figures():
    _, got, detail, _ = _gpu_check()._bench_row(_result(1.02, None), True, 300.0, "timed out after 300s in the variants; ")
    assert got == "PASS" and detail.startswith("timed out after 300s in the variants; ratio piper/peer 1.020")
