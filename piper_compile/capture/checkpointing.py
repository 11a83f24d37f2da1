"""Activation checkpointing (the ``checkpoint`` directive): which forward values of the matched regions
the backward recomputes instead of keeping them from the forward, and which backward piece recomputes
each one.

The rule, per matched region (a pipeline stage, a tagged block):

* **Never recomputed** (kept, as without checkpointing): the region's inputs (values of other regions,
  the batch), parameters, boundary ops (expert all-to-alls and expert compute, tensor-parallel
  collectives: their segment is communication, run once), random ops (their outputs and masks are kept;
  dropout's output is rebuilt from its input and the kept mask, see ``remat.Replay``, so the backward
  sees bitwise the forward's mask), mutating ops, gradients, the loss, and values a backward outside the
  region (or a boundary op's backward) reads.
* **Kept by the policy**: ``full`` keeps nothing else; ``selective`` keeps matmul and attention outputs
  (``SELECTIVE_SAVE``, torchtitan's op-level rule); ``save`` keeps the outputs of the named aten ops;
  ``budget_mb`` starts from ``full`` and keeps, dearest to recompute per byte first
  (FLOPs + ``FLOPS_PER_BYTE`` x bytes written), what fits the budget: the activations the directive's
  regions on one stage keep, each region's per micro-batch times its micro-batches in flight at once
  (its rank's ``order``: 1F1B's stage s holds p - s; all of them without an order).
* Everything else the backward reads is recomputed from what is kept.

A region no directive matches whose forward calls ``torch.utils.checkpoint`` (the user's own, or Hugging
Face's ``gradient_checkpointing_enable()``) is checkpointed as that call asked: the values AOTAutograd's
joint graph tags ``PREFER_RECOMPUTE`` / ``MUST_RECOMPUTE`` are recomputed (with the cheap ones remat
recomputes anyway, ``capture/remat.py``), every other value is kept (``UserCheckpoint``); a directive
matching the region takes its place.

Each recomputed activation runs once per micro-batch: in the first backward piece of its region that
needs it (BI before BW for a split backward, bucket chunks in order), which hands it to later pieces
(``owners``). Under ZeRO-3 a piece gathers only the buckets it reads: a value whose recomputation would
read a parameter its piece does not gather is kept instead (``demote_zero3``).
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import fx

from piper_compile.capture.joint import JointGraph
from piper_compile.capture.remat import BACKWARD_PASSES, Replay, aliases_input, hint_bytes, op_name
from piper_compile.directives.spec import ActivationWindow, Checkpoint

try:
    from torch.utils.checkpoint import CheckpointPolicy
    _RECOMPUTE_TAGS: frozenset[Any] = frozenset({CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE})
except ImportError:  # pragma: no cover - torch without selective checkpointing
    _RECOMPUTE_TAGS = frozenset()

SELECTIVE_SAVE = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
})
FLOPS_PER_BYTE = 64  # the budget's recompute cost of one byte written (about a GPU's FLOP:byte balance)
Key = Any  # a piece key: (pass, region, chunk)


@dataclass(frozen=True)
class UserCheckpoint(Checkpoint):
    """The policy of a region whose forward called ``torch.utils.checkpoint`` and that no directive
    matches: recompute ``nodes`` (what the call tagged, and remat's cheap values), keep the rest."""

    policy: str = "tagged"
    nodes: frozenset[str] = frozenset()


def user_tagged(joint: JointGraph, passes: dict[str, str]) -> set[str]:
    """Forward nodes ``torch.utils.checkpoint`` tagged for recomputation (AOTAutograd's ``recompute`` meta)."""
    return {n.name for n in joint.gm.graph.nodes if passes.get(n.name) == "F"
            and n.meta.get("recompute") in _RECOMPUTE_TAGS}


def with_user_checkpoints(joint: JointGraph, region: dict[str, Any], passes: dict[str, str], cheap: Iterable[str],
                          policy_of: Callable[[Any], Checkpoint | None] | None
                          ) -> Callable[[Any], Checkpoint | None] | None:
    """``policy_of`` (a region's checkpoint directive), extended to the regions with values the user's own
    ``torch.utils.checkpoint`` calls tagged that no directive matches (``UserCheckpoint``)."""
    tagged = user_tagged(joint, passes)
    if not tagged:
        return policy_of
    user = UserCheckpoint(nodes=frozenset(tagged | set(cheap)))
    regions = {region.get(v) for v in tagged}

    def of(reg: Any) -> Checkpoint | None:
        d = policy_of(reg) if policy_of is not None else None
        return d if d is not None else user if reg in regions else None
    return of


@dataclass
class CheckpointPlan:
    """The recomputed forward values of the checkpointed regions and how dropout outputs are rebuilt."""

    nodes: set[str] = field(default_factory=set)
    replay: dict[str, Replay] = field(default_factory=dict)
    kept_bytes: dict[Any, int] = field(default_factory=dict)  # region -> activations kept per micro-batch

    def handover(self, joint: JointGraph) -> frozenset[str]:
        """The recomputed values one piece may hand to another: tensors (a tuple never crosses segments)."""
        nodes = {n.name: n for n in joint.gm.graph.nodes}
        return frozenset(v for v in self.nodes if isinstance(nodes[v].meta.get("val"), torch.Tensor))


@dataclass
class _Region:
    """One checkpointed region's forward nodes and what may be recomputed in them."""

    joint: JointGraph
    region: dict[str, Any]
    passes: dict[str, str]
    derived: set[str]
    boundary: Callable[[fx.Node], Any]
    reg: Any
    mb_count: int
    inflight: int = 1  # micro-batches whose kept activations of this region are alive at once

    def forward(self, n: fx.Node) -> bool:
        return n.op == "call_function" and self.passes.get(n.name) == "F" and self.region.get(n.name) == self.reg \
            and n.name not in self.derived

    def nodes(self) -> list[fx.Node]:
        return [n for n in self.joint.gm.graph.nodes if self.forward(n)]

    def eligible(self, n: fx.Node) -> bool:
        """May ``n`` run again in the backward at all (policy aside)?"""
        if n.target is operator.getitem:
            src = n.args[0]
            return isinstance(src, fx.Node) and self.forward(src) and self.eligible(src) and self._local(n)
        schema = getattr(n.target, "_schema", None)
        if self.boundary(n) or schema is None or schema.is_mutable:
            return False
        if random_op(n):
            return False
        return n.name not in self.joint.grad_of and n.name != self.joint.loss and self._local(n)

    def _local(self, n: fx.Node) -> bool:
        """Every backward reader of ``n`` is in its region and is not a boundary op."""
        return all(self.region.get(u.name) == self.reg and not self.boundary(u)
                   for u in n.users if self.passes.get(u.name) in BACKWARD_PASSES)

    def replay(self, n: fx.Node) -> Replay | None:
        """``n`` is dropout's output and its mask is kept: rebuilt from them (never drawn again)."""
        src = n.args[0] if n.target is operator.getitem else None
        if not isinstance(src, fx.Node) or op_name(src) != "native_dropout" or n.args[1] != 0 or not self._local(n):
            return None
        p, train = (list(src.args) + [None, None])[1:3]
        mask = next((u for u in src.users if u.target is operator.getitem and u.args[1] == 1), None)
        if mask is None or train is False or not isinstance(p, float) or not 0.0 < p < 1.0:
            return None
        x = src.args[0]
        return Replay(x.name, mask.name, 1.0 / (1.0 - p)) if isinstance(x, fx.Node) else None


def random_op(n: fx.Node) -> bool:
    """Whether ``n`` draws random numbers: a seeded op, except attention run with ``dropout_p`` = 0."""
    if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
        return False
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = n.kwargs.get("dropout_p", n.args[i] if i < len(n.args) else schema.arguments[i].default_value)
    return p != 0.0


def _saved_by_policy(d: Checkpoint, n: fx.Node) -> bool:
    if isinstance(d, UserCheckpoint):
        src = n.args[0] if n.target is operator.getitem else None
        return n.name not in d.nodes and not (isinstance(src, fx.Node) and src.name in d.nodes)
    name = op_name(n.args[0]) if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else op_name(n)
    if d.policy == "selective":
        return name in SELECTIVE_SAVE
    if d.policy == "save":
        return name in d.save
    return False


def plan_checkpoint(joint: JointGraph, region: dict[str, Any], passes: dict[str, str], derived: set[str],
                    boundary: Callable[[fx.Node], Any], policy_of: Callable[[Any], Checkpoint | None],
                    window: ActivationWindow, keep: frozenset[str] = frozenset()) -> CheckpointPlan:
    """The recomputed values of every region ``policy_of`` gives a checkpoint directive for (never those in
    ``keep``). ``budget_mb`` regions are fitted together per directive and stage (``window.stage``)."""
    plan = CheckpointPlan()
    regions = _checkpointed(joint, region, passes, policy_of)
    seen_ops: set[str] = set()
    budgeted: dict[tuple[int, Any], list[_Choice]] = {}
    for reg, d in regions.items():
        r = _Region(joint, region, passes, derived, boundary, reg, window.microbatches, window.inflight(dict(reg)))
        nodes = r.nodes()
        seen_ops.update(op_name(n) for n in nodes)
        replay = {n.name: rp for n in nodes if (rp := r.replay(n)) is not None}
        recompute = {n.name for n in nodes if (r.eligible(n) or n.name in replay) and not _saved_by_policy(d, n)
                     and n.name not in keep}
        recompute -= {n.name for n in nodes if n.target is operator.getitem and n.name not in replay
                      and n.args[0].name not in recompute}  # a part of a kept tuple is kept
        choice = _Choice(r, nodes, recompute, replay)
        if d.policy == "budget":
            budgeted.setdefault((d.index, window.stage(dict(reg))), []).append(choice)
        else:
            choice.commit(plan)
    for (_, stage), choices in budgeted.items():
        _fit_budget(regions[choices[0].r.reg], stage, choices)
        for choice in choices:
            choice.commit(plan)
    _check_save_names(regions.values(), seen_ops)
    return plan


def _checkpointed(joint: JointGraph, region: dict[str, Any], passes: dict[str, str],
                  policy_of: Callable[[Any], Checkpoint | None]) -> dict[Any, Checkpoint]:
    """The forward regions a checkpoint directive matches, in graph order, with it."""
    regions: dict[Any, Checkpoint] = {}
    for n in joint.gm.graph.nodes:
        reg = region.get(n.name)
        if reg is not None and reg not in regions and passes.get(n.name) == "F":
            d = policy_of(reg)
            if d is not None:
                regions[reg] = d
    if len({region.get(n.name) for n in joint.gm.graph.nodes if passes.get(n.name) == "F"}) == 1:
        for d in regions.values():
            if not isinstance(d, UserCheckpoint):  # the user's calls cut the forward themselves
                _warn_whole_forward(d)
    return regions


@dataclass
class _Choice:
    """What one region recomputes (and replays) as the policy is applied."""

    r: _Region
    nodes: list[fx.Node]
    recompute: set[str]
    replay: dict[str, Replay]

    def kept(self, recompute: set[str] | None = None) -> int:
        """Bytes kept for the backward while the region's micro-batches in flight are alive."""
        rec = self.recompute if recompute is None else recompute
        return _kept_bytes(self.r, rec, {k: v for k, v in self.replay.items() if k in rec}) * self.r.inflight

    def commit(self, plan: CheckpointPlan) -> None:
        replay = {k: v for k, v in self.replay.items() if k in self.recompute}
        plan.nodes |= self.recompute
        plan.replay.update(replay)
        plan.kept_bytes[self.r.reg] = _kept_bytes(self.r, self.recompute, replay)


def _warn_whole_forward(d: Checkpoint) -> None:
    warnings.warn(f"piper: checkpoint directive #{d.index} matches the only region, the whole forward: its "
                  "backward recomputes the whole forward before it starts, so every activation is live again at once "
                  "and the peak hardly drops. Checkpoint per block: tag each block (piper.annotate(block, AC=i)) and "
                  'use piper.checkpoint({"AC": "*"}, ...)', stacklevel=2)


def _check_save_names(directives: Iterable[Checkpoint], seen_ops: set[str]) -> None:
    for d in directives:
        unknown = [s for s in d.save if s not in seen_ops]
        if unknown:
            raise d.error(f"policy 'save' names op(s) {unknown} that no forward op of the matched regions is",
                          f"use aten op names the regions run, e.g. {sorted(o for o in seen_ops if o)[:12]}")


def _kept_bytes(r: _Region, recompute: set[str], replay: dict[str, Replay]) -> int:
    """Activation bytes the region keeps for its backward per micro-batch when ``recompute`` is recomputed:
    the storages of the non-recomputed tensors its backward (or a recomputation) reads."""
    kept: dict[fx.Node, int] = {}
    stack = [a for n in r.joint.gm.graph.nodes if r.passes.get(n.name) in BACKWARD_PASSES
             and r.region.get(n.name) == r.reg for a in n.all_input_nodes if r.passes.get(a.name) == "F"]
    seen: set[fx.Node] = set()
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if a.name in replay:
            stack.extend(replay_inputs(a, replay[a.name]))
        elif a.name in recompute:
            stack.extend(a.all_input_nodes)
        elif a.op == "call_function" and a.name not in r.derived:
            root = _root(a)
            kept[root] = hint_bytes(root)
    return sum(kept.values()) // max(r.mb_count, 1)


def _root(n: fx.Node) -> fx.Node:
    """The node whose storage ``n`` is (a view of)."""
    while aliases_input(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _fit_budget(d: Checkpoint, stage: Any, choices: list[_Choice]) -> None:
    """``budget_mb``: from ``full``, keep the values dearest to recompute per byte, over all of the
    directive's regions on one stage, while their kept activations -- each region's per micro-batch times
    its micro-batches in flight -- stay within the budget."""
    from piper_compile.sim.cost import node_bytes, node_flops  # the one home of FLOP counting

    budget = float(d.budget_mb or 0) * 2 ** 20
    kept = [c.kept() for c in choices]
    if sum(kept) > budget:
        where = f"on devices {list(stage)}" if stage is not None else "of the step"
        raise d.error(f"the checkpointed regions {[dict(c.r.reg) for c in choices]} {where} keep "
                      f"{sum(kept) / 2 ** 20:.3g} MB of activations (per micro-batch times the "
                      f"{max(c.r.inflight for c in choices)} in flight at most) even when everything else is "
                      f"recomputed (their inputs, random masks, values other regions read), above "
                      f"budget_mb={d.budget_mb}", "raise budget_mb, or split the batch into more micro-batches")
    syms = _hints(choices[0].r.joint)

    def dearness(n: fx.Node) -> float:
        return (node_flops(n, syms) + FLOPS_PER_BYTE * node_bytes(n, syms)) / max(hint_bytes(n), 1)

    candidates = sorted(((dearness(n), i, n) for i, c in enumerate(choices) for n in c.nodes
                         if n.name in c.recompute and not aliases_input(n) and n.target is not operator.getitem
                         and hint_bytes(n) > 0), key=lambda t: t[0], reverse=True)
    for _, i, n in candidates:
        c = choices[i]
        trial = c.recompute - {n.name} - {u.name for u in n.users if u.target is operator.getitem}
        after = c.kept(trial)
        if sum(kept) - kept[i] + after <= budget:
            c.recompute, kept[i] = trial, after


def replay_inputs(n: fx.Node, rp: Replay) -> list[fx.Node]:
    """The input and the kept mask a replayed dropout output is rebuilt from."""
    src = n.args[0]
    assert isinstance(src, fx.Node)
    return [a for a in src.all_input_nodes if a.name == rp.x] + [u for u in src.users if u.name == rp.mask]


def _hints(joint: JointGraph) -> dict[str, int]:
    """The capture-time value of every size symbol of the graph (its batch and sequence sizes)."""
    out: dict[str, int] = {}
    for n in joint.gm.graph.find_nodes(op="placeholder"):
        val = n.meta.get("val")
        dims = [val] if isinstance(val, torch.SymInt) else list(val.shape) if isinstance(val, torch.Tensor) else []
        for d in dims:
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol and d.node.hint is not None:
                out[str(d.node.expr)] = int(d.node.hint)
    return out


def owners(pieces: dict[Key, list[fx.Node]], recompute: set[str], handover: frozenset[str],
           position: dict[str, int], replay: dict[str, Replay]) -> tuple[dict[str, Key], dict[Key, set[str]]]:
    """(handover value -> the piece that recomputes it, piece -> every recomputed value it computes).
    Pieces of a region go in order, BI (or B) before BW, then by graph position; a piece recomputes what
    it needs and no earlier piece recomputed, and receives the rest."""
    def rank(key: Key) -> tuple[int, int]:
        nodes = pieces[key]
        return (1 if key[0] == "BW" else 0, position[nodes[0].name] if nodes else -1)

    owner: dict[str, Key] = {}
    computes: dict[Key, set[str]] = {}
    for key in sorted((k for k in pieces if k[0] in BACKWARD_PASSES), key=rank):
        members = {n.name for n in pieces[key]}
        mine: set[str] = set()
        stack = [a for n in pieces[key] for a in n.all_input_nodes if a.name not in members]
        while stack:
            a = stack.pop()
            if a.name not in recompute or a.name in mine or (a.name in handover and a.name in owner):
                continue
            mine.add(a.name)
            if a.name in handover:
                owner[a.name] = key
            elif a.name in recompute:  # a tuple: this piece also hands on its parts a later piece needs
                for u in a.users:
                    if u.name in handover and u.name not in owner and u.target is operator.getitem:
                        owner[u.name] = key
                        mine.add(u.name)
            stack.extend(replay_inputs(a, replay[a.name]) if a.name in replay else a.all_input_nodes)
        computes[key] = mine
    return owner, computes


def demote_zero3(computes: dict[Key, set[str]], nodes: dict[str, fx.Node], params_of: Callable[[fx.Node], list[str]],
                 bucket_of: dict[str, Any], piece_buckets: Callable[[Key], set[Any]],
                 zero3: Callable[[Any], bool]) -> set[str]:
    """Recomputed values whose recomputation reads a parameter of a bucket its piece does not gather
    (ZeRO-3 regions only): they are kept instead."""
    bad: set[str] = set()
    for key, names in computes.items():
        if not zero3(key[1]):
            continue
        have = piece_buckets(key)
        bad.update(v for v in names if any(bucket_of.get(p) not in have for p in params_of(nodes[v])))
    return bad
