"""Checkpoints that cannot silently be wrong, on real gloo ranks: a save killed on one rank leaves the
previous checkpoint loadable (SIGKILL at random points of ``piper.save``, then a bitwise resume in fresh
processes), ``piper.load`` refuses partial checkpoints and, unless ``strict=False``, checkpoints whose
parameters differ from the model's, and DCP's ``CheckpointException`` surfaces as a ``piper:`` error."""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from killable import count_events, kill_at, run_killable, stop_counting
from test_checkpoint import _make, _train

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, _model
from piper_compile.knobs import knob

pytestmark = pytest.mark.slow

# ZeRO-1 over 2 ranks: each rank writes its own shard of every parameter and of its optimizer state, so a
# save that one rank finished and the other did not is a mix of two training steps
CFG = RunConfig(model="mlp", model_kwargs={"dim": 8, "depth": 2}, local_batch=4, optimizer=("AdamW", {"lr": 1e-2}),
                directives=[piper.replicate(zero=1, bucket_mb=0.0001)], steps=8)


def _full(step) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in piper.full_state_dict(step).items()}


# -- a rank killed while writing its file of a save over a committed checkpoint ------------------------------
@contextlib.contextmanager
def _die_after_writing(n_bytes: int):
    """SIGKILL this process once it has written ``n_bytes`` of a checkpoint data file (flushed to disk)."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            write, done = stream.write, [0]

            def partial_write(b):
                if done[0] + len(b) > n_bytes:
                    write(bytes(memoryview(b)[: n_bytes - done[0]]))
                    stream.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                done[0] += len(b)
                return write(b)

            stream.write = partial_write
            yield stream

    fs.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        fs.FileSystem.create_stream = real


def _killed_during_second_save(rank: int, world: int, path: str) -> dict:
    model, step = _make(CFG, CFG.seed)
    losses = _train(step, model, CFG, rank, world, range(2))
    piper.save(step, path)  # committed
    losses += _train(step, model, CFG, rank, world, range(2, 4))
    out = {"losses": losses, "at4": _full(step)}
    try:
        with _die_after_writing(200) if rank == 1 else contextlib.nullcontext():
            piper.save(step, path)
        out["second"] = "saved"
    except piper.PiperError as e:
        out["second"] = str(e)
    return out


def _resume(rank: int, world: int, path: str, steps: range) -> dict:
    model, step = _make(CFG, CFG.seed + 7)  # other initial weights: all must come from the checkpoint
    res = piper.load(step, path)  # deferred into the first call
    return {"losses": _train(step, model, CFG, rank, world, steps), "full": _full(step), "load": res}


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed half-way through writing its file of a second save to the same path (before the
    fix: the previous checkpoint was overwritten in place, and loading it raised EOFError, or, killed before
    writing, loaded a silent mix of both saves). The previous checkpoint loads and resumes bitwise."""
    path = str(tmp_path / "ckpt")
    first = run_killable(_killed_during_second_save, 2, path, workdir=str(tmp_path))
    assert first[1] == ("killed", -signal.SIGKILL), first[1]
    resumed = run_local(_resume, 2, path, range(2, 4))  # fresh processes
    status, out = first[0]
    for r in resumed:
        assert r["losses"] == out["losses"][2:4], (r["losses"], out["losses"])  # bitwise
        assert r["load"] == ([], [], path)
        for k, v in out["at4"].items():
            assert torch.equal(r["full"][k], v), k
    assert status == "ok", out  # the survivor: a piper error
    assert out["second"].startswith(f"piper: saving the checkpoint {path} failed on rank 0") and \
        "Nothing was committed" in out["second"], out["second"]
    assert os.listdir(tmp_path) == ["ckpt"]  # rank 0 removed the failed save's directory


# -- partial, mismatched and unreadable checkpoints; a failing save ----------------------------------------------
def _refusals(rank: int, world: int, dirs: dict[str, str], good: str) -> dict:
    out: dict = {}
    model, step = _make(CFG, CFG.seed + 3)
    for name in ("truncated", "no_metadata", "uncommitted"):  # refused at once, before the first call too
        with pytest.raises(piper.PiperError) as e:
            piper.load(step, dirs[name])
        out[name] = str(e.value)
    _train(step, model, CFG, rank, world, range(1))
    for name in ("extra", "missing", "shape"):
        try:
            piper.load(step, dirs[name])
            out[name] = "loaded"
        except piper.PiperError as e:
            out[name] = str(e)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out["extra_lenient"] = piper.load(step, dirs["extra"], strict=False)
        out["missing_lenient"] = piper.load(step, dirs["missing"], strict=False)
    out["warnings"] = [str(x.message) for x in w if "piper:" in str(x.message)]
    out["after_lenient"] = _full(step)
    # a save that fails on rank 1 (its storage raises): a piper error on every rank, the committed one kept
    piper.save(step, good)
    import torch.distributed.checkpoint.filesystem as fs

    real = fs.FileSystemWriter.write_data
    if rank == 1:
        def no_space(self, plan, planner):
            raise OSError(28, "No space left on device", self.path)
        fs.FileSystemWriter.write_data = no_space
    _train(step, model, CFG, rank, world, range(1, 2))
    try:
        piper.save(step, good)
        out["failed_save"] = "saved"
    except piper.PiperError as e:
        out["failed_save"] = str(e)
    fs.FileSystemWriter.write_data = real
    torch.distributed.barrier()  # rank 0 removes the failed save's directory before it raises
    out["leftovers"] = sorted(os.listdir(os.path.dirname(good)))
    return out


def test_load_refuses_partial_mismatched_and_failed(tmp_path):
    """Before the fix: a truncated file raised EOFError, a missing .metadata FileNotFoundError, a shape
    mismatch DCP's CheckpointException (a BaseException), and parameters the model lacks were ignored."""
    model = _model(CFG)
    sd = model.state_dict()
    dirs = {n: str(tmp_path / n) for n in ("truncated", "no_metadata", "extra", "missing", "shape")}
    for name, entries in [("truncated", sd), ("no_metadata", sd), ("extra", {**sd, "head.weight": torch.ones(3, 8)}),
                          ("missing", {k: v for k, v in sd.items() if k != "layers.1.bias"}),
                          ("shape", {**sd, "layers.0.weight": torch.ones(9, 8)})]:
        dcp.save({"model": entries}, storage_writer=dcp.FileSystemWriter(dirs[name]))
    data = next(f for f in os.listdir(dirs["truncated"]) if f.endswith(".distcp"))
    with open(os.path.join(dirs["truncated"], data), "r+b") as f:
        f.truncate(100)
    os.remove(os.path.join(dirs["no_metadata"], ".metadata"))
    dirs["uncommitted"] = str(tmp_path / "u" / "ckpt.tmp-0123456789abcdef")
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(dirs["uncommitted"]))
    good = str(tmp_path / "g" / "ckpt")
    os.makedirs(os.path.dirname(good))

    for r, out in enumerate(run_local(_refusals, 2, dirs, good)):
        assert "not a complete checkpoint" in out["truncated"] and f"{data} has 100 bytes" in out["truncated"], r
        assert "has no .metadata" in out["no_metadata"], out["no_metadata"]
        assert "a save that did not commit" in out["uncommitted"], out["uncommitted"]
        assert "holds 1 entry the model lacks (unexpected: head.weight)" in out["extra"], out["extra"]
        assert "lacks 1 the model has (missing: layers.1.bias)" in out["missing"], out["missing"]
        assert out["shape"].startswith(f"piper: loading the checkpoint {dirs['shape']} failed on rank(s) 0, 1: rank 0, "
                                       "entry 'model.layers.0.weight': ValueError: Size mismatch"), out["shape"]
        assert out["extra_lenient"] == ([], ["head.weight"], dirs["extra"])
        assert out["missing_lenient"] == (["layers.1.bias"], [], dirs["missing"])
        assert len(out["warnings"]) == 2, out["warnings"]
        for k, v in sd.items():  # the lenient loads loaded what both have; layers.1.bias kept extra's value
            assert torch.equal(out["after_lenient"][k], v), k
        assert out["failed_save"].startswith(f"piper: saving the checkpoint {good} failed on rank(s) 1: rank 1: "
                                             "OSError: [Errno 28] No space left on device"), out["failed_save"]
        assert out["leftovers"] == ["ckpt"], out["leftovers"]  # the failed save's directory removed


# -- SIGKILL at random points of piper.save, many trials --------------------------------------------------------
def _reference(rank: int, world: int, root: str, probe: str, last: int) -> dict:
    """The uninterrupted run: losses of every step, full state before every step, the trials' first committed
    checkpoint (after 1 step), and the events of a save over a committed checkpoint on this rank."""
    model, step = _make(CFG, CFG.seed)
    losses, states = [], {}
    for s in range(last):
        states[s] = _full(step) if s else None
        if s == 1:
            piper.save(step, os.path.join(root, "ckpt"))
        if s == 3:
            piper.save(step, probe)
        if s == 4:
            c = count_events()
            piper.save(step, probe)
            stop_counting()
            events = (c.calls, c.io, c.marks)
        losses += _train(step, model, CFG, rank, world, range(s, s + 1))
    return {"losses": losses, "states": states, "events": events}


def _trial(rank: int, world: int, path: str, at: int, victim: int, kill: dict) -> str:
    model, step = _make(CFG, CFG.seed)
    _train(step, model, CFG, rank, world, range(at))
    if rank == victim:
        kill_at(**kill)
    try:
        piper.save(step, path)
        return "saved"
    except piper.PiperError as e:
        return str(e)
    finally:
        stop_counting()


def _verify(rank: int, world: int, paths: list[str], states: dict) -> list[dict]:
    """Load each trial's committed checkpoint (the first one before the first call, the others into the live
    run), say which training step's state it holds, and train two steps from there."""
    model, step = _make(CFG, CFG.seed + 7)
    out = []
    for i, path in enumerate(paths):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            res = piper.load(step, path)
            if i == 0:
                _train(step, model, CFG, rank, world, range(0, 1))  # runs the deferred load first; then reloaded
                piper.load(step, path)
        full = _full(step)
        at = [s for s, st in states.items() if st is not None and all(torch.equal(full[k], v) for k, v in st.items())]
        losses = _train(step, model, CFG, rank, world, range(at[0], at[0] + 2)) if len(at) == 1 else None
        out.append({"at": at, "losses": losses, "read": os.path.basename(res.path),
                    "warned": [str(x.message) for x in w if "piper:" in str(x.message)]})
    return out


def _committed_state(path: str, states: dict) -> list[int]:
    """Which training step's parameters the committed checkpoint at ``path`` holds (read in this process)."""
    from piper_compile.checkpoint.commit import resolve

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = {"model": _model(CFG).state_dict()}
        dcp.load(sd, checkpoint_id=resolve(path)[0])
    got = sd["model"]
    return [s for s, st in states.items() if st is not None and all(torch.equal(got[k], v) for k, v in st.items())]


def _kill_point(rng: random.Random, kind: int, victim: int, events: tuple) -> dict:
    """Where the victim dies: kinds 0/1 a random file-system operation / call of the whole save; 2/3 the same
    in its last phase (rank 0: from writing the commit record on; rank 1: waiting for rank 0's commit); 4
    (rank 0) one of the first five file-system operations of the commit: rename aside, fsync of the parent,
    rename into place (mostly between the two renames)."""
    calls, io, marks = events
    if kind == 4:
        return {"n_io": rng.randint(1, 5), "after": ("commit", 1)}
    if kind < 2:
        return {"n_io": rng.randint(1, io)} if kind == 0 else {"n_calls": rng.randint(1, calls)}
    after = ("write_record", 1) if victim == 0 else ("on_rank0", 2)
    _, c0, i0 = [m for m in marks if m[0] == after[0]][after[1] - 1]
    if kind == 2 and io > i0:
        return {"n_io": rng.randint(1, io - i0), "after": after}
    return {"n_calls": rng.randint(1, calls - c0), "after": after}


def test_sigkill_at_random_points_of_save(tmp_path):
    """25 trials, each a fresh pair of ranks that trains ``at`` steps and saves over the checkpoint the
    previous trials left (leftovers included), with one rank (random) SIGKILLed at a random point of the
    save: a random call in checkpoint code or file-system operation, over the whole save, its commit phase or
    the two renames of the commit.
    After every trial the latest committed checkpoint loads and resumes bitwise in fresh processes (losses of
    the next two steps as in the uninterrupted run); it holds the previous trial's state or this one's, never
    a mix, never nothing; a trial whose ranks both finished committed its own."""
    trials, last = knob("PIPER_CRASH_TRIALS"), 8  # more for a soak run
    root = tmp_path / "run"
    root.mkdir()
    t0 = time.monotonic()
    ref = run_local(_reference, 2, str(root), str(tmp_path / "probe" / "ckpt"), last)
    states, losses = ref[0]["states"], ref[0]["losses"]
    events = [r["events"] for r in ref]
    rng = random.Random(knob("PIPER_CRASH_SEED"))
    counts = {"committed new": 0, "kept previous": 0, "not killed": 0, "previous set aside, loaded from there": 0}
    cur, paths, plan = 1, [], []
    for i in range(trials):
        kind = i % 5
        victim, at = 0 if kind == 4 else rng.randrange(2), rng.choice([s for s in range(1, last - 2) if s != cur])
        kill = _kill_point(rng, kind, victim, events[victim])
        res = run_killable(_trial, 2, str(root / "ckpt"), at, victim, kill, workdir=str(tmp_path))
        status = [s for s, _ in res]
        assert all(v == "saved" or v.startswith("piper: ") for s, v in res if s == "ok"), res
        assert status[victim] == "killed" or status == ["ok", "ok"], res
        now = _committed_state(str(root / "ckpt"), states)
        assert now in ([cur], [at]), (i, at, cur, now, res)
        if status == ["ok", "ok"]:
            counts["not killed"] += 1
            assert now == [at], (i, res)
        counts["committed new" if now == [at] else "kept previous"] += 1
        counts["previous set aside, loaded from there"] += not (root / "ckpt").exists()
        plan.append((at, victim, kill, status, now[0]))
        cur = now[0]
        snap = tmp_path / f"snap{i}"
        shutil.copytree(root, snap, symlinks=True)
        paths.append(str(snap / "ckpt"))
    t_trials = time.monotonic() - t0
    checks = run_local(_verify, 2, paths, states)
    for i, (at, victim, kill, status, now) in enumerate(plan):
        for r in range(2):
            c = checks[r][i]
            assert c["at"] == [now], (i, r, c, plan[i])
            assert c["losses"] == losses[now:now + 2], (i, r, c["losses"], losses)  # bitwise
            assert (c["read"] != "ckpt") == bool(c["warned"]), c
    print(f"\n{trials} trials in {t_trials:.0f}s: {counts}\nplan (at, victim, kill, status, committed): {plan}\n"
          f"events of a save (calls, io) by rank: {[e[:2] for e in events]}")
    assert counts["committed new"] >= 3 and counts["kept previous"] >= 3, counts
    assert counts["previous set aside, loaded from there"] >= 1, counts
