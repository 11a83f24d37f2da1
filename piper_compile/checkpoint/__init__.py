"""Checkpoints of piper runs, with or without ZeRO, through ``torch.distributed.checkpoint`` (DCP).

    piper.save(step, "ckpt/step100")           # collective: every rank calls it
    piper.load(step, "ckpt/step100")           # also in fresh processes before the first call
    full = piper.full_state_dict(step)         # every parameter, full, on every rank (collective)
    piper.load_full_state_dict(step, eager_model.state_dict())

Layout of ``sharded_state_dict(step)`` (the layout of ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict``, with FQN keys)::

    {"model": {fqn: tensor of the parameter's full shape, ..., persistent buffers},
     "optim": {"state": {fqn: {"step": ..., "exp_avg": ..., ...}},
               "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}}

Each rank contributes only what it trains (the parameters of its UPDATE, so never another pipeline
stage's stale copy). A ZeRO shard is a flat range of its bucket, which covers a flat range of each of
the bucket's parameters; that range is described to DCP as a few boxes of the parameter's own shape
(row-major contiguous blocks: a partial row, whole rows, a partial row), each a view into the live shard
(or its optimizer state). So every rank writes only its shard, nothing is gathered, and a checkpoint
is independent of the layout: it loads into another ZeRO level, bucket size, world size or strategy,
and into an eager model (``dcp.load({"model": model.state_dict()}, checkpoint_id=path)``). Parameters
trained whole by a replicated group are written by every replica under the same key; DCP keeps one.
Under expert parallelism (``shard``) a rank's expert shard of a weight ``[E, ...]`` (experts
``r*E/G .. (r+1)*E/G - 1`` of a group of ``G``) is one box at offset ``r*E/G`` along dim 0, for the
weight and for each optimizer state tensor of the local shard's shape (scalars such as AdamW's ``step``
are written whole by every rank), so expert checkpoints also load into another EP size or an eager model.
Under tensor parallelism (``shard_tensor``) a rank's piece of a layer split along ``dim`` over a group
of ``G`` is one box at ``r*n`` along ``dim`` (``n = size/G``), or for a fused ``colwise:N`` layer one box
per block (at ``j*size/N + r*n/N``), again for the weight and each optimizer state tensor of its shape.
The data-parallel replicas of a tensor-parallel group write the same boxes under the same keys and
offsets; DCP's save planner keeps one of each (``dedup_save_plans``).

``dcp.load(sd)`` writes into the live shards, parameters and optimizer state in place; the two
top-level entries are DCP ``Stateful`` so that loading then re-gathers ZeRO-1/2 full parameters from
the loaded shards and applies the saved ``param_groups`` hyperparameters.

Collectives: ``save``, ``load``, ``dcp.save/load`` of ``sharded_state_dict`` and ``full_state_dict``
involve every rank of the world. Under ZeRO, piper hooks the model's ``state_dict`` and
``load_state_dict`` (installed at the first call that shards the state, or by any function here):
under ZeRO-3 ``model.state_dict()`` all-gathers the shards, so every rank of each ZeRO group must call
it together; ``model.load_state_dict(full)`` is local (each rank copies its pieces from the full
tensors). Under pipeline parallelism ``model.state_dict()`` on a rank is current only for the
parameters that rank trains; ``full_state_dict`` is current for all. Under expert parallelism the
model's expert weights hold no memory (each rank trains its local shard), and so do the split layers
under tensor parallelism: ``model.state_dict()`` and ``full_state_dict`` all-gather them within each
expert / tensor-parallel group (a collective over the world; every parameter is then current on every
rank), and ``model.load_state_dict(full)`` copies each rank's piece into its shard.

Saves are atomic (``commit.py``): ``save`` writes into a temporary sibling ``<path>.tmp-<id>`` and rank 0
renames it to ``path`` only after every rank's files and DCP's metadata are written and a commit record
(``.piper_commit.json``: every file and its size) is made durable, so a save that fails or is killed
anywhere leaves the previous checkpoint loadable. ``load`` refuses a directory that is not a complete
checkpoint (files not matching the record, an uncommitted temporary directory, no ``.metadata``, data
files shorter than the metadata says) and, by default (``strict=True``), a checkpoint whose parameters
differ from the model's. A directory without a record (plain ``dcp.save``, e.g. of an eager model) loads
if its ``.metadata`` and the data it locates are all there. DCP's ``CheckpointException`` surfaces as a
``PiperError`` naming the ranks, the entry and the cause.

Modules: ``api`` (the public functions), ``commit`` (atomic directories, pure file system), ``dcp_io``
(the save and load collectives, key checks, DCP errors), ``state_dict`` (the sharded state dict and what
finishes a load), ``layout`` (what a rank holds and trains), ``pieces`` (DCP's view of a rank's boxes of a
tensor), ``hooks`` (``model.state_dict()`` / ``load_state_dict`` under sharding).

Not covered: ``dcp.async_save`` (its staging copies tensors, which the piece views do not support),
modules' non-tensor ``extra_state``; ``save`` and ``load`` work on a directory every rank sees (local or
a shared file system, no fsspec URLs), one save to a path at a time; ``dcp.save(sharded_state_dict(step))``
called directly is DCP's own save, in place.
"""
from __future__ import annotations

from piper_compile.checkpoint.api import (
    LoadResult, full_state_dict, load, load_full_state_dict, materialize_optimizer_state, save, sharded_state_dict,
)
from piper_compile.checkpoint.commit import CheckpointIncomplete
from piper_compile.checkpoint.pieces import ShardPieces, flat_range_boxes

__all__ = ["CheckpointIncomplete", "LoadResult", "ShardPieces", "flat_range_boxes", "full_state_dict", "load",
           "load_full_state_dict", "materialize_optimizer_state", "save", "sharded_state_dict"]
