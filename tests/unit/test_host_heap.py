"""keep_host_heap: glibc malloc thresholds set once per process (CPU training), opt-out by environment."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from piper_compile.runtime.host_heap import keep_host_heap

_PROBE = "from piper_compile.runtime.host_heap import keep_host_heap as k; print(k(), k())"


def _probe(**env: str) -> str:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return out.stdout.strip()


@pytest.mark.slow  # 6-26 s: keeps the fast subset under 5 min
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_sets_thresholds_once() -> None:
    assert _probe() == "True True"
    assert keep_host_heap() is True


@pytest.mark.slow  # a child process; keeps the fast subset under 5 min
def test_opt_out() -> None:
    assert _probe(PIPER_KEEP_HEAP="0") == "False False"
