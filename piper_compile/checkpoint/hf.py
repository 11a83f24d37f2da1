"""Hugging Face safetensors checkpoints: ``piper.load(step, hf_dir)`` reads a ``save_pretrained`` directory
straight into the run's layout, and ``piper.save(step, path, format="hf")`` writes one back.

Loading goes through ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``: the state dict each
rank passes holds only its own pieces (ZeRO shards as boxes of the full tensors, expert and
tensor-parallel pieces, whole parameters), so each rank reads only those byte ranges of the files
(``safetensors`` slices of a memory map); ``TrainState.load_bytes`` counts them. Names are the model's
own FQNs, below the transformers model it contains (``LlamaLoss.model`` -> ``model.layers.0...``); a tied
weight loads from whichever of its names the files hold; an adapted MoE block's stacked experts
(``nn/hf.py``) load from transformers' per-expert ``experts.<e>.<proj>.weight`` tensors, each rank reading
its experts only. A tensor missing from the files, one the model lacks, or one of another shape is a
``piper:`` error naming it (``strict=False``: missing ones keep their values, others are skipped).

Saving gathers the full values a file at a time (``max_shard_mb``), collectively; rank 0 writes
``model-0000i-of-0000N.safetensors``, the index, and the transformers model's ``config.json``, into a
temporary sibling renamed into place at the end.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any, Iterator

import torch
from torch import nn

from piper_compile.checkpoint.dcp_io import on_rank0
from piper_compile.checkpoint.layout import Ctx, raw_state_dict
from piper_compile.checkpoint.pieces import ShardPieces
from piper_compile.errors import PiperError, some

INDEX = "model.safetensors.index.json"


def is_hf_checkpoint(path: str) -> bool:
    """A directory of ``*.safetensors`` files without DCP's ``.metadata`` (a ``save_pretrained`` output)."""
    return os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata")) and any(
        f.endswith(".safetensors") for f in os.listdir(path))


def hf_root(module: nn.Module) -> tuple[str, nn.Module | None]:
    """(prefix, model): the transformers model inside ``module`` whose names the files use (``module``
    itself when it is one), or ("", None) for a plain module (its own names)."""
    for name, sub in module.named_modules():
        if callable(getattr(sub, "save_pretrained", None)) and hasattr(sub, "config"):
            return (f"{name}." if name else ""), sub
    return "", None


def _stacked(module: nn.Module) -> dict[str, tuple[str, int]]:
    """Adapted MoE blocks' stacked expert weights: module key -> (per-expert key pattern, experts)."""
    from piper_compile.nn.hf import StackedMoE

    out = {}
    for name, mod in module.named_modules():
        if isinstance(mod, StackedMoE):
            prefix = f"{name}." if name else ""
            for stacked, proj in (("w_gate", mod.spec.gate), ("w_up", mod.spec.up), ("w_down", mod.spec.down)):
                out[prefix + stacked] = (prefix + "experts.{e}." + proj + ".weight", getattr(mod, stacked).shape[0])
    return out


def hf_keys(module: nn.Module) -> list[list[str]]:
    """The checkpoint names of each tensor of ``module``'s state dict (several for a tied weight, one per
    expert for stacked experts), below ``hf_root``'s prefix."""
    prefix, _ = hf_root(module)
    stacked = _stacked(module)
    by_id: dict[int, list[str]] = {}
    order: list[int] = []
    for key, v in raw_state_dict(module).items():
        if not isinstance(v, torch.Tensor):
            continue
        if id(v) not in by_id:
            order.append(id(v))
        names = [p.format(e=e) for p, n in [stacked[key]] for e in range(n)] if key in stacked else [key]
        by_id.setdefault(id(v), []).extend(n[len(prefix):] if n.startswith(prefix) else n for n in names)
    return [by_id[i] for i in order]


def _expert_entries(pattern: str, value: Any) -> Iterator[tuple[str, Any]]:
    """Per-expert entries of a stacked ``[E, A, B]`` weight (``x @ w``: transformers stores each expert's
    ``[B, A]`` Linear weight), from a whole tensor or this rank's boxes of it."""
    boxes = value.local_tensors() if isinstance(value, ShardPieces) else [(torch.Size([0, 0, 0]), value)]
    shape = tuple(value.shape)
    per: dict[int, list[tuple[torch.Size, torch.Tensor]]] = {}
    for off, view in boxes:
        for i in range(view.shape[0]):
            part = view[i].t()  # [b, a] box of expert e's [B, A] weight
            per.setdefault(off[0] + i, []).append((torch.Size([off[2], off[1]]), part))
    for e in sorted(per):
        full = per[e][0][1].shape == (shape[2], shape[1]) and len(per[e]) == 1
        yield pattern.format(e=e), per[e][0][1] if full else ShardPieces((shape[2], shape[1]), per[e])


def entries(ctx: Ctx) -> dict[str, Any]:
    """This rank's pieces under checkpoint names (every alias of a tied weight, experts one by one)."""
    from piper_compile.checkpoint.state_dict import _model_entries

    assert ctx.module is not None
    prefix, _ = hf_root(ctx.module)
    stacked = _stacked(ctx.module)
    out: dict[str, Any] = {}
    for key, v in _model_entries(ctx).items():
        items = _expert_entries(stacked[key][0], v) if key in stacked else [(key, v)]
        for k, value in items:
            out[k[len(prefix):] if k.startswith(prefix) else k] = value
    return out


def _counting_reader(path: str) -> Any:
    """A ``HuggingFaceStorageReader`` that counts the bytes of the slices it reads (``bytes_read``)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class Reader(HuggingFaceStorageReader):
        bytes_read = 0

        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            size = torch.empty((), dtype=self.storage_data[req.storage_index].dtype).element_size()
            self.bytes_read += math.prod(int(n) for n in req.lengths) * size
            super()._process_read_request(f, req, planner)

    return Reader(path)


def check(module: nn.Module, path: str, strict: bool) -> tuple[list[str], list[str], Any, Any]:
    """(missing, unexpected, reader, metadata): the model's tensors the files lack (by their first name)
    and the files' tensors the model lacks; raise when ``strict`` and either is non-empty."""
    reader = _counting_reader(path)
    md = reader.read_metadata().state_dict_metadata
    groups = hf_keys(module)
    missing = [g[0] for g in groups if not any(k in md for k in g)]
    known = {k for g in groups for k in g}
    unexpected = sorted(k for k in md if k not in known)
    if strict and (missing or unexpected):
        raise PiperError(f"piper: the Hugging Face checkpoint {path} does not match the model: "
                         + "; ".join(w for w in (f"missing {some(missing, 6)}" if missing else "",
                                                 f"unexpected {some(unexpected, 6)}" if unexpected else "") if w)
                         + ". Load the checkpoint of this model (names below the transformers model it contains), "
                         "or pass strict=False")
    return missing, unexpected, reader, md


def load(ctx: Ctx, path: str, strict: bool) -> None:
    """Read this rank's pieces from the safetensors files at ``path`` into the live state (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from piper_compile.checkpoint.state_dict import _after_model_load

    assert ctx.module is not None
    _, _, reader, md = check(ctx.module, path, strict)
    sd = {}
    for k, v in entries(ctx).items():
        if k not in md:
            continue
        if tuple(md[k].size) != tuple(v.shape):
            raise PiperError(f"piper: the Hugging Face checkpoint {path} holds {k} of shape {tuple(md[k].size)}, the "
                             f"model's is {tuple(v.shape)}; load a checkpoint of this model's configuration")
        sd[k] = v
    dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    _after_model_load(ctx)
    ctx.st.load_bytes = reader.bytes_read


def save(ctx: Ctx, path: str, max_shard_mb: float = 2048) -> None:
    """Write the model's full tensors as a ``save_pretrained`` directory (collective; rank 0 writes)."""
    from safetensors.torch import save_file

    from piper_compile.checkpoint.state_dict import full_buffers, full_values

    assert ctx.module is not None
    prefix, hf_model = hf_root(ctx.module)
    tmp = f"{os.fspath(path)}.tmp-hf"
    on_rank0(lambda: (shutil.rmtree(tmp, ignore_errors=True), os.makedirs(tmp)), f"preparing {tmp}")
    files: list[dict[str, str]] = []
    buffers = full_buffers(ctx)  # another stage's buffers: from their holders (collective)
    for chunk in _chunks(ctx, max_shard_mb * 2**20):
        values = full_values(ctx, set(chunk))

        def write() -> dict[str, str]:
            tensors = _named(ctx, values, buffers, prefix, chunk)
            name = f"part-{len(files):05d}.safetensors"
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, os.path.join(tmp, name),
                      metadata={"format": "pt"})
            return {k: name for k in tensors}

        files.append(on_rank0(write, f"writing {tmp}"))  # a failure on rank 0 is raised on every rank
    on_rank0(lambda: _finish(tmp, os.fspath(path), files, hf_model), f"committing {path}")


def _chunks(ctx: Ctx, limit: float) -> Iterator[list[str]]:
    """The joint's parameter FQNs in module order, grouped into files of at most ``limit`` bytes."""
    chunk: list[str] = []
    size = 0
    for f, p in ctx.params.items():
        n = p.numel() * p.element_size()
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(f)
        size += n
    yield chunk


def _named(ctx: Ctx, values: dict[str, torch.Tensor], buffers: dict[int, torch.Tensor], prefix: str,
           chunk: list[str]) -> dict[str, torch.Tensor]:
    """The chunk's full values under checkpoint names (a tied weight once, experts split), plus the
    persistent buffers with the first chunk (``buffers``: ``full_buffers``, by the buffer's id)."""
    assert ctx.module is not None
    stacked = _stacked(ctx.module)
    out: dict[str, torch.Tensor] = {}
    for f in chunk:
        key = ctx.name_of[f]
        if key in stacked:
            pattern, n = stacked[key]
            out.update({pattern.format(e=e): values[f][e].t() for e in range(n)})
        else:
            out[key] = values[f]
    if chunk and chunk[0] == next(iter(ctx.params)):
        params = {id(p) for p in ctx.params.values()}
        out.update({k: buffers.get(id(v), v).detach() for k, v in raw_state_dict(ctx.module).items()
                    if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and id(v) not in params})
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in out.items()}


def _finish(tmp: str, path: str, files: list[dict[str, str]], hf_model: nn.Module | None) -> None:
    """Rename the parts as transformers names them, write the index and config, move into ``path``."""
    n = len(files)
    weight_map: dict[str, str] = {}
    for i, part in enumerate(files):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(tmp, f"part-{i:05d}.safetensors"), os.path.join(tmp, final))
        weight_map.update({k: final for k in part})
    if n > 1:
        total = sum(os.path.getsize(os.path.join(tmp, f)) for f in set(weight_map.values()))
        with open(os.path.join(tmp, INDEX), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
    config = getattr(hf_model, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


