"""Inductor's once-per-process setup, started early so it overlaps piper's capture and planning.

On CPU, Inductor's first compilation probes which vector instruction sets the C++ compiler and the CPU
support, by building and loading a small program per candidate (AVX-512, AVX2, ...): about 6 s on a
2-core machine, in every rank's process, before the first kernel is generated. piper starts the probe in a
background thread when its backend is first given a graph, so it runs while Dynamo's graph is captured
and the step planned (the probe mostly waits on the compiler, a subprocess, so it leaves the interpreter to
the capture); the first segment compilation waits for it to finish. The probe's result is Inductor's own
(``cpu_vec_isa.pick_vec_isa``, cached for the process), so nothing about the generated code changes.
"""
from __future__ import annotations

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


def start(device_type: str, codegen: str) -> None:
    """Start the probe once per process, for Inductor compiling for CPU."""
    global _started
    if device_type != "cpu" or codegen != "inductor":
        return
    with _lock:
        if _started is None:
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
