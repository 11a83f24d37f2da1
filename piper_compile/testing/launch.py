"""Run a function on N local gloo processes and collect results.

Used by the example (when not under torchrun), the dist tests and the benchmarks. Children fork from a
``forkserver`` that imported torch and piper once, so a child starts in a fraction of a second instead of
importing them again (~4 s of CPU each; the dist tests ran about twice as fast); each child gets the
parent's environment as it is at the call, and, since a forked child ends in ``os._exit``, runs the exit
handlers a normal exit runs (piper's group release among them) itself. A child that fails sends its
traceback; a child that hangs past ``timeout_s`` is killed and reported; a child that dies without
reporting (a signal, ``os._exit``) is reported at once; and a child that reported its result but then
exits badly (a crash in an exit handler or destructor: ``terminate called without an active
exception``, SIGABRT) fails the run too, with its rank, the signal and the tail of its stderr. Each
child's stderr goes to a file of its own that a thread copies to this process's stderr line by line as it
arrives, so the output is live and the tail is at hand.

``PIPER_RANK_NETNS=ns0,ns1,...`` (set by ``benchmarks/emulated_link.py --per-rank``) puts rank r in network
namespace ``ns<r>`` before it connects, so each rank talks over a link of its own (interface
``PIPER_RANK_IFNAME``, rank 0 reachable at the first address of ``PIPER_RANK_ADDRS``).
"""
from __future__ import annotations

import atexit
import ctypes
import faulthandler
import io
import os
import queue as queue_mod
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from piper_compile.knobs import knob


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CLONE_NEWNET = 0x40000000


def enter_rank_netns(rank: int, world: int) -> str:
    """Move this process into rank ``rank``'s network namespace when ``PIPER_RANK_NETNS`` names one per
    rank; returns the address rank 0 listens on (``127.0.0.1`` when the variable is unset)."""
    names = [n for n in knob("PIPER_RANK_NETNS").split(",") if n]
    if not names:
        return "127.0.0.1"
    addrs = knob("PIPER_RANK_ADDRS").split(",")
    if len(names) < world or len(addrs) < world:
        raise RuntimeError(f"piper: PIPER_RANK_NETNS/PIPER_RANK_ADDRS name {len(names)}/{len(addrs)} ranks but "
                           f"{world} were launched; create one namespace per rank (emulated_link.py --per-rank "
                           f"{world})")
    fd = os.open(f"/var/run/netns/{names[rank]}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"piper: setns into network namespace {names[rank]!r} failed")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = knob("PIPER_RANK_IFNAME")
    return addrs[0]


def _context() -> Any:
    """Children fork from a server that imported torch and piper once (``forkserver`` with preload): a
    child starts in well under a second instead of paying the ~4 s import each time."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "piper_compile", "piper_compile.testing.parity"])
    return ctx


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, threads: int,
           backend: str, log: str | None, env: dict[str, str]) -> None:
    os.environ.clear()  # the parent's environment now (the fork server's is from when it started)
    os.environ.update(env)
    if log is not None:  # fd 2 itself, so that C++ (c10d, gloo, std::terminate) writes there too
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it hangs, when the launcher asks (run_local)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        host = enter_rank_netns(rank, world)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        result = fn(rank, world, *args)
        buf = io.BytesIO()  # plain bytes: tensors in shared memory would die with this process
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        atexit._run_exitfuncs()  # a forked child ends in os._exit: run what a normal exit runs (crashes count)


class _StderrCopier:
    """Each child's stderr in a file of its own; a thread copies complete new lines to this process's
    stderr as they arrive (live output, ranks' lines not torn apart) and the tail stays readable."""

    def __init__(self, world_size: int) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="piper_run_local_")
        self.paths = [os.path.join(self.dir.name, f"rank{r}.stderr") for r in range(world_size)]
        for path in self.paths:
            open(path, "wb").close()
        self._offsets = [0] * world_size
        self._partial = [b""] * world_size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="piper-stderr-copier", daemon=True)
        self._thread.start()

    def _copy(self, final: bool = False) -> None:
        for r, path in enumerate(self.paths):
            with open(path, "rb") as f:
                f.seek(self._offsets[r])
                data = f.read()
            self._offsets[r] += len(data)
            data = self._partial[r] + data
            cut = len(data) if final else data.rfind(b"\n") + 1
            self._partial[r] = data[cut:]
            if cut:
                try:
                    sys.stderr.write(data[:cut].decode(errors="replace"))
                    sys.stderr.flush()
                except (OSError, ValueError):  # our stderr closed: keep the files, lose the copy
                    pass

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._copy()

    def tail(self, rank: int, lines: int = 20) -> str:
        with open(self.paths[rank], "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._copy(final=True)
        self.dir.cleanup()


def exit_description(code: int | None) -> str:
    """``exit code 1`` / ``signal SIGABRT`` for a child's ``Process.exitcode``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600,
              threads: int = 1, backend: str = "gloo", dies: tuple[int, ...] = ()) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` local processes (gloo; ``backend="nccl"`` puts
    rank r on GPU r); returns results by rank. Raises if any rank raised, hung, died, or exited with a
    nonzero code or a signal after reporting its result. ``dies``: ranks a test ends on purpose (a
    crash drill); each may end without reporting, and its result is then how it exited
    (``"signal SIGKILL"``, ``"exit code 3"``)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    logs = _StderrCopier(world_size)
    env = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue, threads, backend, logs.paths[r],
                                              env), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    killed: set[int] = set()
    try:
        try:
            _collect(procs, queue, results, errors, timeout_s, logs, dies)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{_stacks(procs, results, logs)}") from None
        finally:
            for r, p in enumerate(procs):
                p.join(timeout=5 if errors or len(results) < world_size else 60)
            for r, p in enumerate(procs):
                if p.is_alive():
                    killed.add(r)
                    p.kill()
                    p.join()
        if not errors:  # every rank reported success: each must also have exited cleanly
            for r, p in enumerate(procs):
                if r in dies:
                    continue
                if r in killed:
                    errors.append(f"--- rank {r} ---\nreported its result but did not exit within 60s (killed); "
                                  f"the end of its stderr:\n{logs.tail(r)}")
                elif p.exitcode != 0:
                    errors.append(f"--- rank {r} ---\nreported its result but then exited with "
                                  f"{exit_description(p.exitcode)} (a crash at interpreter exit); the end of its "
                                  f"stderr:\n{logs.tail(r)}")
    finally:
        logs.close()
    if errors:
        raise RuntimeError("piper: a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _stacks(procs: list[Any], results: dict[int, Any], logs: "_StderrCopier") -> str:
    """The Python stacks of every rank still running (each dumps its threads to its stderr on SIGUSR1)."""
    running = [r for r, p in enumerate(procs) if r not in results and p.is_alive()]
    for r in running:
        os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    return "\n".join(f"--- rank {r}: where it was ---\n{logs.tail(r, 60)}" for r in running)


def _collect(procs: list[Any], queue: Any, results: dict[int, Any], errors: list[str], timeout_s: float,
             logs: _StderrCopier, dies: tuple[int, ...]) -> None:
    """Take the children's reports until all are in, one is a failure, one died without reporting (not
    one of ``dies``), or ``timeout_s`` passed without any report."""
    world_size = len(procs)
    last = time.monotonic()
    while len(results) < world_size:
        try:
            rank, ok, payload = queue.get(timeout=0.5)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
            if dead:
                try:  # its report may still be in the pipe behind the exit
                    rank, ok, payload = queue.get(timeout=2)
                except queue_mod.Empty:
                    for r in (r for r in dead if r in dies):
                        results[r] = exit_description(procs[r].exitcode)
                    if all(r in dies for r in dead):
                        continue
                    r = next(r for r in dead if r not in dies)
                    errors.append(f"--- rank {r} ---\ndied without reporting a result ("
                                  f"{exit_description(procs[r].exitcode)}); the end of its stderr:\n{logs.tail(r)}")
                    return
            elif time.monotonic() - last > timeout_s:
                raise TimeoutError(f"piper: local run of {world_size} processes did not finish within {timeout_s}s; "
                                   f"finished ranks: {sorted(results)}") from None
            else:
                continue
        last = time.monotonic()
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
            return
