"""Atomic checkpoint directories (``piper_compile.checkpoint.commit``) in one process: the commit record,
the two-rename commit, what ``resolve`` (load) and ``recover`` (the next save) make of a save interrupted
at every file-system operation of its commit, and the refusal of incomplete directories. Also the key check
of a strict load and DCP's ``CheckpointException`` as a ``piper:`` error."""
from __future__ import annotations

import os
import traceback
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from piper_compile.checkpoint import commit, dcp_io
from piper_compile.errors import PiperError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(v: float) -> dict:
    return {"model": {"a.weight": torch.full((4, 3), v), "a.bias": torch.full((4,), v)}}


def _write(d: str, v: float) -> None:
    dcp.save(_state(v), storage_writer=dcp.FileSystemWriter(d))  # one process: no process group


def _read(d: str) -> float:
    sd = {"model": {"a.weight": torch.zeros(4, 3), "a.bias": torch.zeros(4)}}
    dcp.load(sd, checkpoint_id=d)
    vals = {float(v) for t in sd["model"].values() for v in (t.flatten()[0], t.flatten()[-1])}
    assert len(vals) == 1, vals  # never a mix of two saves
    return vals.pop()


def _save(path: str, v: float) -> None:
    """``dcp_io.save``'s file-system steps, one process."""
    commit.prepare(path)
    sid = commit.new_save_id()
    tmp = commit.tmp_dir(path, sid)
    _write(tmp, v)
    commit.write_record(tmp, sid, 1)
    commit.commit(tmp, path, sid)


def test_commit_replaces_whole(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path, 1.0)
    record = commit.read_record(path)
    assert record["world_size"] == 1 and ".metadata" in record["files"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _save(path, 2.0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the previous one is gone, no leftovers
    d, md = commit.resolve(path)
    assert d == path and "model.a.weight" in md.state_dict_metadata
    assert _read(d) == 2.0


class _Crash(BaseException):
    pass


def _ops_of_save(path: str, v: float, crash_at: int | None, monkeypatch) -> int:
    """Run ``_save`` with every file-system operation counted; raise ``_Crash`` instead of the
    ``crash_at``-th one (the process "dies" there: nothing after it runs)."""
    count = [0]
    names = ["rename", "replace", "fsync", "unlink", "rmdir", "mkdir", "makedirs", "open"]
    real = {n: getattr(os, n) for n in names}
    import builtins
    import shutil
    real_open, real_rmtree = builtins.open, shutil.rmtree

    def counted(fn):
        def wrapper(*a, **k):
            count[0] += 1
            if crash_at is not None and count[0] == crash_at:
                raise _Crash()
            return fn(*a, **k)
        return wrapper

    with monkeypatch.context() as m:
        for n in names:
            m.setattr(os, n, counted(real[n]))
        m.setattr(builtins, "open", counted(real_open))
        m.setattr(shutil, "rmtree", counted(real_rmtree))
        try:
            _save(path, v)
        except (_Crash, CheckpointException):  # DCP collects its steps' exceptions into a CheckpointException
            pass
    return count[0]


def test_crash_at_every_file_system_operation(tmp_path, monkeypatch):
    """A save over a committed checkpoint, interrupted at each of its file-system operations (DCP's writes,
    the record, the renames, the removal): load always finds a complete checkpoint, the previous one until
    the rename that commits and the new one after it; the next save cleans up and commits."""
    _save(str(tmp_path / "probe"), 1.0)
    total = _ops_of_save(str(tmp_path / "probe"), 2.0, None, monkeypatch)  # over a committed checkpoint
    assert total > 10, total
    seen = set()
    for k in range(1, total + 1):
        root = tmp_path / f"t{k}"
        root.mkdir()
        path = str(root / "ckpt")
        _save(path, 1.0)
        _ops_of_save(path, 2.0, k, monkeypatch)
        d, _ = commit.resolve(path)
        v = _read(d)
        seen.add(v)
        assert v in (1.0, 2.0), (k, v)
        _save(path, 3.0)  # recovers whatever the crash left, then commits
        assert sorted(os.listdir(root)) == ["ckpt"], (k, os.listdir(root))
        assert _read(path) == 3.0
    assert seen == {1.0, 2.0}


def test_crash_between_renames_loads_previous(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path, 1.0)
    sid = commit.new_save_id()
    tmp = commit.tmp_dir(path, sid)
    _write(tmp, 2.0)
    commit.write_record(tmp, sid, 1)
    os.rename(path, commit.old_dir(path, sid))  # the commit's first rename, then the crash
    with pytest.warns(UserWarning, match="interrupted while replacing it"):
        d, _ = commit.resolve(path)
    assert d == commit.old_dir(path, sid) and _read(d) == 1.0
    assert commit.recover(path)[0].startswith("restored")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and _read(path) == 1.0


def test_refuses_incomplete(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path, 1.0)
    data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, data), "r+b") as f:  # truncated after the commit
        f.truncate(10)
    with pytest.raises(commit.CheckpointIncomplete, match=f"not a complete checkpoint.*{data} has 10 bytes, the commit "
                                                          "record says"):
        commit.resolve(path)
    os.remove(os.path.join(path, data))
    with pytest.raises(commit.CheckpointIncomplete, match=f"{data} is missing"):
        commit.resolve(path)

    plain = str(tmp_path / "plain")  # plain DCP, no record: loads when complete
    _write(plain, 4.0)
    assert commit.resolve(plain)[0] == plain
    with open(os.path.join(plain, data), "r+b") as f:
        f.truncate(10)
    with pytest.raises(commit.CheckpointIncomplete, match=r"locates is not all there.*locates data up to byte"):
        commit.resolve(plain)
    os.remove(os.path.join(plain, ".metadata"))
    with pytest.raises(commit.CheckpointIncomplete, match="has no .metadata"):
        commit.resolve(plain)

    sid = commit.new_save_id()
    tmp = commit.tmp_dir(str(tmp_path / "other"), sid)  # a finished DCP save that was never committed
    _write(tmp, 5.0)
    with pytest.raises(commit.CheckpointIncomplete, match="did not commit"):
        commit.resolve(tmp)
    with pytest.raises(commit.CheckpointIncomplete, match=r"no checkpoint at .*other; other\.tmp-[0-9a-f]+ beside it "
                                                          "is a save that did not finish"):
        commit.resolve(str(tmp_path / "other"))
    with pytest.raises(commit.CheckpointIncomplete, match="there is no checkpoint at"):
        commit.resolve(str(tmp_path / "nothing"))


def test_save_target_must_be_a_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(PiperError, match="exists and is not a directory"):
        commit.prepare(str(tmp_path / "f"))
    with pytest.raises(PiperError, match="is a URL; piper.save and piper.load work on directories"):
        commit.resolve("s3://bucket/ckpt")


def test_key_check(tmp_path):
    d = str(tmp_path / "c")
    dcp.save({"model": {"a.weight": torch.ones(2), "extra.weight": torch.ones(2)},
              "optim": {"state": {"a.weight": {"exp_avg": torch.ones(2)}, "gone.bias": {"exp_avg": torch.ones(2)}}}},
             storage_writer=dcp.FileSystemWriter(d))
    md = commit.resolve(d)[1]
    assert dcp_io.key_mismatch(["a.weight", "a.bias"], md) == (["a.bias"], ["extra.weight", "gone.bias"])
    with pytest.raises(PiperError, match=r"does not match the model: it holds 2 entries the model lacks \(unexpected: "
                                         r"extra.weight, gone.bias\); it lacks 1 the model has \(missing: a.bias\).*"
                                         "strict=False"):
        dcp_io.check_keys(["a.weight", "a.bias"], md, d, strict=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lenient = dcp_io.check_keys(["a.weight", "a.bias"], md, d, strict=False)
    assert lenient == (["a.bias"], ["extra.weight", "gone.bias"])
    assert any("strict=False" in str(x.message) for x in w)
    assert dcp_io.key_mismatch(["a.weight", "extra.weight"], md) == ([], ["gone.bias"])
    # a checkpoint without optimizer state is no mismatch
    d2 = str(tmp_path / "m")
    dcp.save({"model": {"a.weight": torch.ones(2)}}, storage_writer=dcp.FileSystemWriter(d2))
    assert dcp_io.key_mismatch(["a.weight"], commit.resolve(d2)[1]) == ([], [])


def test_checkpoint_exception_as_piper_error():
    sd = {"model": {"layers.0.weight": torch.ones(2), "layers.0.weight_extra": torch.ones(2)}}
    try:
        raise ValueError("Size mismatch between saved torch.Size([8]) and current: torch.Size([2]) for "
                         "model.layers.0.weight")
    except ValueError as e:
        cause = (e, traceback.extract_tb(e.__traceback__))
    err = dcp_io.checkpoint_error(CheckpointException("failed", {1: cause, 3: cause}), "loading", "/c", sd, "after")
    assert isinstance(err, PiperError)
    msg = str(err)
    assert msg.startswith("piper: loading the checkpoint /c failed on rank(s) 1, 3: rank 1, entry "
                          "'model.layers.0.weight': ValueError: Size mismatch"), msg
    assert dcp_io.flat_keys({"optim": {"param_groups": [{"lr": 1, "params": ["a", "b"]}]}}) == \
        ["optim.param_groups.0.lr", "optim.param_groups.0.params"]
