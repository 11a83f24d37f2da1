"""The machine's compile cache directory, its per-key locks and what cache keys hash of a constant: what
the joint-graph cache (``capture/cache.py``), segment compilation (``codegen/cache.py``) and regional
compilation's structure keys share, so no layer imports another for them. Both caches keep their entries
in Inductor's own cache directory, so emptying it (or pointing ``TORCHINDUCTOR_CACHE_DIR`` at a new one)
makes every kind of entry cold at once. Also the machine's usable cores, which decide how ranks and
planning workers share it."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import tempfile
from typing import Iterator

import torch


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


def write_record(path: str, text: str) -> None:
    """Write a small record (a cache shortcut) whole or not at all: readers, and ranks writing the same
    record at once, see a whole file or none; a directory that cannot be written loses only the shortcut."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError:
        pass


def constant_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a real tensor (a graph constant whose value a cache key must include)."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


TESTED_TORCH = (2, 13)  # the oldest torch whose private internals the caches use are tested here


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def fast_load_on() -> bool:
    """``PIPER_FAST_LOAD``: the warm-run shortcuts through torch's private internals (loading compiled code by
    its key, the vector-ISA probe record); 'auto' is on from ``TESTED_TORCH``."""
    from piper_compile.knobs import knob

    mode = knob("PIPER_FAST_LOAD")
    return mode == "on" or (mode == "auto" and torch_version() >= TESTED_TORCH)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@functools.cache
def package_hash() -> str:
    """A hash of piper's own source (its custom ops and capture code shape the joint graph)."""
    root = pathlib.Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def trace_settings() -> str:
    """What besides a graph decides what tracing it gives (AOTAutograd's export of a joint graph, ``make_fx``
    of a segment): the torch version, piper's source, functorch's configuration, autocast, SDPA backends,
    determinism, inference mode (an export under ``torch.inference_mode`` had no backward; grad mode is not
    read: a segment compiled ahead under it and one compiled at first use without it are the same)."""
    import torch._functorch.config as functorch_config

    autocast = [(d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda")]
    sdp = [f() for f in (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
                         torch.backends.cuda.math_sdp_enabled)]
    return repr((torch.__version__, package_hash(), sorted(functorch_config.save_config_portable().items()),
                 autocast, sdp, torch.are_deterministic_algorithms_enabled(), torch.is_inference_mode_enabled()))
