"""The machine's compile cache directory and its per-key locks: what the joint-graph cache
(``capture/cache.py``) and segment compilation (``codegen/cache.py``) share, so neither layer imports the
other. Both keep their entries in Inductor's own cache directory, so emptying it (or pointing
``TORCHINDUCTOR_CACHE_DIR`` at a new one) makes every kind of entry cold at once."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator


def cache_root() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its per-user default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except (ImportError, AttributeError):  # another torch layout: the default's own rule
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "torchinductor_piper")


def locks() -> str:
    """The directory of the per-key lock files and written-marks."""
    return os.path.join(cache_root(), "piper-locks")


@contextlib.contextmanager
def one_at_a_time(key: str) -> Iterator[None]:
    """Hold the machine-wide lock of ``key`` (ranks of every job on this machine take turns per key)."""
    import fcntl

    where = locks()
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, f"{key}.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
