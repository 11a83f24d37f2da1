"""A stage's sent activations are freed by the executor's own thread, once the peer has them.

gloo keeps a sent tensor alive until its work is dropped, so the runtime waits for each gloo send on a
reaper thread (``runtime/comm._Reaper``). When that thread also dropped the work, the tensor was freed
there: invisible to the profiler's CPU memory records (they follow the threads the profiler runs on), whose
running total then never came down. The CPU allocator test read a pipeline stage's sends as held to the
end of the run: stage 0 of PP2 GPipe, 0.5 MiB more per step profiled (7.03, 7.53, 8.03 MiB over three
steps). Now the reaper only waits; the work, and the tensor with it, go when the executor retires the send.
"""
from __future__ import annotations

import threading
import time
import weakref

import torch
import torch.distributed as dist

from piper_compile.runtime import comm
from piper_compile.testing.launch import run_local


def _worker(rank: int, world: int) -> dict[str, object]:
    if rank == 1:
        buf = torch.empty(1 << 16)
        comm.irecv(buf, 0, None).wait()
        dist.barrier()
        return {"got": float(buf.sum())}
    t = torch.ones(1 << 16)
    freed_on: list[int] = []
    weakref.finalize(t, lambda: freed_on.append(threading.get_ident()))
    sent = comm.isend(t, 1, None)
    del t
    deadline = time.monotonic() + 30
    while not sent.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    completed, held_after_completion = sent.is_completed(), not freed_on
    del sent  # what Executor._retire_sends does once it sees the send complete
    dist.barrier()
    return {"completed": completed, "held": held_after_completion,
            "freed_here": freed_on == [threading.get_ident()]}


def test_a_completed_send_frees_its_tensor_on_the_thread_that_drops_it():
    sender, receiver = run_local(_worker, 2)
    assert receiver["got"] == float(1 << 16)
    assert sender["completed"], "the reaper never saw the send complete"
    assert sender["held"], "the tensor was freed before the executor dropped the send (on the reaper thread)"
    assert sender["freed_here"], "the tensor was not freed by the thread that dropped the send"
