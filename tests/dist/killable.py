"""Test helpers for runs in which a rank is killed on purpose: a launcher that survives it, and a crash
injector that SIGKILLs this process at the n-th event of a piece of code.

``run_killable(fn, world, *args)`` runs ``fn(rank, world, *args)`` on ``world`` gloo processes like
``piper_compile.testing.launch.run_local``, but a rank that dies (SIGKILL) or hangs is an outcome, not
an error: it returns one ``(status, value)`` per rank, status ``"ok"`` (value: what ``fn`` returned),
``"error"`` (the traceback), ``"killed"`` (killed by a signal: ``-signal``) or ``"hung"`` (still running at
the deadline; then killed). Processes start from a fork server that has torch and piper imported, so a
trial costs a process group and a compile, not an interpreter start.

``kill_at(n_calls=..., n_io=..., after=...)`` installs a profiler that counts function calls in checkpoint
code (piper's, DCP's, torch.distributed's collectives) and file-system operations (open, write, fsync,
rename, ...), optionally from a named checkpoint function on (``after=("write_record", 1)``), and SIGKILLs
the process just before the ``n_calls``-th call or the ``n_io``-th file-system operation;
``count_events()`` counts them without killing and records where the named functions start.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

import torch

_CODE = ("piper_compile.checkpoint", "torch.distributed.checkpoint", "torch.distributed.distributed_c10d")
_IO = frozenset({"open", "write", "flush", "close", "fsync", "rename", "replace", "unlink", "rmdir", "mkdir",
                 "listdir", "scandir", "makedirs", "rmtree", "truncate"})
_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "piper_compile"])
    return _CTX


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        result: tuple[str, Any] = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    torch.save(result, out + ".part")
    os.replace(out + ".part", out)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_killable(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120,
                 workdir: str) -> list[tuple[str, Any]]:
    from piper_compile.testing.launch import free_port

    ctx = _context()
    port = free_port()
    outs = [os.path.join(workdir, f".rank{r}-{port}.pt") for r in range(world)]
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    running = list(procs)
    while running and time.monotonic() < deadline:
        wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic()))
        running = [p for p in running if p.is_alive()]
    for p in running:
        p.kill()
    results = []
    for r, p in enumerate(procs):
        p.join()
        if os.path.exists(outs[r]):
            results.append(torch.load(outs[r], weights_only=False))
            os.remove(outs[r])
        elif p in running:
            results.append(("hung", None))
        else:
            results.append(("killed", p.exitcode))
    return results


class _Counter:
    """Counts checkpoint-code calls and file-system operations; from the ``after[1]``-th call of a checkpoint
    function named ``after[0]`` on, if given. ``marks``: (name, calls, io) at every call of a function named
    in ``MARKS`` (for choosing windows)."""

    MARKS = ("write_record", "commit", "on_rank0", "finish")

    def __init__(self, n_calls: int | None, n_io: int | None, after: tuple[str, int] | None) -> None:
        self.calls = self.io = 0
        self.n_calls, self.n_io, self.after = n_calls, n_io, after
        self.armed = after is None
        self.seen: dict[str, int] = {}
        self.marks: list[tuple[str, int, int]] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            if not frame.f_globals.get("__name__", "").startswith(_CODE):
                return
            name = frame.f_code.co_name
            if name in self.MARKS and frame.f_globals["__name__"].startswith("piper_compile"):
                self.marks.append((name, self.calls, self.io))
                self.seen[name] = self.seen.get(name, 0) + 1
                if not self.armed and self.after == (name, self.seen[name]):
                    self.armed, self.calls, self.io = True, 0, 0
            if not self.armed:
                return
            self.calls += 1
            if self.calls == self.n_calls:
                os.kill(os.getpid(), signal.SIGKILL)
        elif event == "c_call" and self.armed and getattr(arg, "__name__", "") in _IO:
            self.io += 1
            if self.io == self.n_io:
                os.kill(os.getpid(), signal.SIGKILL)


def kill_at(n_calls: int | None = None, n_io: int | None = None, after: tuple[str, int] | None = None) -> _Counter:
    """SIGKILL this process just before the ``n_calls``-th checkpoint-code call or the ``n_io``-th file-system
    operation from now on (any thread), counted from the ``after[1]``-th call of the checkpoint function
    named ``after[0]`` if given; ``stop_counting()`` ends it."""
    c = _Counter(n_calls, n_io, after)
    threading.setprofile(c)
    sys.setprofile(c)
    return c


def count_events() -> _Counter:
    return kill_at()


def stop_counting() -> None:
    sys.setprofile(None)
    threading.setprofile(None)
