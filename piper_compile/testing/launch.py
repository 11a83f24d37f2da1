"""Run a function on N local gloo processes (``torch.multiprocessing`` spawn) and collect results.

Used by the example (when not under torchrun), the dist tests and the benchmarks. A child that fails
sends its traceback; a child that hangs past ``timeout_s`` is killed and reported.
"""
from __future__ import annotations

import io
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, threads: int,
           backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
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


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600,
              threads: int = 1, backend: str = "gloo") -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` local processes (gloo; ``backend="nccl"`` puts
    rank r on GPU r); returns results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue, threads, backend), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as queue_mod
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout_s)
            except queue_mod.Empty:
                raise TimeoutError(f"piper: local run of {world_size} processes did not finish within {timeout_s}s; "
                                   f"finished ranks: {sorted(results)}") from None
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors or len(results) < world_size else 60)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("piper: a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
