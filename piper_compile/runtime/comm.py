"""Every collective and message the runtime issues, in one place, with host staging.

NCCL refuses two ranks on one GPU, so ranks that share a GPU run over gloo, and gloo does not move CUDA
tensors for every operation (point-to-point, all-to-all, reduce-scatter). Each function here issues
its operation as is, unless the tensor is on CUDA and the group is a gloo group: then it is *staged*
through pinned host memory -- the inputs copied to host buffers (synchronously, so the host copy is
complete before gloo reads it), the operation issued on those, and the outputs copied back to the
device when the work is waited for (``Staged.wait``). Staging is automatic; ``PIPER_HOST_STAGING=always``
also stages CPU tensors (through plain host copies), so CPU tests run the same path.
"""
from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from piper_compile.knobs import knob

# all_gather_single / reduce_scatter_single replace the *_tensor names in newer torch (>= 2.13)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Staged:
    """A staged operation's work: waiting for it waits for gloo's work on the host buffers, then copies
    the received host buffers back into the device tensors (once). Also a work whose result is a copy
    of part of what it wrote (``reduce_scatter_consuming``)."""

    def __init__(self, work: Any, copy_back: list[tuple[torch.Tensor, torch.Tensor]],
                 keep: list[torch.Tensor] | None = None) -> None:
        self.work, self.copy_back = work, copy_back
        self.keep = keep or []  # host buffers gloo reads or writes until the work completes
        self._copied: tuple[Any, torch.device] | None = None  # CUDA: an event after the copies back, and where

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait on the host, then copy back (the first time) on the current stream. A later wait from
        another stream orders that stream after the copies, as a second ``wait()`` of NCCL work does: an
        overlap partner waits on the CUDA side stream, and the main stream may read the same value."""
        ok = True
        if self.work is not None:
            ok = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        if ok is not False:
            if self.copy_back:
                for dst, host in self.copy_back:
                    dst.copy_(host, non_blocking=dst.is_cuda)
                device = self.copy_back[0][0].device
                if device.type == "cuda":
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(device))
                    self._copied = (event, device)
                self.copy_back = []
            elif self._copied is not None:
                event, device = self._copied
                torch.cuda.current_stream(device).wait_event(event)
        return ok

    def get_future(self) -> Any:
        if self.work is None:
            raise RuntimeError("no work")
        return self.work.get_future()


def _staged(t: torch.Tensor, group: Any) -> bool:
    if knob("PIPER_HOST_STAGING") == "always":
        return True
    return t.is_cuda and dist.get_backend(group) == "gloo"


def _host(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A host buffer shaped like ``t`` (pinned for CUDA tensors), holding ``t``'s values when ``copy``."""
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    if copy:
        h.copy_(t)
    return h


def _run(issue: Callable[..., Any], group: Any, sent: list[torch.Tensor], got: list[torch.Tensor]) -> Any:
    """``issue(*sent, *got)`` on the tensors themselves, or on host copies (``got`` copied back at wait)."""
    probe = (sent or got)[0]
    if not _staged(probe, group):
        return issue(*sent, *got)
    hs = [_host(t) for t in sent]
    hg = [_host(t, copy=False) for t in got]
    return Staged(issue(*hs, *hg), list(zip(got, hg)), hs)


def all_reduce(t: torch.Tensor, group: Any) -> Any:
    """Start a SUM all-reduce of ``t`` in place."""
    if not _staged(t, group):
        return dist.all_reduce(t, group=group, async_op=True)
    h = _host(t)
    return Staged(dist.all_reduce(h, group=group, async_op=True), [(t, h)])


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    return _run(lambda i, o: _ALL_GATHER(o, i, group=group, async_op=True), group, [inp], [out])


class Works:
    """Several works waited for as one (``all_gather_in_place`` on gloo)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: timedelta | None = None) -> bool:
        ok = True
        for w in self.works:
            ok = (w.wait() if timeout is None else w.wait(timeout=timeout)) is not False and ok
        return ok


def all_gather_in_place(flat: torch.Tensor, group: Any) -> Any:
    """Every member's slice of ``flat`` (member i holds ``flat[i*L:(i+1)*L]``, ``L = len / members``) into
    every member's ``flat``. gloo's all-gather allocates a fresh output of the whole size and a flat copy
    of the input at every call (``newLikeFlat``) -- per step, on a ZeRO-1/2 bucket, that heap churn cost
    more peak RSS than the optimizer state ZeRO-1 saves -- so on a gloo group each member broadcasts its
    slice in place instead (the same bytes on the wire); elsewhere one ``all_gather_into_tensor``."""
    n = dist.get_world_size(group)
    size = flat.numel() // n
    me = dist.get_rank(group)
    if _staged(flat, group) or dist.get_backend(group) != "gloo":
        return all_gather(flat, flat[me * size:(me + 1) * size], group)
    return Works([dist.broadcast(flat[i * size:(i + 1) * size], src=dist.get_global_rank(group, i), group=group,
                                 async_op=True) for i in range(n)])


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    return _run(lambda i, o: _REDUCE_SCATTER(o, i, group=group, async_op=True), group, [inp], [out])


def reduce_scatter_consuming(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """:func:`reduce_scatter` of an ``inp`` nobody reads afterwards (a released gradient bucket). On a gloo
    group of CPU tensors it is summed in place by an all-reduce and this member's slice copied into
    ``out`` once waited for: gloo's reduce-scatter copies its whole input at every call (measured: +200 MiB
    of RSS per 200 MiB bucket) and took 1.8x the all-reduce's time on 2 and 4 CPU ranks."""
    if _staged(inp, group) or dist.get_backend(group) != "gloo":
        return reduce_scatter(out, inp, group)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    size = inp.numel() // n
    return Staged(dist.all_reduce(inp, group=group, async_op=True), [(out, inp[me * size:(me + 1) * size].view(out.shape))])


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
               group: Any) -> Any:
    return _run(lambda i, o: dist.all_to_all_single(o, i, out_splits, in_splits, group=group, async_op=True),
                group, [inp.contiguous()], [out])


def isend(t: torch.Tensor, dst: int, group: Any) -> Any:
    work = _run(lambda h: dist.isend(h, dst=dst, group=group), group, [t.contiguous()], [])
    return _reaper((id(group), dst)).reap(work) if dist.get_backend(group) == "gloo" else work


class Reaped:
    """A gloo send, waited for by its channel's reaper thread (:class:`_Reaper`). gloo's send work reports
    ``is_completed()`` only once waited on, and it keeps the sent tensor alive until it is dropped; so
    without this a send's tensor lives until the executor waits for it at the end of the step (every
    activation a stage sends). The reaper waits as soon as the send is issued; the executor sees
    ``is_completed()`` at its next instruction and drops this object, the work and the tensor with it
    (``Executor._retire_sends``), on its own thread: memory is freed where it was allocated, when the
    accounting stops counting it (a free on the reaper thread escapes the profiler's CPU memory records,
    whose running total then never comes down)."""

    def __init__(self, work: Any) -> None:
        self.work: Any = work
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            return False
        if self._error is not None:
            raise self._error
        return True


class _Reaper:
    """One long-lived daemon thread per send channel (process group, destination): messages of a rank pair
    complete in the order they were sent, so waiting for them in that order on one thread completes each as
    soon as its peer has it, without a thread started per send (which cost ~30 us of host time each)."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Reaped]" = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="piper-send").start()

    def reap(self, work: Any) -> Reaped:
        r = Reaped(work)
        self._queue.put(r)
        return r

    def _loop(self) -> None:
        while True:
            r = self._queue.get()
            try:
                r.work.wait()
            except BaseException as e:  # noqa: BLE001 - raised again to whoever waits
                r._error = e
            finally:
                r._done.set()
                del r


_REAPERS: dict[tuple[int, int], _Reaper] = {}
_REAPERS_LOCK = threading.Lock()


def _reaper(channel: tuple[int, int]) -> _Reaper:
    with _REAPERS_LOCK:
        if channel not in _REAPERS:
            _REAPERS[channel] = _Reaper()
        return _REAPERS[channel]


def irecv(buf: torch.Tensor, src: int, group: Any) -> Any:
    return _run(lambda h: dist.irecv(h, src=src, group=group), group, [], [buf])


def broadcast(t: torch.Tensor, src: int, group: Any = None) -> None:
    """Broadcast ``t`` in place from global rank ``src`` (blocking)."""
    if not _staged(t, group):
        dist.broadcast(t, src=src, group=group)
        return
    h = _host(t)
    dist.broadcast(h, src=src, group=group)
    t.copy_(h)


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group: Any = None,
                        bucket_bytes: int = 64 << 20) -> None:
    """Broadcast every tensor of ``tensors`` in place from global rank ``src`` (blocking), packed into one
    flat buffer per dtype and device of at most ``bucket_bytes`` (larger tensors go alone): a few
    collectives instead of one per tensor. Every rank passes the same tensors in the same order."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for same in buckets.values():
        start, size = 0, 0
        for i, t in enumerate(same):
            nbytes = t.numel() * t.element_size()
            if i > start and size + nbytes > bucket_bytes:
                _broadcast_flat(same[start:i], src, group)
                start, size = i, 0
            size += nbytes
        _broadcast_flat(same[start:], src, group)


def _broadcast_flat(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    if len(tensors) == 1:
        broadcast(tensors[0], src, group)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    broadcast(flat, src, group)
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()


def all_gather_list(parts: list[torch.Tensor], t: torch.Tensor, group: Any) -> None:
    """``dist.all_gather`` into ``parts`` (blocking)."""
    if not _staged(t, group):
        dist.all_gather(parts, t, group=group)
        return
    hs = [_host(p, copy=False) for p in parts]
    dist.all_gather(hs, _host(t), group=group)
    for p, h in zip(parts, hs):
        p.copy_(h)
