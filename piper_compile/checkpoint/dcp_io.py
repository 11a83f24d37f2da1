"""Saving and loading a sharded state dict through DCP as collectives that either finish on every rank or
raise a ``piper:`` error on every rank: the atomic save protocol of ``commit.py`` run over the world
(rank 0 prepares and commits, every rank learns the outcome), the key check of a strict load, and DCP's
``CheckpointException`` (a ``BaseException`` holding each failed rank's exception) turned into a
``PiperError`` naming the ranks, the entry and the cause."""
from __future__ import annotations

import warnings
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from piper_compile.checkpoint import commit
from piper_compile.errors import PiperError, some

T = TypeVar("T")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def on_rank0(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on rank 0 and give every rank its result, or raise its error on every rank (a collective
    over the world)."""
    rank, world = _rank_world()
    box: list[Any] = [None, None]
    if rank == 0:
        try:
            box[0] = fn()
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            box[1] = e if isinstance(e, PiperError) else PiperError(f"piper: {what} failed on rank 0: "
                                                                    f"{type(e).__name__}: {e}")
    if world > 1:
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as e:  # noqa: BLE001 - a rank died or the connection broke
            done = "" if rank else (" (on rank 0 it failed)" if box[1] is not None else " (on rank 0 it succeeded)")
            raise PiperError(f"piper: {what}: the ranks could not exchange its outcome{done}; another rank failed or "
                             f"the process group broke: {type(e).__name__}: {e}") from e
    if box[1] is not None:
        raise box[1]
    return box[0]


def save(sd: dict[str, Any], path: str) -> None:
    """Write ``sd`` (every rank's part) as the checkpoint ``path``, atomically (``commit.py``): into a
    temporary sibling, then committed by rank 0 once DCP has every rank's files and its metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = commit.local_path(path)
    _, world = _rank_world()
    save_id = on_rank0(lambda: (commit.prepare(path), commit.new_save_id())[1], f"preparing the save to {path}")
    tmp = commit.tmp_dir(path, save_id)
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except CheckpointException as e:  # every rank gets it: no rank writes into tmp any more
        if _rank_world()[0] == 0:
            commit.discard(tmp)
        raise checkpoint_error(e, "saving", path, sd, f"{path} still holds the previous checkpoint, if any") from e
    except Exception as e:  # noqa: BLE001 - a collective failed: another rank died
        if _rank_world()[0] == 0:
            commit.discard(tmp)
        raise PiperError(f"piper: saving the checkpoint {path} failed on rank {_rank_world()[0]}: "
                         f"{type(e).__name__}: {e}. Nothing was committed: {path} still holds the previous "
                         "checkpoint, if any") from e

    def finish() -> None:
        commit.write_record(tmp, save_id, world)
        commit.commit(tmp, path, save_id)

    on_rank0(finish, f"committing the checkpoint {tmp} as {path}")


def load(sd: dict[str, Any], directory: str, strict: bool) -> None:
    """``dcp.load(sd)`` from ``directory``; entries of ``sd`` the checkpoint lacks are an error when
    ``strict``, and keep their values otherwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    try:
        dcp.load(sd, checkpoint_id=directory, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    except CheckpointException as e:
        raise checkpoint_error(e, "loading", directory, sd, "the run's state may be partly loaded") from e


def flat_keys(sd: Any, prefix: str = "") -> list[str]:
    """The keys DCP flattens a nested state dict to (``model.fc.weight``, ``optim.state.fc.weight.exp_avg``,
    ``optim.param_groups.0.lr``)."""
    if isinstance(sd, dict):
        return [k for key, v in sd.items() for k in flat_keys(v, f"{prefix}{key}.")]
    if isinstance(sd, list) and any(isinstance(v, (dict, list)) for v in sd):  # DCP keeps flat lists whole
        return [k for i, v in enumerate(sd) for k in flat_keys(v, f"{prefix}{i}.")]
    return [prefix[:-1]]


def checkpoint_error(e: BaseException, doing: str, path: str, sd: dict[str, Any], after: str) -> PiperError:
    """DCP's ``CheckpointException`` as a ``PiperError``: each failed rank, the state-dict entry its error
    names (the longest key of ``sd`` found in the message) and the cause."""
    failures = getattr(e, "failures", None) or {}
    keys = sorted(flat_keys(sd), key=len, reverse=True)
    parts = []
    for r, wrapped in sorted(failures.items()):
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        cause = f"{type(exc).__name__}: {exc}".strip()
        key = next((k for k in keys if k in cause), None)
        parts.append(f"rank {r}" + (f", entry {key!r}" if key else "") + f": {cause}")
    ranks = ", ".join(str(r) for r in sorted(failures)) or "?"
    return PiperError(f"piper: {doing} the checkpoint {path} failed on rank(s) {ranks}: " + "; ".join(parts or [str(e)])
                      + f". {after}")


def key_mismatch(model_keys: list[str], metadata: Any) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)``: the model's state-dict keys (parameters, persistent buffers) the checkpoint
    has no ``model.`` entry for, and the parameters the checkpoint holds (as ``model.`` entries or optimizer
    state) that the model lacks. Optimizer state absent from the checkpoint is neither."""
    ck = metadata.state_dict_metadata
    saved = {k[len("model."):] for k in ck if k.startswith("model.")}
    with_state = {k[len("optim.state."):].rsplit(".", 1)[0] for k in ck if k.startswith("optim.state.")}
    have = set(model_keys)
    missing = [k for k in model_keys if k not in saved]
    unexpected = sorted((saved | with_state) - have)
    return missing, unexpected


def check_keys(model_keys: list[str], metadata: Any, path: str, strict: bool) -> tuple[list[str], list[str]]:
    """Raise (``strict``) or warn when the checkpoint's parameters and the model's differ."""
    missing, unexpected = key_mismatch(model_keys, metadata)
    if not missing and not unexpected:
        return missing, unexpected
    what = []
    if unexpected:
        what.append(f"it holds {len(unexpected)} entr{'y' if len(unexpected) == 1 else 'ies'} the model lacks "
                    f"(unexpected: {some(unexpected, 8)})")
    if missing:
        what.append(f"it lacks {len(missing)} the model has (missing: {some(missing, 8)})")
    if not any(k.startswith("model.") for k in metadata.state_dict_metadata):
        what.append("it has no 'model.' entries at all: piper loads checkpoints of the layout {'model': "
                    "model.state_dict(), 'optim': ...} (piper.save, or dcp.save({'model': model.state_dict()}))")
    msg = f"piper: the checkpoint {path} does not match the model: " + "; ".join(what)
    if strict:
        raise PiperError(msg + ". Load a checkpoint of this model, or pass strict=False to load the entries both "
                               "have (missing ones keep their current values, unexpected ones are ignored)")
    warnings.warn(msg + "; strict=False: loading the entries both have", stacklevel=3)
    return missing, unexpected


