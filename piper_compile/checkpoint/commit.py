"""Atomic checkpoint directories: a save replaces the checkpoint at ``path`` whole or not at all.

``piper.save(step, path)`` never writes into ``path``. The ranks write into a fresh sibling
``<path>.tmp-<id>`` (``id`` chosen by rank 0 and broadcast); DCP's coordinator writes ``.metadata`` there
once every rank's files are written; then rank 0 commits:

1. ``write_record``: the commit record ``.piper_commit.json`` (the save's id, world size, the size of
   every file) into the temporary directory, written to a side file, fsynced and renamed into place;
   the directory is fsynced and checked (``verify``) before anything else happens;
2. ``commit``: an existing ``path`` is renamed to ``<path>.old-<id>`` (fsync of the parent), the
   temporary directory is renamed to ``path`` (fsync of the parent) -- **the commit point** -- and the
   previous checkpoint is removed.

A crash (any rank killed, any time) leaves one of these states, and each resolves to the latest
committed checkpoint:

- before the rename to ``path``, with ``path`` untouched: ``path`` is the previous checkpoint; the
  ``.tmp-<id>`` directory (with or without a record) is never loaded and the next save removes it;
- between the two renames: ``path`` is missing and ``<path>.old-<id>`` holds the previous checkpoint:
  ``resolve`` (load) reads it from there, and the next save renames it back (``recover``) first;
- after the rename, while removing the previous checkpoint: ``path`` is the new one; the next save
  removes what is left of ``.old-<id>``.

``verify`` refuses a directory whose files do not match its record (missing, or another size), a
``.tmp-<id>`` directory without a record, and, for a directory without a record (plain ``dcp.save``, or
piper before records), one without ``.metadata`` or whose ``.metadata`` references files that are
missing or shorter than the data it locates in them.

Only one save to a path may run at a time (rank 0 of a save removes other saves' leftovers), and every
rank must see the same directory (a local or shared file system).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import warnings
from typing import Any

from piper_compile.errors import PiperError

RECORD = ".piper_commit.json"
FORMAT = "piper-checkpoint"
VERSION = 1
_METADATA = ".metadata"  # DCP's file, written by its coordinator after every rank's data


class CheckpointIncomplete(PiperError):
    """The directory is not a complete, committed checkpoint (an interrupted save, truncated or missing
    files, or no checkpoint at all)."""


def tmp_dir(path: str, save_id: str) -> str:
    return f"{path}.tmp-{save_id}"


def old_dir(path: str, save_id: str) -> str:
    return f"{path}.old-{save_id}"


def new_save_id() -> str:
    return os.urandom(8).hex()


_TMP = re.compile(r".+\.tmp-[0-9a-f]{16}")


def _leftover_re(path: str) -> re.Pattern[str]:
    return re.compile(re.escape(os.path.basename(path)) + r"\.(tmp|old)-[0-9a-f]{16}")


def leftovers(path: str) -> tuple[list[str], list[str]]:
    """The ``(.tmp-<id>, .old-<id>)`` siblings of ``path`` that interrupted saves left behind, oldest first."""
    parent = os.path.dirname(path) or "."
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return [], []
    pat = _leftover_re(path)
    found: dict[str, list[str]] = {"tmp": [], "old": []}
    for n in names:
        m = pat.fullmatch(n)
        if m:
            found[m.group(1)].append(os.path.join(parent, n))
    key = lambda p: (_mtime(p), p)  # noqa: E731
    return sorted(found["tmp"], key=key), sorted(found["old"], key=key)


def _mtime(p: str) -> float:
    try:
        return os.lstat(p).st_mtime
    except OSError:
        return 0.0


def fsync_dir(d: str) -> None:
    """Make the directory's entries (created or renamed files) durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; their renames are what they are
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _remove(p: str) -> None:
    if os.path.islink(p) or os.path.isfile(p):
        os.unlink(p)
    else:
        shutil.rmtree(p, ignore_errors=True)


def local_path(path: str) -> str:
    """``path`` as an absolute file-system path; URLs (fsspec) are refused: the commit renames directories."""
    path = os.fspath(path)
    if "://" in path:
        raise PiperError(f"piper: {path} is a URL; piper.save and piper.load work on directories of a local or shared "
                         "file system (a save is committed by renaming its directory). For object stores call DCP "
                         "yourself: dcp.save(piper.sharded_state_dict(step), checkpoint_id=url) (not atomic) and "
                         "dcp.load(piper.sharded_state_dict(step), checkpoint_id=url)")
    return os.path.abspath(path)


def prepare(path: str) -> list[str]:
    """Rank 0, before a save: check that ``path`` can be a checkpoint directory, finish what an interrupted
    save left (``recover``); returns what it did."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise PiperError(f"piper: cannot save a checkpoint to {path}: it exists and is not a directory; "
                         "remove it or choose another path")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return recover(path)


def recover(path: str) -> list[str]:
    """Undo an interrupted save: if ``path`` is missing and an ``.old-<id>`` sibling holds the previous
    checkpoint (a crash between the two renames of ``commit``), rename it back; remove every ``.tmp-<id>``
    sibling (uncommitted) and, once ``path`` exists, every ``.old-<id>`` one. Returns what it did."""
    tmps, olds = leftovers(path)
    done = []
    if olds and not os.path.lexists(path):
        src = olds.pop()
        os.rename(src, path)
        fsync_dir(os.path.dirname(path) or ".")
        done.append(f"restored {src} to {path}")
    for d in tmps + (olds if os.path.lexists(path) else []):
        _remove(d)
        done.append(f"removed {d}")
    return done


def write_record(tmp: str, save_id: str, world_size: int) -> dict[str, Any]:
    """Rank 0, once DCP finished (every rank's files and ``.metadata`` are written): the commit record of
    the temporary directory, made durable; then the directory is checked against it."""
    files = {}
    for n in sorted(os.listdir(tmp)):
        p = os.path.join(tmp, n)
        if n != RECORD and not n.endswith(".tmp") and os.path.isfile(p):
            files[n] = os.path.getsize(p)
    if _METADATA not in files:
        raise PiperError(f"piper: the save into {tmp} finished without DCP's {_METADATA}; not committing it")
    record = {"format": FORMAT, "version": VERSION, "save_id": save_id, "world_size": world_size,
              "time": time.time(), "files": files}
    side = os.path.join(tmp, RECORD + ".tmp")
    with open(side, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(side, os.path.join(tmp, RECORD))
    fsync_dir(tmp)
    verify(tmp)
    return record


def commit(tmp: str, path: str, save_id: str) -> None:
    """Rank 0: replace ``path`` (if any) by the recorded temporary directory ``tmp``. The rename of ``tmp``
    to ``path`` is the commit point; before it ``path`` (or, between the renames, ``<path>.old-<id>``) holds
    the previous checkpoint."""
    parent = os.path.dirname(path) or "."
    old = None
    if os.path.lexists(path):
        old = old_dir(path, save_id)
        os.rename(path, old)
        fsync_dir(parent)
    os.rename(tmp, path)
    fsync_dir(parent)
    if old is not None:
        _remove(old)


def discard(tmp: str) -> None:
    """Rank 0 after a failed save: remove its temporary directory (best effort; the next save would)."""
    try:
        _remove(tmp)
    except OSError:
        pass


def resolve(path: str) -> tuple[str, Any]:
    """The directory holding the latest committed checkpoint of ``path`` and its DCP metadata: ``path``
    itself, or, after a crash between the two renames of a commit, the previous checkpoint set aside as
    ``<path>.old-<id>``. Raises ``CheckpointIncomplete`` when there is none or it is incomplete. Reads only."""
    path = local_path(path)
    if os.path.isdir(path):
        return path, verify(path)
    tmps, olds = leftovers(path)
    if olds and not os.path.lexists(path):
        d = olds[-1]
        md = verify(d)
        warnings.warn(f"piper: {path} is missing: a save was interrupted while replacing it; loading the previous "
                      f"checkpoint from {d} (the next piper.save to {path} puts it back first)", stacklevel=3)
        return d, md
    if os.path.lexists(path):
        raise CheckpointIncomplete(f"piper: {path} is not a checkpoint directory")
    msg = f"piper: there is no checkpoint at {path}"
    if tmps:
        names = ", ".join(os.path.basename(t) for t in tmps)
        msg += (f"; {names} beside it is a save that did not finish (it has no commit) and is never loaded: the "
                f"next piper.save to {path} removes it")
    raise CheckpointIncomplete(msg)


def read_record(d: str) -> dict[str, Any] | None:
    p = os.path.join(d, RECORD)
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            record = json.load(f)
        if record.get("format") != FORMAT or not isinstance(record.get("files"), dict):
            raise ValueError(f"not a {FORMAT} record")
    except (OSError, ValueError) as e:
        raise _incomplete(d, f"its commit record {RECORD} is unreadable ({e})") from None
    return record


def verify(d: str) -> Any:
    """Check that ``d`` is a complete checkpoint; return its DCP metadata. With a commit record: every file
    it lists exists with its recorded size. Without one: not a temporary directory of a save, and DCP's
    ``.metadata`` exists. Either way every file ``.metadata`` locates data
    in exists and is long enough."""
    record = read_record(d)
    if record is not None:
        bad = []
        for name, size in sorted(record["files"].items()):
            p = os.path.join(d, name)
            if not os.path.isfile(p):
                bad.append(f"{name} is missing")
            elif os.path.getsize(p) != size:
                bad.append(f"{name} has {os.path.getsize(p)} bytes, the commit record says {size}")
        if bad:
            raise _incomplete(d, "its files do not match its commit record: " + _some(bad))
    elif _TMP.fullmatch(os.path.basename(d)):
        raise _incomplete(d, f"it is the temporary directory of a save that did not commit (no {RECORD})")
    if not os.path.isfile(os.path.join(d, _METADATA)):
        raise _incomplete(d, f"it has no {_METADATA} (DCP writes it after every rank's data), so the save that "
                             "wrote it did not finish, or it is not a checkpoint directory")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(d).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same
        raise _incomplete(d, f"its {_METADATA} is unreadable ({type(e).__name__}: {e})") from None
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    bad = []
    for rel, n in sorted(need.items()):
        p = os.path.join(d, rel)
        if not os.path.isfile(p):
            bad.append(f"{rel} is missing")
        elif os.path.getsize(p) < n:
            bad.append(f"{rel} has {os.path.getsize(p)} bytes, {_METADATA} locates data up to byte {n}")
    if bad:
        raise _incomplete(d, f"the data its {_METADATA} locates is not all there: " + _some(bad))
    return md


def _some(items: list[str], n: int = 4) -> str:
    return "; ".join(items[:n]) + (f"; and {len(items) - n} more" if len(items) > n else "")


def _incomplete(d: str, why: str) -> CheckpointIncomplete:
    return CheckpointIncomplete(
        f"piper: {d} is not a complete checkpoint and is not loaded: {why}. A save that was interrupted leaves "
        "such a directory (piper.save commits a checkpoint by renaming it into place only after every rank "
        "wrote it, so an interrupted piper.save leaves the previous checkpoint at its path); load another "
        "checkpoint or save again")
