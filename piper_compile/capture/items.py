"""Losses that are means over items, not samples: the weight of each micro-batch in the global mean.

piper's step equals single-device training on the concatenated global batch. For a loss that is a mean
over the batch's samples, each micro-batch weighs its share of the samples (``runtime/consistency.Weights``).
A cross-entropy with ignored labels (padding and prompt tokens set to ``-100``, the usual language-model
batch) or with class weights is a mean over its *items*: the sum of its per-token losses divided by its
total weight (the count of labels not ignored, or their class weights' sum). The mean of micro-batch means
is then not the global mean -- a micro-batch of short sequences weighs as much as one of long sequences
-- and the step would train on a plausible, different loss (the "gradient accumulation" pitfall).

When the captured loss is exactly such a mean (``nll_loss_forward`` with ``reduction="mean"``, the
loss ``F.cross_entropy`` lowers to), its total weight depends only on the labels (and the class weights),
so it is known before the step runs: ``ItemCount`` replays the graph's few ops from the inputs to the
loss's target (a reshape, a shift) on each micro-batch's slice and sums the weights of the labels kept.
The call check then shares every rank's total, and each micro-batch's loss is seeded with its items'
share of the global total: the step's loss and gradients are those of the global item mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from piper_compile.capture.decompose import NLL, SUM, ancestors, batch_terms
from piper_compile.capture.joint import BUFFER, INPUT, SYM, InputSpec, JointGraph

aten = torch.ops.aten
_MEAN = 1  # torch's Reduction::Mean
_LEAVES = (INPUT, SYM, BUFFER)  # what a loss's target and class weights may be computed from


@dataclass(frozen=True)
class MicroCounts:
    """This rank's micro-batches' total weights; whether every label counts with weight 1 and every
    micro-batch holds as many (then the weights are proportional to the samples and the sample weights
    are used, bitwise as before); and whether the loss's item means all count the same items in every
    micro-batch."""

    counts: tuple[float, ...]
    full: bool
    agree: bool = True
    hand_written: bool = False  # the counts are a masked mean's own count, not a cross-entropy's labels

    @property
    def seeded(self) -> tuple[float, ...]:
        """What each micro-batch's seed is its share of: its count, or 1 where a hand-written count is 0
        (its forward divides by 1 there: ``guard_empty_counts``), so its sum is added over the global count
        as eager adds it (0 where the sum is masked by the same mask; not in ``l.sum() / mask.sum()``)."""
        return tuple(1.0 if self.hand_written and c == 0 else c for c in self.counts)


@dataclass(frozen=True)
class ItemPart:
    """One item mean of the loss: the joint graph's ops from ``reads`` to its (target, class weights or
    None) -- or, for a hand-written masked mean, to (its count, None)."""

    gm: fx.GraphModule
    reads: tuple[InputSpec, ...]
    ignore_index: int | None  # None: ``gm`` returns the count itself

    def total(self, args: tuple[Any, ...], k: int, mb_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``k``'s total item weight, and a positive number where its items are not
        proportional to its samples."""
        target, weight = self.gm(*[_value(s, args, k, mb_size) for s in self.reads])
        return _total(target, weight, self.ignore_index)


@dataclass(frozen=True)
class ItemCount:
    """Computes the total weight of the loss's items per micro-batch: a mean-reduced cross-entropy's
    labels, a hand-written masked mean's count, or several such means of the same items (label smoothing
    adds a mean over the kept labels to the cross-entropy)."""

    parts: tuple[ItemPart, ...]
    exact: bool = True  # the loss is these means itself (else one term of it: ``find_item_count``)

    def counts(self, args: tuple[Any, ...], m: int, mb_size: int) -> MicroCounts:
        """The ``m`` micro-batches' total weights of this call's ``args`` (one host sync)."""
        totals: list[torch.Tensor] = []
        dropped: list[torch.Tensor] = []
        for part in self.parts:
            for k in range(m):
                total, lost = part.total(args, k, mb_size)
                totals.append(total)
                dropped.append(lost)
        host = torch.stack(totals + [torch.stack(dropped).sum()]).tolist()
        per_part = [host[i * m:(i + 1) * m] for i in range(len(self.parts))]
        agree = all(math.isclose(a, b, rel_tol=1e-6) for other in per_part[1:] for a, b in zip(per_part[0], other))
        even = len(set(per_part[0])) <= 1  # a label per sample row, not a selection of varying size
        hand_written = self.parts[0].ignore_index is None
        return MicroCounts(tuple(per_part[0]), host[-1] == 0 and even, agree, hand_written)


def _total(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's total item weight, and a positive number where its items are not proportional to
    its samples (labels dropped, class weights, or a count of the user's own)."""
    if ignore_index is None:
        return target.detach().double().sum(), torch.ones((), dtype=torch.float64)
    kept = target != ignore_index
    if weight is None:
        return kept.sum().double(), (~kept).sum().double()
    picked = weight.detach()[target.clamp(min=0, max=weight.numel() - 1)]
    return torch.where(kept, picked, torch.zeros_like(picked)).double().sum(), torch.ones((), dtype=torch.float64)


def _value(spec: InputSpec, args: tuple[Any, ...], k: int, mb_size: int) -> Any:
    """The value of input ``spec`` in micro-batch ``k`` (as ``runtime/step.Step`` gives it to segments)."""
    if spec.kind == SYM:
        return mb_size if spec.batched else int(args[spec.arg_index])
    x = args[spec.arg_index]
    return x.narrow(0, k * mb_size, mb_size) if spec.kind == INPUT and spec.batched else x


@dataclass(frozen=True)
class LossForm:
    """How a captured loss adds up over micro-batches and replicas: a mean over samples (the default),
    a mean over items (``items``), or a sum over the batch (``additive``: ``reduction="sum"``, or
    ``x.sum()``, possibly times a constant), whose pieces' losses and gradients add up unweighted."""

    items: ItemCount | None = None
    additive: bool = False


def loss_form(joint: JointGraph) -> LossForm:
    """The ``LossForm`` of ``joint``'s loss."""
    return LossForm(find_item_count(joint), is_sum_over_batch(joint))


def is_sum_over_batch(joint: JointGraph) -> bool:
    """Whether the loss is a sum over the batch (times constants): ``reduction="sum"``, ``x.sum()``, a sum
    divided by a count passed in as an input (``capture/decompose.py`` tells the terms apart)."""
    return batch_terms(joint).form == SUM


def _mean_nll(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.target in NLL and n.args[3] == _MEAN


def find_item_count(joint: JointGraph) -> ItemCount | None:
    """The ``ItemCount`` of ``joint``'s loss when it is a mean-reduced ``nll_loss`` whose target and class
    weights come from inputs and buffers only; None for any other loss (a mean over samples is assumed).
    A loss with such a mean as one of its terms (a cross-entropy plus a router's auxiliary loss) gets one
    that is not ``exact``: one seed per micro-batch cannot weigh both terms as the global batch would."""
    g = joint.gm.graph
    loss = next((n for n in g.nodes if n.name == joint.loss), None)
    if loss is None:
        return None
    sources = batch_terms(joint).items
    if sources:
        by_name = {n.name: n for n in g.nodes if n.name in sources}
        parts = [_part(joint, by_name[name]) for name in sources]
        return ItemCount(tuple(p for p in parts if p)) if all(parts) else None
    nll = next((n for n in ancestors([loss]) if _mean_nll(n)), None)
    part = _part(joint, nll) if nll is not None else None
    return ItemCount((part,), exact=False) if part else None


def _part(joint: JointGraph, source: fx.Node) -> ItemPart | None:
    """The ``ItemPart`` of an item mean (a mean-reduced ``nll_loss`` node, or a masked mean's count)."""
    if _mean_nll(source):
        roots = [a for a in (source.args[1], source.args[2]) if isinstance(a, fx.Node)]
        return _counted(joint, roots, int(source.args[4]))
    return _counted(joint, [source], None)


def _counted(joint: JointGraph, roots: list[fx.Node], ignore_index: int | None) -> ItemPart | None:
    """The ``ItemPart`` replaying the joint graph's ops from its inputs to ``roots``; None where they read
    anything but inputs, buffers and sizes."""
    g = joint.gm.graph
    needed = ancestors(roots)
    specs = [joint.spec(joint.value_of.get(n.name, "")) for n in g.nodes if n in needed and n.op == "placeholder"]
    if any(n.op == "get_attr" for n in needed) or \
            any(s is None or s.kind not in _LEAVES or s.arg_index is None for s in specs):
        return None
    return ItemPart(_subgraph(g, needed, roots, len(roots) > 1), tuple(s for s in specs if s), ignore_index)


def _subgraph(g: fx.Graph, needed: set[fx.Node], roots: list[fx.Node], weighted: bool) -> fx.GraphModule:
    """The nodes ``needed`` (in the joint graph's order) as a graph returning (target, weight or None)."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:
        if n in needed:
            env[n] = sub.node_copy(n, lambda a: env[a])
    outs = [env[r] for r in roots]
    sub.output((outs[0], outs[1] if weighted else None))
    return fx.GraphModule(torch.nn.Module(), sub)


def guard_empty_counts(joint: JointGraph) -> None:
    """Where the loss is a hand-written masked mean (``sum / count``), divide by 1 where a piece's count is
    0: ``0 / 0`` in its forward would put NaN into its gradients. Such a piece is seeded with ``1 / C`` of
    the global count ``C`` (``MicroCounts.seeded``), so its sum adds up as in eager's ``sum / C``: nothing
    where the sum is masked by the same mask, its rows' share where it is not (``l.sum() / mask.sum()``).
    Pieces with items, and a whole batch with items, compute exactly as written; a step whose global
    count is 0 still gives NaN, as eager does."""
    g = joint.gm.graph
    for count in [n for n in g.nodes if n.name in batch_terms(joint).items and not _mean_nll(n)]:
        _divide_by_one_where_empty(joint, count)


def _divide_by_one_where_empty(joint: JointGraph, count: fx.Node) -> None:
    g = joint.gm.graph
    val = count.meta["val"]
    with g.inserting_after(count):
        empty = g.call_function(aten.eq.Scalar, (count, 0))
    with g.inserting_after(empty):
        safe = g.call_function(aten.where.ScalarSelf, (empty, 1, count))
    with val.fake_mode:
        empty.meta["val"] = val == 0
        safe.meta["val"] = torch.where(empty.meta["val"], 1, val)
    for n in (empty, safe):
        n.meta["stack_trace"] = count.meta.get("stack_trace")
    count.replace_all_uses_with(safe, delete_user_cb=lambda user: user not in (empty, safe))
    joint.gm.recompile()
