"""Ops that relate samples of the batch to each other, which micro-batches and replicas cannot split.

piper's step equals single-device training on the global batch because every sample's computation is
its own until the loss averages them. An op whose result holds the batch dimension twice -- the
similarity matrix of a contrastive loss (``za @ zb.T`` with in-batch negatives), pairwise distances for
hard-negative mining -- relates every sample to every other: cut into micro-batches or data-parallel
replicas, each piece would see only its own samples as negatives, and the loss would be a plausible,
different number (CLIP-style toy: 1.447 with split(2) against eager's 2.239). Such a model is refused
where the batch is cut, naming the op and the user's line; ``options["local_batch_ops"] = True`` accepts
the per-piece meaning (what DDP computes).
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import fx

from piper_compile.capture.decompose import batch_problem
from piper_compile.capture.joint import INPUT, JointGraph, describe_op, has_batch
from piper_compile.errors import PiperError


def find_batch_coupling(gm: fx.GraphModule, batch_symbols: frozenset[Any]) -> str | None:
    """The first op of Dynamo's graph (nested regions' bodies included) whose result has the batch size
    in two dimensions; None if there is none or the batch is static."""
    if not batch_symbols:
        return None
    for node in (n for g in gm.modules() if isinstance(g, fx.GraphModule) for n in g.graph.nodes):
        out = node.meta.get("example_value")
        if node.op in ("call_function", "call_method", "call_module") and isinstance(out, torch.Tensor) \
                and sum(has_batch(size, batch_symbols) for size in out.shape) >= 2:
            return describe_op(node, None) + f" -> shape {tuple(out.shape)}"
    return None


def refuse_coupling(joint: JointGraph, layout: Callable[[], Any]) -> None:
    """Raise where the step does not add up over pieces of the batch -- an op relates the batch's samples
    to each other, or the loss is not a sum or mean over them (``capture/decompose.py``) -- and the plan
    cuts the batch (its ``CallLayout``, made only then: more than one micro-batch or data-parallel replica)."""
    op = find_batch_coupling(joint.dynamo_gm, joint.batch_symbols)
    problem = batch_problem(joint) if op is None else None
    if op is None and problem is None:
        return
    cuts = layout()
    microbatches, replicas = cuts.microbatches, len(set(cuts.replica))
    if microbatches <= 1 and replicas <= 1:
        return
    cut = " and ".join(([f"{microbatches} micro-batches"] if microbatches > 1 else []) +
                       ([f"{replicas} data-parallel replicas"] if replicas > 1 else []))
    what = (f"the forward relates samples of the batch to each other at {op} (a result with the batch "
            "dimension twice, e.g. the in-batch negatives of a contrastive loss)") if op is not None else \
        f"the step does not add up over pieces of the batch: at {problem}"
    raise PiperError(
        f"piper: {what}. This plan cuts the batch into {cut}, and each piece would see only its own samples, "
        "so the step would differ from single-device training on the global batch. Train this model with one "
        "micro-batch on one replica, or pass options['local_batch_ops'] = True to accept that each micro-batch "
        f"and replica computes it over its own samples (as DDP would).{_batch_note(joint)}")


def _batch_note(joint: JointGraph) -> str:
    """Where tensor inputs are passed whole (their dim 0 is not the batch's size), which inputs piper cuts:
    a sequence-first layout, ``(time, batch, ...)``, reads as a batch of time steps."""
    placeholders = joint.dynamo_gm.graph.find_nodes(op="placeholder")
    cut, whole = [], []
    for spec in (s for s in joint.inputs if s.kind == INPUT and s.arg_index is not None):
        val = placeholders[spec.arg_index].meta.get("example_value")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            size = val.shape[0]
            size = size.node.hint if isinstance(size, torch.SymInt) else size
            (cut if spec.batched else whole).append(f"`{_short(spec.name)}` ({size})")
    if not (cut and whole):
        return ""
    return (f" piper cuts the inputs along dim 0 ({', '.join(cut)}) and passes {', '.join(whole)} whole to "
            "every piece: where the batch is another dimension of your inputs (a sequence-first layout, "
            "`(time, batch, ...)`), move it to dim 0.")


def _short(source: str) -> str:
    """``L['x']`` -> ``x``; other source names as they are."""
    keys = re.findall(r"\['([^']+)'\]", source)
    return keys[-1] if keys else source
