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

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from piper_compile.capture.decompose import SUM, ancestors, batch_terms
from piper_compile.capture.joint import BUFFER, INPUT, SYM, InputSpec, JointGraph

aten = torch.ops.aten
_NLL = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_MEAN = 1  # torch's Reduction::Mean
_LEAVES = (INPUT, SYM, BUFFER)  # what a loss's target and class weights may be computed from


@dataclass(frozen=True)
class MicroCounts:
    """This rank's micro-batches' total weights, and whether every label counts with weight 1 (then
    the weights are proportional to the samples and the sample weights are used, bitwise as before)."""

    counts: tuple[float, ...]
    full: bool


@dataclass(frozen=True)
class ItemCount:
    """Computes the total weight of a mean-reduced cross-entropy's labels per micro-batch."""

    gm: fx.GraphModule  # the joint graph's ops from ``reads`` to (target, class weights or None)
    reads: tuple[InputSpec, ...]
    ignore_index: int
    exact: bool = True  # the loss is this mean itself (else one term of it: ``find_item_count``)

    def counts(self, args: tuple[Any, ...], m: int, mb_size: int) -> MicroCounts:
        """The ``m`` micro-batches' total weights of this call's ``args`` (one host sync)."""
        totals: list[torch.Tensor] = []
        dropped: list[torch.Tensor] = []
        weighted = False
        for k in range(m):
            target, weight = self.gm(*[_value(s, args, k, mb_size) for s in self.reads])
            kept = target != self.ignore_index
            dropped.append((~kept).sum())
            if weight is None:
                totals.append(kept.sum().double())
            else:
                weighted = True
                picked = weight.detach()[target.clamp(min=0, max=weight.numel() - 1)]
                totals.append(torch.where(kept, picked, torch.zeros_like(picked)).double().sum())
        host = torch.stack(totals + [torch.stack(dropped).sum().double()]).tolist()
        return MicroCounts(tuple(host[:m]), not weighted and host[m] == 0)


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
    return isinstance(n, fx.Node) and n.target in _NLL and n.args[3] == _MEAN


def find_item_count(joint: JointGraph) -> ItemCount | None:
    """The ``ItemCount`` of ``joint``'s loss when it is a mean-reduced ``nll_loss`` whose target and class
    weights come from inputs and buffers only; None for any other loss (a mean over samples is assumed).
    A loss with such a mean as one of its terms (a cross-entropy plus a router's auxiliary loss) gets one
    that is not ``exact``: one seed per micro-batch cannot weigh both terms as the global batch would."""
    g = joint.gm.graph
    loss = next((n for n in g.nodes if n.name == joint.loss), None)
    if loss is None:
        return None
    exact = loss.target is operator.getitem and loss.args[1] == 0 and _mean_nll(loss.args[0])
    nll = loss.args[0] if exact else next((n for n in ancestors([loss]) if _mean_nll(n)), None)
    if nll is None:
        return None
    target, weight, ignore_index = nll.args[1], nll.args[2], int(nll.args[4])
    roots = [a for a in (target, weight) if isinstance(a, fx.Node)]
    needed = ancestors(roots)
    specs = [joint.spec(joint.value_of.get(n.name, "")) for n in g.nodes if n in needed and n.op == "placeholder"]
    if any(n.op == "get_attr" for n in needed) or \
            any(s is None or s.kind not in _LEAVES or s.arg_index is None for s in specs):
        return None
    return ItemCount(_subgraph(g, needed, roots, weight is not None), tuple(s for s in specs if s), ignore_index,
                     exact)


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
