#!/usr/bin/env bash
# Create .venv (once) and install piper_compile with its test dependencies. Idempotent.
# torch is pinned to the local CPU wheel (torch==2.13.0); never let pip resolve an open "torch".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import torch, piper_compile; print('piper_compile ready: torch', torch.__version__)"
