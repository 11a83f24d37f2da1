"""Process groups, one per (stream name, device group), created in the same order on every rank from
the global DAG -- so streams do not serialise one another (on CPU: separate gloo contexts; on CUDA:
separate NCCL communicators, each with its own CUDA stream).

Group creation is where a rank that never got to piper is noticed: before a batch of groups is created,
every rank announces itself in the default store and waits (``options["timeout"]``) for the others, so a
missing rank is named (``arrive``) instead of surfacing as a bare ``DistStoreError`` from
``new_group``. A failed collective or receive is described by ``describe_failure``: a peer that closed
its connection (crashed or exited) is told apart from one that is merely slow.
"""
from __future__ import annotations

import atexit
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from piper_compile.errors import PiperRuntimeError
from piper_compile.ir.dag import TrainingDAG


def world_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def group_keys(dag: TrainingDAG, world_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every process group the DAG's ops need (``Op.process_groups``), sorted: the creation order."""
    return sorted({k for n in dag for k in n.op.process_groups(n, world_size)})


_GROUPS: dict[tuple[str, tuple[int, ...], str], Any] = {}
_OWNER: list[Any] = [None]  # the default process group the cached groups belong to
_BATCHES = [0]  # group-creation batches made in this world so far (the arrival keys' namespace)


def _same_world() -> None:
    """Forget groups (and arrival batches) of an earlier world re-initialised in this process."""
    if _OWNER[0] is not dist.group.WORLD:
        release_groups()
        _OWNER[0] = dist.group.WORLD
        if not _AT_EXIT:
            _AT_EXIT.append(atexit.register(release_groups))


_AT_EXIT: list[Any] = []


def release_groups() -> None:
    """Drop piper's references to its process groups (and to the world they belong to). Registered with
    ``atexit`` at the first group: the groups' gloo worker threads then end while the interpreter is
    alive. Left to interpreter finalization, a group's destructor can run after the GIL is gone and
    abort the process ("terminate called without an active exception") although the run succeeded."""
    _GROUPS.clear()
    _BATCHES[0] = 0
    _OWNER[0] = None


def check_group(timeout_s: float) -> Any:
    """The world's gloo group for piper's call checks, made at the first call (see ``consistency``)."""
    _same_world()
    key = ("piper:check", tuple(range(dist.get_world_size())), "gloo")
    if key not in _GROUPS:
        _GROUPS[key] = new_groups([(key[1], "piper:check", "gloo")], timeout_s)[0]
    return _GROUPS[key]


def arrive(timeout_s: float) -> None:
    """Collective: say this rank reached piper's setup and wait up to ``timeout_s`` for every rank of
    the world to say so too. Called before each batch of group creation (every rank makes the same
    batches in the same order); one store write and one store wait. A rank that never arrives -- it
    crashed, raised or is still in other code -- is named on every rank that did, instead of each of them
    failing inside ``new_group`` with a bare store timeout."""
    _same_world()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1 or dist.get_backend() == "fake":  # a fake world's other ranks are simulated
        return
    store = dist.distributed_c10d._get_default_store()
    prefix = f"piper/setup/{_BATCHES[0]}/"
    _BATCHES[0] += 1
    t0 = time.perf_counter()
    try:
        store.set(f"{prefix}{rank}", "1")
        store.wait([f"{prefix}{r}" for r in range(world)], timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - DistStoreError on timeout, a socket error if the store died
        raise _arrival_error(store, prefix, rank, world, time.perf_counter() - t0, timeout_s, e) from None


def _arrival_error(store: Any, prefix: str, rank: int, world: int, waited: float, timeout_s: float,
                   cause: Exception) -> PiperRuntimeError:
    try:
        missing = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
    except Exception:  # noqa: BLE001 - the store itself is gone
        return PiperRuntimeError(
            f"piper: rank {rank}: the rendezvous store (hosted by rank 0 or the launcher) became unreachable "
            f"after {waited:.1f}s while the ranks met at piper's setup (the first call of the compiled step, "
            f"before its process groups are created) ({cause_line(cause)}): rank 0 or the launcher has likely "
            "crashed or exited; look for the first error in its log.")
    shown = ", ".join(map(str, missing[:16])) + (f", ... ({len(missing)} ranks)" if len(missing) > 16 else "")
    if not missing:  # everyone arrived just as the wait gave up
        shown = "(none missing by now: a rank arrived after the deadline)"
    return PiperRuntimeError(
        f"piper: rank {rank}: rank(s) [{shown}] never reached piper's setup (the first call of the compiled step, "
        f"where piper creates its process groups) within {timeout_s:g}s: they crashed, raised or are still "
        "running other code before it. Every rank must call the compiled step; look for the first error in "
        "their logs, or raise options['timeout'] if they are only slower to get there (loading data, "
        "compiling).")


def new_groups(specs: list[tuple[tuple[int, ...], str, str]], timeout_s: float) -> list[Any]:
    """Collective: create one process group per ``(ranks, description, backend)`` after ``arrive``.
    Every piper group goes through here (one arrival per call), on every rank in the same order."""
    arrive(timeout_s)
    out = []
    for ranks, desc, backend in specs:
        t0 = time.perf_counter()
        try:
            out.append(dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s), backend=backend,
                                      group_desc=desc))
        except Exception as e:  # noqa: BLE001 - a store timeout or a closed connection, deep in c10d
            raise PiperRuntimeError(
                f"piper: rank {dist.get_rank()}: creating process group {desc!r} over ranks {list(ranks)} failed "
                f"after {time.perf_counter() - t0:.1f}s ({cause_line(e)}): a rank of the world stopped between "
                "piper's setup check and the group's creation (it crashed, raised or timed out); look for the "
                "first error in the other ranks' logs.") from None
    return out


class GroupRegistry:
    """Lazily shared process groups keyed by (stream, ranks). Creation is collective: every rank calls
    ``ensure`` with the same keys in the same order (the keys come from the global DAG)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)

    def ensure(self, keys: list[tuple[str, tuple[int, ...]]]) -> None:
        _same_world()
        backend = dist.get_backend()
        todo = [(stream, ranks) for stream, ranks in keys if (stream, ranks, backend) not in _GROUPS]
        if not todo:
            return
        made = new_groups([(ranks, f"piper:{stream}:{'_'.join(map(str, ranks))}", backend) for stream, ranks in todo],
                          self.timeout_s)
        for (stream, ranks), group in zip(todo, made):
            _GROUPS[(stream, ranks, backend)] = group

    def get(self, stream: str, ranks: tuple[int, ...]) -> Any:
        return _GROUPS[(stream, tuple(sorted(ranks)), dist.get_backend())]


# -- what a failed collective or receive means ----------------------------------------------------
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset", "epipe",
           "socket closed", "connection refused", "end of file", "remote process exited")
_TIMED_OUT = ("timed out", "timeout")


def cause_line(cause: BaseException) -> str:
    """``Type: first line`` of an exception, whole (gloo puts the reason after a long source location)."""
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def settle(work: Any, grace_s: float = 2.0) -> None:
    """After a wait on ``work`` timed out: give the collective a moment to fail by itself. piper creates
    every group with ``options["timeout"]``, so gloo's own timeout ends the operation at about the same
    time; until it does, a gloo worker thread is inside the collective, and a process that exits then
    (the user's script ending on piper's error) aborts at interpreter exit with ``terminate called without
    an active exception`` instead of exiting with its traceback's status."""
    deadline = time.perf_counter() + grace_s
    try:
        while not work.is_completed() and time.perf_counter() < deadline:
            time.sleep(1e-3)
    except Exception:  # noqa: BLE001 - a failed work may raise from is_completed: it is settled
        pass


def peer_closed(cause: BaseException | None) -> bool:
    """Whether a communication error says the other side closed the connection (it crashed or exited)."""
    text = str(cause).lower() if cause is not None else ""
    return any(k in text for k in _CLOSED)


def timed_out(cause: BaseException | None) -> bool:
    """Whether a communication error is a timeout (no cause: ``wait`` returned False)."""
    return cause is None or any(k in str(cause).lower() for k in _TIMED_OUT)


def describe_failure(cause: BaseException | None, waited_s: float, timeout_s: float, peers: list[int]) -> str:
    """What happened to a failed communication wait, after how long, with whom, and what to do: the end
    of a sentence that starts by naming the operation. ``peers``: the other ranks of the operation."""
    who = f"peer rank {peers[0]}" if len(peers) == 1 else f"a rank of {peers}"
    logs = f"rank {peers[0]}'s log" if len(peers) == 1 else "the other ranks' logs"
    if peer_closed(cause):
        assert cause is not None
        return (f"failed after {waited_s:.2f}s: {who} closed the connection (it crashed or exited) "
                f"({cause_line(cause)}). Look for the first error in {logs}")
    if timed_out(cause):
        why = f" ({cause_line(cause)})" if cause is not None else ""
        return (f"did not complete within {timeout_s:g}s{why}: {who} is stuck, has failed or runs a different "
                "schedule. Raise options['timeout'] if the step is just slow")
    assert cause is not None
    return f"failed after {waited_s:.2f}s ({cause_line(cause)}). Look for the first error in the other ranks' logs"
