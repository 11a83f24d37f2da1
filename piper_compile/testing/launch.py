"""Run a function on N local gloo processes (``torch.multiprocessing`` spawn) and collect results.

Used by the example (when not under torchrun), the dist tests and the benchmarks. A child that fails
sends its traceback; a child that hangs past ``timeout_s`` is killed and reported.

``PIPER_RANK_NETNS=ns0,ns1,...`` (set by ``benchmarks/emulated_link.py --per-rank``) puts rank r in network
namespace ``ns<r>`` before it connects, so each rank talks over a link of its own (interface
``PIPER_RANK_IFNAME``, rank 0 reachable at the first address of ``PIPER_RANK_ADDRS``).
"""
from __future__ import annotations

import ctypes
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


_CLONE_NEWNET = 0x40000000


def enter_rank_netns(rank: int, world: int) -> str:
    """Move this process into rank ``rank``'s network namespace when ``PIPER_RANK_NETNS`` names one per
    rank; returns the address rank 0 listens on (``127.0.0.1`` when the variable is unset)."""
    names = [n for n in os.environ.get("PIPER_RANK_NETNS", "").split(",") if n]
    if not names:
        return "127.0.0.1"
    addrs = os.environ.get("PIPER_RANK_ADDRS", "").split(",")
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
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("PIPER_RANK_IFNAME", "pl0")
    return addrs[0]


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, threads: int,
           backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
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
