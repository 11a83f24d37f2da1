"""Whether the captured step adds up over pieces of the batch: the rules micro-batches and replicas need.

piper cuts the global batch into micro-batches and data-parallel replicas, runs each piece's forward and
backward on its own, and weighs the pieces' losses and gradients into the step's (``runtime/consistency``:
by samples for a mean, by labels for a cross-entropy's item mean, unweighted for a sum). That equals
single-device training on the whole batch only when

1. every batched value of the forward is computed from its own samples: nothing reduced over the batch
   (a mean over samples, BatchNorm's batch statistics) flows back into a batched value, and no op mixes
   samples along the batch dimension (a softmax or a cumulative sum over it);
2. the loss is a linear combination of sums and means over the batch: a statistic of the batch that is
   not a sum or mean (variance, maximum, norm) or a non-linear function of one (a product of two means, a
   square root, a sum divided by a count taken from the batch) is not the weighted sum of its pieces' values;
3. its terms weigh alike: a sum over the batch plus a mean (or plus a term without the batch) cannot be
   weighed as the global batch would, with one weight per piece.

``batch_problem`` walks the joint graph's forward (the ops that do not depend on the loss's tangent) and
names the first op that breaks one of them; ``capture/coupling.refuse_coupling`` refuses such a model where
the plan cuts the batch. Integer values (counts of tokens per expert, sorted expert ids) route samples
without mixing their values and are not followed. With a static batch size nothing can be told apart and
nothing is reported.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from piper_compile.capture.joint import BUFFER, INPUT, SYM, InputSpec, JointGraph, describe_op, has_batch

aten = torch.ops.aten

# A term's form: how it adds up over pieces of the batch.
MEAN, SUM, ITEMS, CONST = "a mean over the batch", "a sum over the batch", "a cross-entropy's label mean", \
    "a term without the batch"

_MEAN_REDUCTION, _SUM_REDUCTION = 1, 2
# losses whose ``reduction`` (at this argument) makes them sums or means over the batch
_LOSSES = {aten.mse_loss.default: 2, aten.smooth_l1_loss.default: 2, aten.huber_loss.default: 2,
           aten.kl_div.default: 2, aten.soft_margin_loss.default: 2, aten.binary_cross_entropy.default: 3,
           aten.binary_cross_entropy_with_logits.default: 4, aten.nll_loss_forward.default: 3,
           aten.nll_loss2d_forward.default: 3}
NLL = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)  # what F.cross_entropy lowers to
_SUMS = (aten.sum.default, aten.sum.dim_IntList)
_MEANS = (aten.mean.default, aten.mean.dim)
# ops that pass a reduced value on unchanged up to a constant factor
_LINEAR_UNARY = (aten.neg.default, aten.clone.default, aten.alias.default, aten.detach.default,
                 aten._to_copy.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
                 aten.expand.default, torch.ops.prims.convert_element_type.default, operator.getitem,
                 aten.select.int, aten.slice.Tensor, aten.permute.default, aten.t.default, aten.transpose.int) \
    + _SUMS + _MEANS
_ADDS = (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Tensor, aten.rsub.Scalar)
_STACKS = (aten.stack.default, aten.cat.default)  # several terms in one tensor (``torch.stack(losses).sum()``)
_SCALES = (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar)
# ops that keep the batch dimension but mix samples along the dimension named by their argument
_MIXING_DIM = {aten._softmax.default: 1, aten._log_softmax.default: 1, aten.cumsum.default: 1,
               aten.cumprod.default: 1, aten.logcumsumexp.default: 1, aten.cummax.default: 1,
               aten.cummin.default: 1, aten.sort.default: 1, aten.sort.stable: 2, aten.roll.default: 2,
               aten.flip.default: 1}
# of those, the ones whose integer results still relate samples (a token's place in its expert's queue,
# ``one_hot(route).cumsum(0)``); an integer sort or flip over the batch only permutes it (dispatch by expert)
_COUNTING = (aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default)


@dataclass
class _Facts:
    """What the walk knows of one forward node."""

    batched: bool  # a tensor output holds the batch dimension
    data: bool  # computed from the batch's samples (a batched input's values)
    reduced: bool  # computed from the samples with a float output that lost the batch dimension
    known: bool = True  # known before the step runs: computed from inputs, buffers and sizes only
    form: str | None = None  # for a reduced value on the way to the loss: how it adds up over pieces
    items: tuple[fx.Node, ...] = ()  # an item mean (times constants) over these: nll nodes, masked-mean counts


@dataclass(frozen=True)
class BatchTerms:
    """What the walk found: the first op that keeps the step from adding up over pieces of the batch (a
    sentence naming the op, the user's line and the rule), and how the loss adds up (``MEAN``, ``SUM``,
    ``ITEMS``; None where it does not or cannot be told)."""

    problem: str | None
    form: str | None
    items: tuple[str, ...] = ()  # the loss is a mean over items, of these nll nodes and masked-mean counts


_SEEN: weakref.WeakKeyDictionary[fx.GraphModule, BatchTerms] = weakref.WeakKeyDictionary()


def batch_terms(joint: JointGraph) -> BatchTerms:
    """Walk ``joint``'s forward for the rules above, once per joint graph (nothing to tell with a static
    batch size)."""
    if joint.gm not in _SEEN:
        _SEEN[joint.gm] = _walk(joint) if joint.batch_symbols else BatchTerms(None, None)
    return _SEEN[joint.gm]


def _walk(joint: JointGraph) -> BatchTerms:
    symbols = joint.batch_symbols
    facts: dict[fx.Node, _Facts] = {}
    loss = next(n for n in joint.gm.graph.nodes if n.name == joint.loss)
    on_loss_path = ancestors([loss])
    problem: str | None = None
    by_value = {s.value: s for s in reversed(joint.inputs)}  # the first of a value, as joint.spec
    specs = {name: by_value[v] for name, v in joint.value_of.items() if v in by_value}  # placeholder -> spec
    for node in _forward(joint):
        f = facts[node] = _facts(node, specs, facts, symbols)
        found = _mixes(node, f, facts, symbols)
        if found is None and node in on_loss_path and f.data:
            found = _term(node, f, facts, symbols)
        if found is not None and problem is None:
            problem = f"{describe_op(node, None)}, {found}"
    last = facts.get(loss)
    return BatchTerms(problem, last.form if last else None, tuple(n.name for n in last.items) if last else ())


def batch_problem(joint: JointGraph) -> str | None:
    """The first op of ``joint``'s forward that keeps its step from adding up over pieces of the batch;
    None when the step adds up (or the batch size is static)."""
    return batch_terms(joint).problem


def ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    """``roots`` and every node they are computed from."""
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _forward(joint: JointGraph) -> Iterator[fx.Node]:
    """The joint graph's nodes that do not depend on a tangent, in order."""
    backward: set[fx.Node] = set()
    for node in joint.gm.graph.nodes:
        tangent = node.op == "placeholder" and node.name.startswith("tangents")
        if tangent or any(a in backward for a in node.all_input_nodes):
            backward.add(node)
        elif node.op in ("placeholder", "call_function", "get_attr"):
            yield node


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _tensors(v)]
    return []


def _facts(node: fx.Node, specs: dict[str, InputSpec], facts: dict[fx.Node, _Facts], symbols: frozenset[Any]) -> _Facts:
    tensors = _tensors(node.meta.get("val"))
    batched = any(any(_carries(s, symbols) for s in t.shape) for t in tensors)
    if node.op in ("placeholder", "get_attr"):
        spec = specs.get(node.name)
        return _Facts(batched, bool(spec is not None and spec.kind == INPUT and spec.batched), False,
                      spec is not None and spec.kind in (INPUT, BUFFER, SYM))
    inputs = [facts[a] for a in node.all_input_nodes if a in facts]
    if _a_size(node.meta.get("val")):  # a shape read off a value (an upsampled height): no sample values in it
        return _Facts(False, False, False)
    data = any(f.data for f in inputs)
    reduced = data and any(t.is_floating_point() and not any(_carries(s, symbols) for s in t.shape)
                           and 0 not in [s for s in t.shape if isinstance(s, int)] for t in tensors)
    return _Facts(batched, data, reduced, all(f.known for f in inputs))


def _a_size(val: Any) -> bool:
    """Whether a node's value is a size known before the step runs: an int or a size symbol with a hint (not
    an unbacked one, which a count of selected samples gives)."""
    if isinstance(val, bool) or not isinstance(val, (int, torch.SymInt)):
        return False
    return not (isinstance(val, torch.SymInt) and free_unbacked_symbols(val))


def _carries(size: Any, symbols: frozenset[Any]) -> bool:
    """Whether a dimension holds samples: the batch, or a selection of its samples by value (boolean
    indexing, ``nonzero``: a size known only when the step runs), which each piece makes of its own."""
    return has_batch(size, symbols) or (isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size)))


def _mixes(node: fx.Node, f: _Facts, facts: dict[fx.Node, _Facts], symbols: frozenset[Any]) -> str | None:
    """Rule 1: a batched float value computed from a statistic of the batch, or mixed along it; or the
    samples' values counted along it (an expert's capacity)."""
    if not f.batched:
        return None
    if not any(t.is_floating_point() for t in _tensors(node.meta.get("val"))):
        if f.data and node.target in _COUNTING and _mixing_dim_is_batch(node, symbols):
            return ("it counts along the batch dimension by the samples' values (e.g. a token's place in its "
                    "expert's queue for a capacity, `one_hot(route).cumsum(0)`): each piece would count its own")
        return None
    if f.reduced and node.target not in _LOSSES:
        return ("it computes per-sample values together with a statistic over the batch's samples (as "
                "BatchNorm does in training)")
    if node.target is not operator.getitem and any(facts[a].reduced for a in node.all_input_nodes if a in facts):
        return "it combines per-sample values with a statistic over the batch's samples (e.g. `x - x.mean(0)`)"
    if node.target in _MIXING_DIM and _mixing_dim_is_batch(node, symbols):
        return "it mixes samples along the batch dimension (e.g. a softmax or a cumulative sum over it)"
    return None


def _mixing_dim_is_batch(node: fx.Node, symbols: frozenset[Any]) -> bool:
    src = node.args[0]
    val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return False
    k = _MIXING_DIM[node.target]
    dims = node.args[k] if len(node.args) > k else (-1 if node.target in (aten.sort.default, aten.sort.stable) else 0)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return any(has_batch(val.shape[d % val.dim()], symbols) for d in dims)


def _term(node: fx.Node, f: _Facts, facts: dict[fx.Node, _Facts], symbols: frozenset[Any]) -> str | None:
    """Rules 2 and 3 for a value computed from the samples on the way to the loss: set its ``form``, or
    say why it does not add up over pieces of the batch."""
    if f.batched or not _tensors(node.meta.get("val")):
        return None
    data_in = [a for a in node.all_input_nodes if a in facts and facts[a].data]
    if all(facts[a].batched for a in data_in):
        f.form = _reduction_form(node)
        f.items = (node,) if f.form == ITEMS else ()
        if f.form == ITEMS and not _labels_known(node, facts):
            return ("the loss is a mean over labels that the model's own outputs choose (a target indexed by, or "
                    "set to ignore_index by, a prediction): each piece would average over its own labels, whose "
                    "count is not known before the step. Average over the samples instead, "
                    "`(F.cross_entropy(o, t, reduction=\"none\") * keep).sum() / len(t)`")
        if f.form == MEAN and any(_selected(a) for a in data_in):
            return ("the loss averages samples selected by their values (`x[mask].mean()`, a mean-reduced loss "
                    "of `pred[mask]`): each piece would average its own selection. Write it as a masked mean, "
                    "`(x * mask).sum() / mask.sum()`, which piper weighs by each piece's count")
        return None if f.form is not None else (
            "the loss takes a statistic of the batch that is not a sum or a mean over its samples (a variance, "
            "maximum, norm or top-k over the batch), which is not the weighted sum of its pieces' values")
    if any(facts[a].batched for a in data_in):
        return "it combines per-sample values with a statistic over the batch's samples"
    if node.target in _LINEAR_UNARY and len(data_in) == 1:
        f.form, f.items = facts[data_in[0]].form, facts[data_in[0]].items
        return None
    if node.target in _ADDS or node.target in _STACKS:
        return _add(node, f, data_in, facts)
    if node.target in _SCALES and sum(a in data_in for a in node.args[:2]) == 1:  # not ``x * x``
        return _scale(node, f, data_in[0], facts, symbols)
    if node.target is aten.div.Tensor:
        return _ratio(node, f, facts)
    return ("the loss applies a non-linear function to a sum or mean over the batch (a product of two such "
            "values, a power, a square root), which is not the weighted sum of its pieces' values")


def _add(node: fx.Node, f: _Facts, data_in: list[fx.Node], facts: dict[fx.Node, _Facts]) -> str | None:
    """A sum of terms. Means over items stay one (each piece weighs its items' share) where every piece
    counts the same items for each -- checked per call (``capture/items.ItemCount``): label smoothing adds a
    mean over the kept labels to the cross-entropy. A constant term adds up under any weights summing to 1."""
    parts = [facts[a].items for a in data_in]
    if all(parts):
        f.form, f.items = ITEMS, tuple(dict.fromkeys(n for part in parts for n in part))
        return None
    if any(n.target not in _LOSSES for part in parts for n in part):
        return ("the loss adds other terms to a sum divided by a count taken from the batch (a masked mean "
                "written by hand): one weight per piece cannot weigh both as the global batch would")
    operands = list(node.args[0]) if node.target in _STACKS else list(node.args[:2])
    constant = sum(isinstance(a, fx.Node) and a in facts and facts[a].data for a in operands) < len(operands)
    forms = {facts[a].form for a in data_in} | ({CONST} if constant else set())
    f.form, problem = _combine(forms)
    return problem


def _ratio(node: fx.Node, f: _Facts, facts: dict[fx.Node, _Facts]) -> str | None:
    """``sum / count`` with the count a sum known before the step (``(loss * mask).sum() / mask.sum()``): a
    mean over items, each piece weighed by its count's share (``capture/items.py``)."""
    num, den = node.args[0], node.args[1]
    if isinstance(num, fx.Node) and isinstance(den, fx.Node) and facts[num].form == SUM and \
            facts[den].form == SUM and facts[den].known and not facts[num].items:
        f.form, f.items = ITEMS, (den,)
        return None
    return ("the loss divides a sum over the batch by a value computed from the batch that is not a count "
            "known before the step (a sum of inputs, as in `(loss * mask).sum() / mask.sum()`), which is not the "
            "weighted sum of its pieces' values")


def _labels_known(nll: fx.Node, facts: dict[fx.Node, _Facts]) -> bool:
    """Whether a cross-entropy's target and class weights come from inputs, buffers and sizes only: then
    each piece's label count is replayed before the step (``capture/items.py``)."""
    return all(facts[a].known for a in nll.args[1:3] if isinstance(a, fx.Node) and a in facts)


def _selected(node: fx.Node) -> bool:
    """Whether ``node``'s value has a size known only when the step runs (a selection by value)."""
    return any(isinstance(s, torch.SymInt) and free_unbacked_symbols(s)
               for t in _tensors(node.meta.get("val")) for s in t.shape)


def _reduction_form(node: fx.Node) -> str | None:
    """How a reduction of batched values adds up over pieces; None when it does not."""
    if node.target in _SUMS:
        return SUM
    if node.target in _MEANS:
        return MEAN
    if node.target in _LOSSES:
        k = _LOSSES[node.target]
        reduction = node.args[k] if len(node.args) > k else node.kwargs.get("reduction", _MEAN_REDUCTION)
        if reduction == _SUM_REDUCTION:
            return SUM
        return ITEMS if node.target in NLL else MEAN
    return None


def _combine(forms: set[str | None]) -> tuple[str | None, str | None]:
    """The form of a sum of terms, or why its terms cannot be weighed alike."""
    kinds = forms - {CONST}
    if SUM in kinds and len(forms) > 1:
        others = " and ".join(sorted(f for f in forms if f and f != SUM))
        return None, (f"the loss adds {SUM} and {others}: one weight per piece cannot weigh both terms as the "
                      "global batch would (a sum adds up unweighted, so the other term would count once per "
                      "piece); use one reduction for every term")
    if ITEMS in kinds:
        return ITEMS, None  # with other means: weighed by samples, with a warning (capture/items.py)
    return (next(iter(kinds)) if kinds else CONST), None


def _scale(node: fx.Node, f: _Facts, term: fx.Node, facts: dict[fx.Node, _Facts],
           symbols: frozenset[Any]) -> str | None:
    """A term times or divided by a factor that does not come from the samples (a number, a parameter, a
    size): the term's form, turned from a sum into a mean by dividing by the batch size and back."""
    divide = node.target in (aten.div.Tensor, aten.div.Scalar)
    if divide and node.args[0] is not term:
        return ("the loss divides by a sum or mean over the batch, which is not the weighted sum of its "
                "pieces' values")
    factor = node.args[1] if node.args[0] is term else node.args[0]
    size = factor.meta.get("val") if isinstance(factor, fx.Node) else factor
    form = facts[term].form
    if not (isinstance(size, torch.SymInt) and has_batch(size, symbols)):
        f.form, f.items = form, facts[term].items
    elif form == SUM and divide:
        f.form = MEAN  # ``x.sum() / x.shape[0]``
    elif form == MEAN and not divide:
        f.form = SUM
    else:
        return "the loss scales a term by the batch size in a way that is not a sum or a mean over the batch"
    return None
