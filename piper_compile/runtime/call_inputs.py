"""What a call's arguments say about the call: its local batch, a fingerprint of the batch where ranks
of one replica must pass the same one, and the loss's item weights per micro-batch -- the rank's row of
the call check (``runtime/consistency.py``) and what its loss seeds need."""
from __future__ import annotations

import warnings
import weakref
from typing import Any

from piper_compile.capture.items import ItemCount, LossForm, MicroCounts
from piper_compile.capture.joint import INPUT, JointGraph
from piper_compile.errors import PiperError
from piper_compile.runtime.consistency import (
    ALL_ITEMS, NO_ITEMS, SOME_ITEMS, CallCheck, CallLayout, CallRecord, batch_fingerprint, shares_batches,
)


def local_batch(joint: JointGraph, args: tuple[Any, ...], microbatches: int) -> int:
    """The leading size of the batched inputs (all equal), or the micro-batch count if none is batched."""
    sizes = {s.name: int(args[s.arg_index].shape[0]) for s in joint.inputs if s.kind == INPUT and s.batched}
    if len(set(sizes.values())) > 1:
        raise PiperError(f"piper: the batched inputs have different leading sizes {sizes}; every batched input "
                         "must hold the same samples along dim 0")
    return next(iter(sizes.values()), microbatches)


def batch_print(joint: JointGraph, args: tuple[Any, ...], layout: CallLayout) -> int:
    """The inputs' content fingerprint, where ranks of one replica must pass the same batch; else 0."""
    if not shares_batches(layout):
        return 0
    return batch_fingerprint([args[s.arg_index] for s in joint.inputs if s.kind == INPUT and s.arg_index is not None])


def item_counts(items: ItemCount | None, args: tuple[Any, ...], batch: int, layout: CallLayout) -> MicroCounts | None:
    """The loss's item weights per micro-batch, where it is a mean over items and the batch splits. A
    loss with such a mean as one term only, or with item means that count different items, is weighed by
    samples, with a warning (once) when its labels are not all kept and the batch is cut: the step then
    differs from single-device training."""
    m = layout.microbatches
    if items is None or batch <= 0 or batch % m:
        return None
    counts = items.counts(args, m, batch // m)
    if items.exact and counts.agree:
        return counts
    cut = m > 1 or len(set(layout.replica)) > 1
    key = items.parts[0].gm
    if cut and not counts.full and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            "piper: the loss adds other terms to a cross-entropy whose labels are not all kept (ignore_index, "
            "class weights), or its means over labels count different labels; micro-batches and replicas weigh "
            "it by their samples, not by their labels, so the step differs from single-device training on the "
            "global batch. For an exact step, return the cross-entropy alone, or give every micro-batch as many "
            "labels kept.", stacklevel=5)
    return None


_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the item counts (their graphs) warned about once


def call_check(joint: JointGraph, form: LossForm, args: tuple[Any, ...], ids: tuple[int, int, int],
               forward_only: bool, layout: CallLayout, rank: int, world: int, timeout_s: float) -> CallCheck:
    """The call check of this call (``ids``: the model's index, the plan's fingerprint, the call's index;
    a call this rank makes alone has index -1; ``form``: how the loss adds up), started."""
    batch = local_batch(joint, args, layout.microbatches)
    holds_loss = ids[2] < 0 or rank in layout.holders  # elsewhere the loss's buffers may be released
    counts = item_counts(form.items if holds_loss else None, args, batch, layout)
    mode = NO_ITEMS if counts is None else ALL_ITEMS if counts.full else SOME_ITEMS
    record = CallRecord(*ids, batch, len(args), forward_only, batch_print(joint, args, layout) if world > 1 else 0,
                        sum(counts.counts) if counts else 0.0, mode)
    per_mb = counts.seeded if counts else ()
    if ids[2] < 0:
        return CallCheck.alone(record, layout.microbatches, per_mb, form.additive)
    return CallCheck(record, layout, rank, world, timeout_s, per_mb, form.additive)
