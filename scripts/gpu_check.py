"""The body of ``scripts/gpu_check.sh`` (see there): runs each check, collects one row per result and
prints the summary table. Exit status 1 if any check failed."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
Row = tuple[str, str, str, float]  # check, PASS/FAIL/SKIP, detail, seconds


def _env_row() -> Row:
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return ("environment", "INFO", f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {tv}, {dev}", 0.0)


def _start(paths: list[str], out: Path, name: str, jobs: int) -> tuple[subprocess.Popen, Path, Path, float]:
    """Start pytest on ``paths``, its log written as it runs (``-v``: one line per case, so a run stopped at
    its time limit still shows which cases ended) and its cases in JUnit XML."""
    xml, log = out / f"{name}.xml", out / f"{name}.log"
    # a hang is a failure with a place, not the end of the device time: piper's waits give up after
    # PIPER_TIMEOUT seconds naming the instruction, pytest-timeout (where installed) ends a stuck case
    per_case = ["--timeout=100"] if importlib.util.find_spec("pytest_timeout") else []
    env = {**os.environ, "PIPER_TIMEOUT": os.environ.get("PIPER_TIMEOUT", "45")}
    # files side by side share the cores: each run's Inductor compiles with its share of worker processes
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider",
                                 *per_case, f"--junitxml={xml}", *paths], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    return proc, xml, log, time.perf_counter()


def _rows(name: str, xml: Path, log: Path, code: int | None, secs: float, timeout: int) -> list[Row]:
    """One row per test case of a finished pytest run (or one FAIL row saying why there are none)."""
    if code is None:
        ended = [ln for ln in log.read_text().splitlines() if any(f" {w}" in ln for w in ("PASSED", "FAILED", "SKIPPED"))]
        return [(name, "FAIL", f"timed out after {timeout}s; ended before: {'; '.join(ended)[-400:]}", secs)]
    if not xml.exists():
        return [(name, "FAIL", f"pytest wrote no report (exit {code}): {log.read_text()[-300:]}", secs)]
    rows = []
    for case in ET.parse(xml).iter("testcase"):
        status, detail = "PASS", ""
        for tag, word in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
            el = case.find(tag)
            if el is not None:
                status, detail = word, (el.get("message") or "").splitlines()[0][:160] if el.get("message") else ""
        rows.append((f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", status, detail,
                     float(case.get("time", 0.0))))
    return rows or [(name, "FAIL", "no test ran", secs)]


def run_files(files: list[str], out: Path, timeout: int, jobs: int) -> list[Row]:
    """pytest on each of ``files`` in its own process, up to ``jobs`` at once, all within ``timeout``
    seconds; the rows come back in the order of ``files``. Most of a GPU test's time is the host compiling
    (Dynamo, Inductor, Triton) and the ranks' processes starting, so on a many-core GPU machine the files
    overlap well; none measures time, and each measures memory in its own processes. A run still going at
    the deadline is stopped (its whole process group) and reported with the cases that ended."""
    deadline, jobs = time.perf_counter() + timeout, max(1, jobs)
    waiting, running, done = list(files), {}, {}
    while waiting or running:
        while waiting and len(running) < jobs:
            f = waiting.pop(0)
            running[f] = _start([f], out, Path(f).stem, jobs)
        for f, (proc, xml, log, t0) in list(running.items()):
            stopped = proc.poll() is None and time.perf_counter() > deadline
            if stopped:
                os.killpg(proc.pid, signal.SIGKILL)
            elif proc.returncode is None:
                continue
            code = proc.wait()
            done[f] = _rows(Path(f).stem, xml, log, None if stopped else code, time.perf_counter() - t0, timeout)
            del running[f]
        time.sleep(0.2)
    return [row for f in files for row in done[f]]


def _gpu_files() -> list[str]:
    """tests/gpu's files, the longest first (measured on an H200) so the overlap ends together."""
    order = ["test_shared_gpu", "test_cuda_graph", "test_cuda_memory", "test_cuda"]
    files = sorted((ROOT / "tests" / "gpu").glob("test_*.py"),
                   key=lambda p: order.index(p.stem) if p.stem in order else len(order))
    return [str(p.relative_to(ROOT)) for p in files]


def _bench(out: Path, gpu: bool, timeout: int) -> list[Row]:
    # On a GPU: 350M at 16 x 1024 tokens, two micro-batches of 8 sequences. The first table (H200) ran
    # 8 x 1024: a micro-batch of 4 sequences then takes less device time than the host needs to launch it,
    # so every extra micro-batch costs its launches in full (ratio 1.87; 0.94-0.98 against torch.compile
    # accumulating the same micro-batches on CPU). ``--batch 8`` reproduces that point.
    # Also timed: piper with the whole step replayed as one CUDA graph (options["cuda_graph"]).
    # ``bench_gpu.py --variants split1,noregional,batch2x``: one micro-batch (an H200, 2026-11-28: 90.0 ms
    # vs the peer's 87.1), regional compilation off (the whole 24-layer graph compiled: over a minute more
    # than this check has) and twice the batch against the peer on that batch (an H200, 2026-11-30: 1.033;
    # left out since: the check ran 8 min 46 s with it, over its 8). Each profiled step's table of host
    # ops lands in profile_*.txt beside the JSON.
    variants = "cudagraph" if gpu else "split1,batch2x"  # the CPU smoke run: no CUDA graph
    args = ["--out", str(out), "--variants", variants] + (
        ["--batch", "16"] if gpu else ["--preset", "tiny", "--codegen", "eager", "--steps", "3"])
    t0 = time.perf_counter()
    log = out / "bench_gpu.log"
    late = ""
    with log.open("w") as f:
        try:
            proc = subprocess.run([sys.executable, "benchmarks/bench_gpu.py", *args], cwd=ROOT, timeout=timeout,
                                  stdout=f, stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            if not (out / "bench_gpu.json").exists():  # written before the variants run
                return [("bench_gpu", "FAIL", f"timed out after {timeout}s: {log.read_text()[-300:]}",
                         time.perf_counter() - t0)]
            late = f"timed out after {timeout}s in the variants (their figures are missing); "
    secs = time.perf_counter() - t0
    if not late and proc.returncode != 0:
        return [("bench_gpu", "FAIL", log.read_text().strip().splitlines()[-1][:200], secs)]
    return [_bench_row(json.loads((out / "bench_gpu.json").read_text()), gpu, secs, late)]


def _bench_row(r: dict, gpu: bool, secs: float, late: str) -> Row:
    """The table's row for ``bench_gpu.json``: the ratio against the target, and what else it measured."""
    p, q = r["piper"], r["peer"]
    shape = f"batch {r.get('batch')} x {r.get('seq')}, {r.get('microbatches')} micro-batches"
    what = (f"bench_gpu (350M bf16, {shape}, piper vs torch.compile)" if gpu
            else f"bench_gpu (CPU smoke: tiny, eager, {shape})")
    variants = r.get("variants", {})
    detail = (f"{late}ratio piper/peer {r['ratio']:.3f} (vs the peer accumulating the same micro-batches "
              f"{r['ratio_accum']:.3f}); tok/s {p['tokens_per_s']:,.0f} vs {q['tokens_per_s']:,.0f}; "
              f"MFU {100 * p['mfu']:.1f}% vs {100 * q['mfu']:.1f}% of {r['peak_tflops']:.3g} TFLOP/s "
              f"({r['peak_source']}); peak {p['peak_bytes'] / 2**30:.2f} vs {q['peak_bytes'] / 2**30:.2f} GiB; "
              f"trace {'yes' if Path(p.get('trace', '')).exists() else 'no'}{_busy(p, q)}; host returned after "
              f"{1e3 * p['host_s']:.1f} vs {1e3 * q['host_s']:.1f} ms"
              + "".join(f"; {n} ratio {v['ratio']:.3f}" + (f" ({v['error'][:80]})" if "error" in v else "")
                        for n, v in variants.items()))
    # the target on a GPU: piper's throughput at least 0.95x torch.compile's (as the step runs by default, or
    # with options["cuda_graph"], said so); the CPU smoke run only has to run
    graph = variants.get("cudagraph", {}).get("ratio", float("nan"))
    verdict = ("PASS" if not gpu or r["ratio"] <= 1 / 0.95 else "PASS with options['cuda_graph']"
               if graph <= 1 / 0.95 else "BELOW TARGET (>= 0.95x torch.compile throughput)")
    return (what, verdict, detail, secs)


def _busy(p: dict, q: dict) -> str:
    """The share of a profiled step the device was busy, piper vs the peer (CUDA only)."""
    if p.get("device_busy_share") is None:
        return ""
    return (f"; device busy {100 * p['device_busy_share']:.0f}% ({p['device_ops']:,} ops) vs "
            f"{100 * q['device_busy_share']:.0f}% ({q['device_ops']:,})")


def _staging_smoke() -> Row:
    """CPU: a DP2 x PP2 run with every transfer staged through host buffers, against eager."""
    os.environ["PIPER_HOST_STAGING"] = "always"
    t0 = time.perf_counter()
    try:
        import piper_compile as piper
        from piper_compile.testing.parity import RunConfig, run_parity

        cfg = RunConfig(model="mlp", stages=2, steps=2, directives=[
            *piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(2), *piper.schedules.one_f_one_b(2, 2),
            piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.001)])
        run_parity(cfg, 4, rtol=1e-4, atol=1e-5)
        return ("host staging on CPU (PIPER_HOST_STAGING=always, PP2 x DP2 ZeRO-3)", "PASS", "matches eager",
                time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return ("host staging on CPU", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", time.perf_counter() - t0)
    finally:
        os.environ.pop("PIPER_HOST_STAGING", None)


def table(rows: list[Row]) -> str:
    lines = ["| check | result | detail | s |", "| --- | --- | --- | --- |"]
    lines += [f"| {c} | {r} | {d.replace('|', '/')} | {s:.1f} |" for c, r, d, s in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_check_out")
    p.add_argument("--quick", action="store_true", help="the CPU smoke parts only (CI)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available() and not args.quick
    rows = [_env_row()]
    if gpu:
        jobs = int(os.environ.get("PIPER_GPU_TEST_JOBS", max(1, min(5, (os.cpu_count() or 1) // 3))))
        rows += run_files(_gpu_files(), out, int(os.environ.get("PIPER_GPU_TESTS_S", 360)), jobs)
        print(table(rows), flush=True)
    else:
        why = "--quick" if args.quick else "no CUDA device (torch.cuda.is_available() is False)"
        rows.append(("tests/gpu (single GPU, ranks sharing a GPU, Triton kernel, bf16)", "SKIP", why, 0.0))
        rows.append(_staging_smoke())
    rows += _bench(out, gpu, timeout=int(os.environ.get("PIPER_GPU_BENCH_S", 330 if gpu else 240)))
    text = table(rows)
    print(text)
    (out / "gpu_check.md").write_text(text + "\n")
    return 1 if any(r == "FAIL" for _, r, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
