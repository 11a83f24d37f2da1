"""Compiling each distinct segment once per job, and once per machine across runs.

Segments are compiled through Inductor's on-disk FX graph cache (``TORCHINDUCTOR_CACHE_DIR``, by default
one directory per user on the machine), which keys a graph by its code, input shapes and dtypes, the
Inductor configuration and the torch version. Ranks that run the same segment -- data-parallel replicas,
every rank of a ZeRO group, identical stages of interleaved schedules -- would otherwise all compile it at
the same moment, each missing the cache. ``one_compiler`` makes them take turns per segment: a file lock
keyed by a hash of the same things, so the first rank compiles (a miss, written to the cache) and every
other rank then loads the artifact (a hit). Different segments compile in parallel. A second run of the
job finds every segment in the cache. ``outcome`` reads Inductor's counters to say which it was.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from typing import Any, Iterator

import torch
from torch import fx


def cache_root() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its per-user default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except (ImportError, AttributeError):  # another torch layout: the default's own rule
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "torchinductor_piper")


def segment_key(static: fx.GraphModule, args: list[Any]) -> str:
    """A hash of what the FX graph cache keys a segment by (its code, inputs, the torch version)."""
    sig = [(tuple(a.shape), tuple(a.stride()), str(a.dtype), a.device.type) if isinstance(a, torch.Tensor) else repr(a)
           for a in args]
    text = f"{torch.__version__}|{static.code}|{sig}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@contextlib.contextmanager
def one_compiler(key: str) -> Iterator[None]:
    """Hold the machine-wide lock of segment ``key`` while compiling it (ranks take turns per segment)."""
    import fcntl

    locks = os.path.join(cache_root(), "piper-locks")
    os.makedirs(locks, exist_ok=True)
    with open(os.path.join(locks, f"{key}.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def counts() -> tuple[int, int]:
    """Inductor's FX graph cache (hits, misses) in this process so far."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])


def outcome(before: tuple[int, int], after: tuple[int, int]) -> str:
    """"hit" (loaded from the cache), "miss" (compiled, and written to it) or "bypass" (not cacheable)."""
    if after[0] > before[0]:
        return "hit"
    return "miss" if after[1] > before[1] else "bypass"
