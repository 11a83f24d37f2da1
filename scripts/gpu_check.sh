#!/usr/bin/env bash
# One command for a session that has a GPU (and for CI, which runs its CPU part): tests/gpu, ranks
# sharing one GPU over gloo, the Triton expert kernel, and the single-GPU throughput benchmark; prints a
# summary table (also written to $OUT/gpu_check.md, with the benchmark's JSON and one step's Perfetto
# trace). Needs only what the GPU machine has (PyTorch 2.11, Triton 3.6, pytest on Python 3.12): it
# runs the repository from PYTHONPATH, nothing is installed. Under 8 minutes on one H100/H200: tests/gpu's
# files run side by side (PIPER_GPU_TEST_JOBS at once, default min(5, cores/3); their time is mostly the
# host compiling), then the benchmark alone. Caps: PIPER_GPU_TESTS_S (all test files), PIPER_GPU_BENCH_S.
# Without CUDA every GPU part prints a SKIP line and a CPU smoke run checks the same code paths.
#   bash scripts/gpu_check.sh [--quick]     (--quick: the CPU smoke parts only, as CI runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
PY=${GPU_CHECK_PYTHON:-$PY}  # another interpreter (the tests pass their own)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py --out "${OUT:-gpu_check_out}" "$@"
