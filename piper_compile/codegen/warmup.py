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
is never written down, so it runs again every time, as in Inductor. Likewise Inductor names its
precompiled C++ header by preprocessing the header in a ``g++ -E`` child and hashing the output (~0.4 s
per process, before it even looks for a kernel library on disk); piper writes down the name it got, keyed
by the header, the compile command, the compiler and torch's install, and a later process takes it while
that precompiled header is on disk -- the same name, so the same compile commands.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import threading
from typing import Any, Callable

from piper_compile.codegen.hooks import wrap_once
from piper_compile.disk import write_record

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
            write_record(mark, "")
        return ok

    return load


def _header_mark(header: str, cmd_line: str, command: dict[str, Any]) -> str | None:
    """Where the precompiled ``header`` for this compile command is written down: keyed by the header,
    the command (its compiler by path, size and time), the header file itself and torch's version and CPU
    library (a reinstalled torch brings new headers), and the interpreter."""
    import shutil

    import torch

    from piper_compile.disk import cache_root

    root = os.path.dirname(torch.__file__)
    try:
        compiler = shutil.which(cmd_line.split(" ", 1)[0]) or ""
        stats = [os.stat(f) for f in (compiler, os.path.join(root, "include", header),
                                      os.path.join(root, "lib", "libtorch_cpu.so"))]
    except OSError:
        return None
    options = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(sorted(command.items(), key=lambda kv: kv[0])))  # the vec ISA's repr
    text = "|".join([header, cmd_line, options, compiler, torch.__version__,
                     sys.executable, *(f"{st.st_size}:{st.st_mtime_ns}" for st in stats)])
    return os.path.join(cache_root(), "piper-pch", hashlib.sha256(text.encode()).hexdigest()[:32])


def remembered_header(build: Callable[..., str]) -> Callable[..., str]:
    """``build(header, cmd_line, **command)`` (Inductor's ``_precompile_header``: preprocesses the header in
    a ``g++ -E`` child and hashes the output to name the precompiled header, ~0.4 s once per process, then
    builds it if missing) that returns the path it gave last time for the same key while that precompiled
    header is still on disk. The path, and so every compile command, is the one Inductor computes."""
    @functools.cache  # once per process and arguments, as Inductor's own
    def precompile(header: str, cmd_line: str, **command: Any) -> str:
        mark = _header_mark(header, cmd_line, command)
        try:
            with open(mark or "", encoding="utf-8") as fh:
                path = fh.read()
        except OSError:
            path = ""
        if not (path and os.path.exists(path) and os.path.exists(path + ".gch")):
            path = build(header, cmd_line, **command)
            if mark is not None and os.path.exists(path + ".gch"):
                write_record(mark, path)
        return path

    return precompile


def _remember_headers() -> None:
    """Install :func:`remembered_header` on Inductor's header precompiler (where it has one)."""
    wrap_once("torch._inductor.codecache", "_precompile_header", remembered_header)


def _remember_probes() -> None:
    """Install :func:`remembered` on Inductor's vec-ISA load probe and :func:`remembered_header` on its header
    precompiler (``PIPER_FAST_LOAD``: 'auto' from the torch it is tested with; a torch without them is left
    as it is)."""
    from piper_compile.disk import fast_load_on

    if not fast_load_on():
        return
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:
        return
    wrap_once(VecISA, "_probe_load", remembered)
    _remember_headers()


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
