"""Regions: every node of the joint graph gets the region (tags) and pass (F/B) it runs in.

Region rule for untagged nodes (documented in docs/design.md): an untagged node joins the region of
its *latest-computed* tagged input (so gradient accumulation of a tied weight lands in the region whose
backward runs last); a node with no tagged input joins the region of those of its users that starts first
in the graph (its earliest stage); a graph with no tags at all is one region ``{}``.
"""
from __future__ import annotations

import functools
import operator
import re
from collections import defaultdict
from typing import Any

import torch
from torch import fx

from piper_compile.capture.annotate import AUTO_PREFIX
from piper_compile.capture.joint import JointGraph
from piper_compile.errors import PiperCaptureError

Region = tuple[tuple[str, Any], ...]
RESERVED_TAGS = {"PASS", "MB"}
BlockKey = tuple[str, str]  # (module path of a repeated block, its class); ("", "") outside any block
_INDEXED = re.compile(r"(?:\.|\[)'?\d+'?\]?\)?$")  # blocks.3, blocks[3], getattr(L['self'].blocks, '3')


class RegionCycleError(PiperCaptureError):
    """Segments of regions depend on each other in a cycle (no stage order can run them)."""


def block_of(node: fx.Node) -> BlockKey | None:
    """The outermost indexed module (``blocks.3``) ``node`` came from, with its class; ``("", "")`` for a
    node of the model outside any block; None when the node records no module."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    for path, cls in stack.values():  # outermost first
        if _INDEXED.search(str(path)):
            return str(path), getattr(cls, "__qualname__", str(cls))
    return "", ""


def region_label(region: Region) -> str:
    return "".join(f"{k}{v}" for k, v in region)


def boundary_kind(node: fx.Node) -> str | None:
    """Ops that get a segment of their own, so a directive can replace them by communication plus local
    compute: the experts of :class:`piper_compile.nn.MoE` (``shard`` makes them expert parallel) and the
    tensor/sequence-parallel markers of :mod:`piper_compile.nn.tp` (``shard_tensor``)."""
    if node.op != "call_function":
        return None
    return _boundary_ops().get(node.target)  # type: ignore[arg-type]


@functools.cache
def _boundary_ops() -> dict[Any, str]:
    """The boundary ops by target (read for every node of every cut: built once)."""
    from piper_compile.nn.moe import BACKWARD_OP, FORWARD_OP
    from piper_compile.nn import tp

    return {FORWARD_OP: "moe_fwd", BACKWARD_OP: "moe_bwd", tp.ALLREDUCE_OP: "tp_allreduce",
            tp.ALL_GATHER_OP: "tp_all_gather", tp.REDUCE_SCATTER_OP: "tp_reduce_scatter",
            tp.GATHER_OP: "tp_gather", tp.SCATTER_OP: "tp_scatter"}


def _tags(node: fx.Node) -> dict[str, Any]:
    custom = node.meta.get("custom") or {}
    return {k: v for k, v in custom.items() if isinstance(k, str) and isinstance(v, (int, str))}


def _renumber_auto(nodes: list[fx.Node]) -> dict[str, dict[str, Any]]:
    """Map raw ``auto:N`` tag values to 0, 1, ... by first appearance; return per-node tags."""
    per_node: dict[str, dict[str, Any]] = {}
    auto_map: dict[str, dict[str, int]] = defaultdict(dict)
    explicit: dict[str, set[Any]] = defaultdict(set)
    for n in nodes:
        tags = _tags(n)
        for k, v in tags.items():
            if k in RESERVED_TAGS:
                raise PiperCaptureError(f"piper: tag {k!r} is reserved by piper (used by directives); "
                                        f"rename the annotation at {n.name}")
            if isinstance(v, str) and v.startswith(AUTO_PREFIX):
                tags[k] = auto_map[k].setdefault(v, len(auto_map[k]))
            else:
                explicit[k].add(v)
        per_node[n.name] = tags
    for k in auto_map:
        if explicit.get(k):
            raise PiperCaptureError(f"piper: tag {k!r} is used both auto-indexed (annotate({k!r})) and with explicit "
                                    f"indices {sorted(map(str, explicit[k]))}; use one style per tag")
    return per_node


def assign_regions(gm: fx.GraphModule, defer_forward_only: bool = False) -> tuple[dict[str, Region], dict[str, str]]:
    """Region and pass (F/B) of every compute node of the joint graph. ``defer_forward_only``: untagged
    backward nodes computed from forward values alone join their first tagged user instead (the
    fallback when the default rule makes two backward regions a cycle)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    tags = _renumber_auto(nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    grad_seeds = {n.name for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")}
    passes = _passes(nodes, grad_seeds)
    if not any(tags.values()):
        return {n.name: () for n in nodes}, passes
    region: dict[str, Region] = {}
    pending: list[fx.Node] = []
    fwd_only: set[str] = set()  # backward nodes computed from forward values alone
    for n in nodes:
        if tags[n.name]:
            region[n.name] = tuple(sorted(tags[n.name].items()))
            continue
        if defer_forward_only and passes[n.name] == "B" and not any(
                (passes.get(a.name) == "B" and a.name not in fwd_only) or a.name in grad_seeds for a in n.all_input_nodes):
            # e.g. RMSNorm backward's pow(rsqrt(var), 3): it belongs with the backward that uses it, not
            # with the forward region its input came from (which would make the two backwards a cycle)
            fwd_only.add(n.name)
            pending.append(n)
            continue
        tagged_inputs = [a for a in n.all_input_nodes if a.name in region]
        if tagged_inputs:
            region[n.name] = region[max(tagged_inputs, key=lambda a: index[a.name]).name]
        else:
            pending.append(n)
    # a forward node with no tagged input joins the region of its users that starts first (the first node
    # tagged with it comes earliest): a value made before every layer and used by several (a position index
    # the masks of a later layer read first, as in Gemma 2/3 with 2 layers) must not join a later stage.
    # A deferred backward node joins its first user's region (backward runs the stages in reverse).
    start: dict[Region, int] = {}
    for n in nodes:
        if tags[n.name]:
            start.setdefault(region[n.name], index[n.name])
    for n in reversed(pending):
        forward = passes[n.name] == "F"
        users = sorted((u for u in n.users if u.name in region),
                       key=lambda u: (start.get(region[u.name], 0) if forward else 0, index[u.name]))
        if users:
            region[n.name] = region[users[0].name]
    first = next(iter(region.values()))
    last: Region = first
    for n in nodes:  # anything left (e.g. dead code) joins the previous node's region
        last = region.setdefault(n.name, last)
    return region, passes


def _passes(nodes: list[fx.Node], grad_seeds: set[str]) -> dict[str, str]:
    """Forward ("F") or backward ("B") of each node (in graph order): AOTAutograd's tag where it set one.
    It leaves the backward of a custom ``torch.autograd.Function`` untagged (its ``backward`` traced as a
    body of its own and inlined): an untagged node is backward where it reads a backward value or a
    gradient seed, else forward."""
    passes: dict[str, str] = {}
    for n in nodes:
        tag = n.meta.get("partitioner_tag")
        if tag in ("is_backward", "is_forward"):
            passes[n.name] = "B" if tag == "is_backward" else "F"
        else:
            passes[n.name] = "B" if any(passes.get(a.name) == "B" or a.name in grad_seeds
                                        for a in n.all_input_nodes) else "F"
    return passes


def param_derived(gm: fx.GraphModule, joint: JointGraph) -> set[str]:
    """Nodes computed from parameters alone (``t(W)``, ``W.to(bf16)``): every segment that reads one
    recomputes it from the parameter instead of receiving it, so no activation aliases a parameter
    (which under ZeRO-3 would keep a gathered parameter alive from forward to backward)."""
    params = {k for k, v in joint.value_of.items() if v.startswith("param:")}
    derived: set[str] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name in joint.grad_of or n.name == joint.loss:
            continue
        ins = n.all_input_nodes
        seeded = torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
        if ins and not seeded and all(a.name in params or a.name in derived for a in ins) \
                and not any(u.op == "output" for u in n.users):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) or n.target is operator.getitem:
                derived.add(n.name)
    return derived
