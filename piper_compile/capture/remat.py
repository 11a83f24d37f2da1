"""Activation rematerialization: forward values the backward reads that are cheap to recompute from
values the backward keeps anyway are recomputed inside the backward segment instead of being kept
alive from the forward to the backward.

Typical wins in a transformer block (fp32, per token): the GELU/SiLU output that the next linear's
weight gradient reads (recomputed from the pre-activation, which the activation's own backward keeps),
the contiguous copy of the attention output before the output projection (recomputed from the
attention output, which the attention backward keeps) and layer-norm outputs (recomputed from the
norm's input, mean and rstd, which its backward keeps). torch.compile's min-cut partitioner does the
same for a single graph; piper cuts the joint graph into many segments itself, so it decides here.

The rule never increases what is kept: a value is recomputed only when every value its recomputation
reads is (a view of storage) already kept for the backward, a parameter, an input or a size, and only
when that releases a storage nothing else kept shares. Only cheap ops qualify: pointwise ops, views,
copies and layer norm; never random ops, matmuls, attention or piper's boundary ops. The recomputation
stays inside one region (the forward value, its backward readers and everything the recomputation
reads belong to the same region), so no new cross-stage traffic or segment dependency appears.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from piper_compile.capture.joint import JointGraph

BACKWARD_PASSES = ("B", "BI", "BW")
_VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
          "squeeze", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "unflatten", "as_strided"}
_COPIES = {"clone", "_to_copy", "contiguous", "copy"}
_NORMS = {"native_layer_norm"}
MAX_CLOSURE = 12  # nodes recomputed for one kept value at most (chains of views and pointwise ops are short)
MAX_WORK = 2.0  # bytes a recomputation may write per byte of storage it releases (e.g. never a whole
# layer norm again to drop its 4-byte-per-row mean)


@dataclass(frozen=True)
class Replay:
    """Dropout's output rebuilt in the backward from its input and the mask the forward drew and kept:
    ``native_dropout_backward(x, mask, scale)`` is ``x * mask * scale``, bitwise the forward's output
    (the mask is 0 or 1), so no random op ever runs again."""

    x: str
    mask: str
    scale: float


@dataclass(frozen=True)
class RematPlan:
    """Forward nodes that backward segments recompute instead of receiving. A value in ``handover``
    (activation checkpointing) is recomputed once per micro-batch, by the backward piece ``owner`` names
    (the first of its region that needs it, BI before BW), and later pieces receive it from that piece."""

    nodes: frozenset[str]
    released_bytes: int  # kept storage released, at the capture batch size
    handover: frozenset[str] = frozenset()
    owner: dict[str, Any] = field(default_factory=dict)  # handover value -> key of the piece recomputing it
    replay: dict[str, Replay] = field(default_factory=dict)

    def recomputes(self, name: str) -> bool:
        return name in self.nodes

    def received(self, name: str, key: Any) -> bool:
        """Whether piece ``key`` reads checkpointed value ``name`` from the piece that recomputed it."""
        return name in self.handover and self.owner.get(name) != key


HANDOVER_SUFFIX = "~rc"  # value name of a recomputed activation one backward piece hands to another
NO_REMAT = RematPlan(frozenset(), 0)


def op_name(n: fx.Node) -> str:
    """The aten op name of a call node (``mm`` for ``aten.mm.default``), '' for anything else."""
    packet = getattr(n.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") if packet is not None else ""


def aliases_input(n: fx.Node) -> bool:
    """Whether ``n``'s output is a view of its first input's storage (so keeping it keeps that storage)."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and aliases_input(src)
    if op_name(n) == "_unsafe_view":  # a view of a fresh tensor (reshape after clone): same storage
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def _cheap(n: fx.Node) -> bool:
    """Ops whose recomputation costs about one pass over their output."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and _cheap(src)
    tags = getattr(n.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags or getattr(getattr(n.target, "_schema", None), "is_mutable", True):
        return False
    name = op_name(n)
    return torch.Tag.pointwise in tags or name in _VIEWS or name in _COPIES or name in _NORMS


def _val_bytes(val: Any) -> int:
    if isinstance(val, (tuple, list)):  # a multi-output op computes all of its outputs
        return sum(map(_val_bytes, val))
    if not isinstance(val, torch.Tensor):
        return 0
    numel = 1
    for s in val.shape:
        numel *= size_hint(s)
    return numel * val.element_size()


def size_hint(s: Any) -> int:
    """A size at the capture batch: its hint, or for a size known only when the step runs (boolean
    indexing, ``nonzero``) the largest value its range allows below the hints of the capture (else 1)."""
    if not isinstance(s, torch.SymInt):
        return int(s)
    if s.node.hint is not None:
        return int(s.node.hint)
    bound = s.node.shape_env.bound_sympy(s.node.expr).upper
    return int(bound) if bound.is_finite else 1


def hint_bytes(n: fx.Node) -> int:
    """Bytes ``n`` produces, at the capture batch size."""
    return _val_bytes(n.meta.get("val"))


def _work_bytes(nodes: set[fx.Node]) -> int:
    """What recomputing ``nodes`` writes (views and getitems are free)."""
    return sum(hint_bytes(n) for n in nodes if not aliases_input(n) and n.target is not operator.getitem)


class _Planner:
    def __init__(self, joint: JointGraph, region: dict[str, Any], passes: dict[str, str], derived: set[str],
                 param_ok: Callable[[fx.Node, str], bool], boundary: Callable[[fx.Node], Any]) -> None:
        self.joint = joint
        self.region = region
        self.passes = passes
        self.derived = derived
        self.param_ok = param_ok
        self.boundary = boundary
        self._root: dict[fx.Node, fx.Node] = {}

    def root(self, n: fx.Node) -> fx.Node:
        r = self._root.get(n)
        if r is None:
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if n.target is operator.getitem and src is not None and aliases_input(src):
                src = src.args[0] if isinstance(src.args[0], fx.Node) else None
            r = self.root(src) if src is not None and aliases_input(n) else n
            self._root[n] = r
        return r

    def forward(self, n: fx.Node) -> bool:
        return n.op == "call_function" and self.passes.get(n.name) == "F"

    def _free_leaf(self, a: fx.Node, c: fx.Node) -> bool | None:
        """True: recomputing ``c`` may read ``a`` at no memory cost; False: never; None: only if kept."""
        if a.op == "placeholder":
            value = self.joint.value_of.get(a.name, "")
            if value.startswith("param:"):
                return self.param_ok(c, value)
            return value.split(":", 1)[0] in ("input", "buffer", "sym")
        if a.name in self.derived:  # computed from parameters alone (t(W)): recomputed everywhere anyway
            return all(self._free_leaf(p, c) for p in self._derived_params(a))
        if isinstance(a.meta.get("val"), (torch.SymInt, int)):
            return True  # sizes are recomputed from the symbol values
        return None

    def _derived_params(self, a: fx.Node) -> list[fx.Node]:
        out, stack, seen = [], [a], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                out.append(n)
            else:
                stack.extend(n.all_input_nodes)
        return out

    def closure(self, c: fx.Node, kept_roots: Any) -> tuple[list[fx.Node], list[fx.Node]] | None:
        """(nodes to recompute, values read) for ``c``, or None when it cannot be recomputed for free."""
        reg = self.region.get(c.name)
        nodes: list[fx.Node] = []
        leaves: list[fx.Node] = []
        seen: set[fx.Node] = set()

        def visit(n: fx.Node) -> bool:
            if n in seen:
                return True
            seen.add(n)
            if not (self.forward(n) and self.region.get(n.name) == reg and _cheap(n) and not self.boundary(n)):
                return False
            if n.name in self.joint.grad_of or n.name == self.joint.loss or len(nodes) >= MAX_CLOSURE:
                return False
            for a in n.all_input_nodes:
                free = self._free_leaf(a, c)
                if free is False:
                    return False
                if free is True:
                    continue
                if self.forward(a) and self.region.get(a.name) == reg and self.root(a) in kept_roots \
                        and self.root(a) is not self.root(c):
                    if a not in leaves:
                        leaves.append(a)
                    continue
                if not visit(a):
                    return False
            nodes.append(n)
            return True

        return (nodes, leaves) if visit(c) else None

    def plan(self) -> RematPlan:
        graph_nodes = list(self.joint.gm.graph.nodes)
        kept = [n for n in graph_nodes if self.forward(n) and n.name not in self.derived
                and any(self.passes.get(u.name) in BACKWARD_PASSES for u in n.users)]
        by_root: dict[fx.Node, list[fx.Node]] = {}  # kept storage -> the kept values that are (views of) it
        for k in kept:
            by_root.setdefault(self.root(k), []).append(k)
        chosen: set[str] = set()
        released = 0
        changed = True
        while changed:  # a release can make a value read by a later one's recomputation: a second pass
            changed = False
            for r in sorted(by_root, key=hint_bytes, reverse=True):  # largest storage first
                members = by_root.get(r)
                if not members or not self._readers_local(members):
                    continue
                plans = [self.closure(m, by_root.keys() - {r}) for m in members]
                if any(p is None for p in plans):
                    continue
                if _work_bytes({n for nodes, _ in plans for n in nodes}) > MAX_WORK * hint_bytes(r):  # type: ignore[misc]
                    continue
                del by_root[r]
                for nodes, leaves in plans:  # type: ignore[misc]
                    chosen.update(n.name for n in nodes)
                    for a in leaves:  # now read by the backward too: (a view of) storage already kept
                        group = by_root[self.root(a)]
                        if a not in group:
                            group.append(a)
                released += hint_bytes(r)
                changed = True
        return RematPlan(frozenset(chosen), released)

    def _readers_local(self, members: list[fx.Node]) -> bool:
        """Every backward reader of the kept values is in their own region and is not a boundary op (whose
        segment is that one op: a directive replaces it by communication plus local work)."""
        for m in members:
            reg = self.region.get(m.name)
            for u in m.users:
                if self.passes.get(u.name) in BACKWARD_PASSES and (self.region.get(u.name) != reg or self.boundary(u)):
                    return False
        return True


def plan_remat(joint: JointGraph, region: dict[str, Any], passes: dict[str, str], derived: set[str],
               param_ok: Callable[[fx.Node, str], bool], boundary: Callable[[fx.Node], Any]) -> RematPlan:
    """Which forward values the backward segments recompute (see the module docstring).
    ``param_ok(c, param)``: whether recomputing kept value ``c`` in its backward readers may read parameter
    value ``param`` (under ZeRO-3 only a parameter of a bucket those readers' steps gather anyway)."""
    return _Planner(joint, region, passes, derived, param_ok, boundary).plan()
