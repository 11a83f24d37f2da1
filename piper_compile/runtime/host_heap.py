"""CPU training: keep freed heap memory in the process between steps (glibc malloc thresholds)."""
from __future__ import annotations

import ctypes
import functools
import platform

from piper_compile.knobs import knob

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


@functools.cache
def keep_host_heap(mmap_bytes: int = 32 << 20, trim_bytes: int = 64 << 20) -> bool:
    """CPU training: stop glibc malloc from handing freed heap memory back to the OS between steps.

    PyTorch's CPU allocator is plain ``malloc``. With glibc's default, adaptive thresholds the heap is
    trimmed whenever more than ~2x the largest block freed so far lies free at its top, which a step's
    end (every activation released) easily passes: the next step then faults every page back in (on
    a 2-layer MoE GPT, 4-7k page faults, several ms of kernel time per step). The thresholds set here
    are the ones glibc's own adaptation reaches once a 32 MiB block has been freed (blocks of up to
    32 MiB come from the heap, up to 64 MiB of free heap is kept). Once per process; glibc only;
    ``PIPER_KEEP_HEAP=0`` leaves malloc alone. Returns whether the thresholds were set."""
    if not knob("PIPER_KEEP_HEAP") or platform.system() != "Linux" \
            or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
        return bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))
    except (OSError, AttributeError):
        return False
