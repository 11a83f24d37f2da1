"""When a rank fails, the others say what happened: the rank that never reached piper's setup, the peer that
closed its connection (not a "timeout" after 0.02 s), and the launcher fails a run whose child crashed at
exit after reporting success."""
from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.models import build_model


def _pipeline_step(timeout: float) -> tuple[torch.nn.Module, object, tuple[torch.Tensor, ...]]:
    model = build_model("mlp")
    model.annotate_stages(2)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": [*piper.pipeline(2), piper.split(2)], "codegen": "eager",
                                  "timeout": timeout})
    return model, step, model.make_batch(4, torch.Generator().manual_seed(0))


def _missing_rank_worker(rank: int, world: int) -> str:
    _, step, batch = _pipeline_step(timeout=4)
    if rank == 1:
        return "never called the step"  # as if it raised in its data loading
    t0 = time.perf_counter()
    try:
        step(*batch)
    except piper.PiperRuntimeError as e:
        return f"{time.perf_counter() - t0:.1f} {e}"
    return "no error"


@pytest.mark.slow
def test_rank_missing_at_the_first_call_is_named():
    """Before: a bare ``DistStoreError: wait timeout after 4000ms, keys: /default_pg/0//1//cpu//0/1`` from
    ``dist.new_group`` deep in the first call."""
    out, skipped = run_local(_missing_rank_worker, 2, timeout_s=120)
    assert skipped == "never called the step"
    waited, msg = out.split(" ", 1)
    assert msg.startswith("piper: rank 0: rank(s) [1] never reached piper's setup"), msg
    assert "within 4s" in msg and "options['timeout']" in msg, msg
    assert float(waited) < 30, out


def _peer_crash_worker(rank: int, world: int) -> str:
    _, step, batch = _pipeline_step(timeout=60)
    step(*batch)  # both ranks run the first step
    if rank == 1:  # die inside the next step's first backward segment (after stage 0's forward was sent)
        segments = piper.compiled_steps(step)[0].plans[False].executor.segments
        name = next(n for n in sorted(segments) if n.startswith("B"))
        segments[name]._run = lambda *_: os._exit(3)  # its compiled function, whatever the calling convention
    t0 = time.perf_counter()
    try:
        step(*batch)
    except piper.PiperRuntimeError as e:
        return f"{time.perf_counter() - t0:.2f} {e}"
    return "no error"


@pytest.mark.slow
def test_peer_that_closed_its_connection_is_not_called_a_timeout():
    """Before: "... with peer rank 1 did not complete within 60s (RuntimeError: [...pair.cc:553] Connection
    closed by peer [127.0.0.1]:41391. This is typically caused by a remote worker crashing. Check the logs of
    the remote w)" -- after 0.02 s, and the cause cut mid-word."""
    out, died = run_local(_peer_crash_worker, 2, timeout_s=120, dies=(1,))
    assert died == "exit code 3", died
    waited, msg = out.split(" ", 1)
    assert float(waited) < 30, out  # well before the 60 s timeout
    assert msg.startswith("piper: rank 0: RECV"), msg
    assert "peer rank 1 closed the connection (it crashed or exited)" in msg, msg
    assert "did not complete within" not in msg, msg
    assert "failed after" in msg and "rank 1's log" in msg, msg
    reason = msg[msg.index("(RuntimeError: ") + 1:msg.index("). Look for")]
    assert "by peer" in reason, msg  # closed / reset
    # the whole line, not cut mid-word: gloo's reason for the reset ends the line (torch 2.11's gloo) or
    # is followed by its advice to read the other ranks' logs (2.13's)
    assert reason.endswith("by peer") or "before reporting an error" in reason, msg


def _abort_at_exit(rank: int, world: int) -> int:
    if rank == 1:  # what a C++ destructor at interpreter exit does: std::terminate -> abort
        def crash() -> None:
            sys.stderr.write("terminate called without an active exception\n")
            sys.stderr.flush()
            os.abort()

        atexit.register(crash)
    return rank


def test_run_local_fails_on_a_crash_at_exit():
    """Before: run_local returned [0, 1] -- the child's SIGABRT after it reported was never looked at."""
    with pytest.raises(RuntimeError) as info:
        run_local(_abort_at_exit, 2, timeout_s=120)
    msg = str(info.value)
    assert "rank 1" in msg and "SIGABRT" in msg and "terminate called without an active exception" in msg, msg


def _thread_names() -> list[str]:
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names


def _threads_at_exit(rank: int, world: int, out: str) -> list[str]:
    """Trains DP2 ZeRO-2 (5 gloo groups) and notes, from an exit handler registered before piper's (so run
    after it), the native threads still alive once the launcher destroyed the process group."""
    def note() -> None:
        names = _thread_names()
        with open(f"{out}.{rank}", "w") as f:
            f.write("\n".join(names))

    atexit.register(note)
    model = build_model("mlp")
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": [piper.replicate(zero=2, bucket_mb=0.001)], "codegen": "eager",
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=1e-2)})
    batch = model.make_batch(4, torch.Generator().manual_seed(rank))
    for _ in range(2):
        step(*batch)
    return _thread_names()


@pytest.mark.slow
def test_gloo_threads_end_before_interpreter_finalization(tmp_path):
    """Piper's group caches kept every gloo group (and its worker threads) alive into interpreter
    finalization, where a group's destructor can abort a rank that already reported success (seen once in
    CI: rank 1 SIGABRT, "terminate called without an active exception"). Before: 15 gloo threads left at
    exit; now piper's atexit handler drops its groups and none is."""
    out = str(tmp_path / "threads")
    during = run_local(_threads_at_exit, 2, out, timeout_s=300)
    for rank in range(2):
        assert sum("gloo" in n for n in during[rank]) >= 10, during[rank]  # the groups were there
        left = open(f"{out}.{rank}").read().split("\n")
        assert not [n for n in left if "gloo" in n], (rank, left)


def _die_silently(rank: int, world: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), 9)
    time.sleep(60)
    return rank


@pytest.mark.slow  # ~8 s; the full suite runs it
def test_run_local_reports_a_rank_that_died_without_reporting_at_once():
    """Before: the parent waited ``timeout_s`` for a report that never came."""
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        run_local(_die_silently, 2, timeout_s=300)
    assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value), str(info.value)
    assert time.perf_counter() - t0 < 45


def _rank_death() -> Any:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    import rank_death

    return rank_death


@pytest.mark.slow
@pytest.mark.parametrize("strategy,point", [("DP2", "before"), ("PP2", "mid")])
def test_rank_death_survivors_exit_naming_the_dead_rank(strategy: str, point: str):
    """Two cells of ``benchmarks/rank_death.py``: the victim (rank 1) SIGKILLs itself before its first call
    or inside a step; the survivor must exit within a bound with a ``piper:`` message naming rank 1.
    Before: DP2/before ended in a bare ``DistStoreError: wait timeout ...`` from ``dist.new_group``."""
    killed_at, outcomes = _rank_death().run_cell(strategy, point, timeout=10, pg_timeout=30, limit=150)
    assert killed_at is not None, "the victim did not die"
    assert [o.rank for o in outcomes] == [0]
    for o in outcomes:
        assert o.seconds is not None and o.seconds < 90, o
        assert o.status == "exit code 1", o
        assert o.message.startswith("piper: rank 0:"), o
        assert "[1] never reached piper's setup" in o.message or "peer rank 1 closed" in o.message, o


def _stuck_in_a_wait(rank: int, world: int) -> int:
    if rank == 1:
        return rank
    threading.Event().wait(120)  # a wait that never ends (as a receive whose peer never sends)
    return rank


@pytest.mark.slow  # ~9 s; the full suite runs it
def test_run_local_timeout_shows_where_each_running_rank_is():
    """A hung run says where: the ranks still running dump their threads' stacks (SIGUSR1, faulthandler)
    into the error (the GPU check's hang showed only the launcher's own stack)."""
    with pytest.raises(TimeoutError) as info:
        run_local(_stuck_in_a_wait, 2, timeout_s=3)
    text = str(info.value)
    assert "--- rank 0: where it was ---" in text and "_stuck_in_a_wait" in text, text
    assert "rank 1: where" not in text  # it reported
