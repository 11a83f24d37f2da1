"""Inductor's once-per-process setup, started early so it overlaps piper's capture and planning.

On CPU, Inductor's first compilation probes which vector instruction sets the C++ compiler and the CPU
support, by building and loading a small program per candidate (AVX-512, AVX2, ...): about 6 s on a
2-core machine, in every rank's process, before the first kernel is generated. piper starts the probe in a
background thread when its backend is first given a graph, so it runs while Dynamo's graph is captured
and the step planned (the probe mostly waits on the compiler, a subprocess, so it leaves the interpreter to
the capture); the first segment compilation waits for it to finish. The probe's result is Inductor's own
(``cpu_vec_isa.pick_vec_isa``, cached for the process), so nothing about the generated code changes.

On a warm run the probe's libraries are in the cache already, but Inductor still checks each one loads by
starting a child Python that ``dlopen``s it: about 0.7 s of CPU per rank, which ranks sharing cores feel.
Where ``PIPER_FAST_LOAD`` is on, piper writes down each library that loaded (its path, size and time, with
torch's own library and version); the same library on the same torch is not probed again. A failed probe
is never written down, so it runs again every time, as in Inductor.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
from typing import Any, Callable

_started: threading.Thread | None = None
_lock = threading.Lock()


def _probe() -> None:
    try:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()
    except Exception:  # noqa: BLE001 - the first compilation probes again and reports any error itself
        pass


def _probe_mark(library: str) -> str | None:
    """Where a successful load probe of ``library`` is written down: keyed by the library's path, size and
    modification time, torch's version and its CPU library's size and time, and the interpreter."""
    import torch

    from piper_compile.disk import cache_root

    try:
        lib = os.stat(library)
        own = os.stat(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None
    text = f"{library}|{lib.st_size}|{lib.st_mtime_ns}|{torch.__version__}|{own.st_size}|{own.st_mtime_ns}|{sys.executable}"
    return os.path.join(cache_root(), "piper-isa", hashlib.sha256(text.encode()).hexdigest()[:32])


def remembered(probe: Callable[[Any, str], bool]) -> Callable[[Any, str], bool]:
    """``probe(isa, library)`` (Inductor's ``VecISA._probe_load``) that skips libraries which loaded before."""
    def load(isa: Any, library: str) -> bool:
        mark = _probe_mark(library)
        if mark is not None and os.path.exists(mark):
            return True
        ok = probe(isa, library)
        if ok and mark is not None:
            try:
                os.makedirs(os.path.dirname(mark), exist_ok=True)
                open(mark, "w").close()
            except OSError:
                pass  # only the shortcut is lost
        return ok

    load.piper_remembered = True  # type: ignore[attr-defined]
    load.__wrapped__ = probe  # type: ignore[attr-defined]
    return load


def _remember_probes() -> None:
    """Install :func:`remembered` on Inductor's vec-ISA load probe (``PIPER_FAST_LOAD``: 'auto' from the torch
    it is tested with; a torch without the probe method is left as it is)."""
    from piper_compile.disk import fast_load_on

    if not fast_load_on():
        return
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:
        return
    probe = getattr(VecISA, "_probe_load", None)
    if callable(probe) and not getattr(probe, "piper_remembered", False):
        VecISA._probe_load = remembered(probe)  # type: ignore[method-assign]


def start(device_type: str, codegen: str) -> None:
    """Start the probe once per process, for Inductor compiling for CPU."""
    global _started
    if device_type != "cpu" or codegen != "inductor":
        return
    with _lock:
        if _started is None:
            _remember_probes()
            _started = threading.Thread(target=_probe, name="piper-inductor-warmup", daemon=True)
            _started.start()


def start_for(example_inputs: list[Any], codegen: Callable[[], str]) -> None:
    """:func:`start` for a step given ``example_inputs``; ``codegen()`` reads its option (bad options are
    reported by the step's first call, not here)."""
    import torch

    from piper_compile.errors import PiperError

    device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
    try:
        start(device, codegen())
    except PiperError:
        return


def wait() -> None:
    """Let the probe finish before compiling (so two threads never run it at once)."""
    if _started is not None:
        _started.join()
