"""Gradient parts: a parameter read in several regions gets one gradient output per region.

AOTAutograd sums the gradient of a parameter used twice (a tied embedding and LM head) inside the
joint graph: ``add(part of the head's backward, part of the embedding's backward)``. By the region rule
that ``add`` joins the region whose part comes last, so under pipelining the other region's part would
cross stages once per micro-batch. Instead, each region's part becomes a gradient output of its own
(``JointGraph.grad_of`` maps every part to the parameter): each stage accumulates its part over the
micro-batches like any gradient, and lowering exchanges the parts once per step between the holders
(``passes/lower.py``). Parts of one region (several uses inside it) are summed there.

Only where the ``place`` directives put the regions on different device groups: on one group (DualPipeV
and ZBV hold both ends of the model on one rank) the sum stays one segment's work, so the two parts are
not two accumulations into one gradient, which no reordering may swap (``plan/reorder.py``).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Iterable

import torch
from torch import fx

from piper_compile.capture.joint import JointGraph
from piper_compile.capture.regions import Region
from piper_compile.directives.spec import Place, filter_matches
from piper_compile.fxgraph import graph_module

_ADD = torch.ops.aten.add.Tensor


def _summands(g: fx.Node) -> list[fx.Node]:
    """The terms of the ``add`` tree rooted at ``g`` (inner adds used only by the tree are opened)."""
    if not _plain_add(g):
        return [g]
    out: list[fx.Node] = []
    for a in g.args[:2]:
        out += _summands(a) if _plain_add(a) and len(a.users) == 1 else [a]  # type: ignore[arg-type]
    return out


def _plain_add(n: object) -> bool:
    """``a + b`` of two tensors of one shape and dtype (no alpha, no broadcast, no promotion)."""
    if not isinstance(n, fx.Node) or n.target is not _ADD or n.kwargs or len(n.args) != 2:
        return False
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (n, *n.args)]
    return all(isinstance(v, torch.Tensor) for v in vals) and all(
        v.shape == vals[0].shape and v.dtype == vals[0].dtype for v in vals[1:])


def placement(places: Iterable[Place]) -> Callable[[Region], tuple[int, ...] | None]:
    """The device group the ``place`` directives give a region (the last that matches, as the ``place``
    pass applies them in order; None: unplaced)."""
    places = list(places)

    def devices(reg: Region) -> tuple[int, ...] | None:
        found = None
        for d in places:
            if filter_matches(d.filter, dict(reg)):
                found = tuple(d.devices)
        return found
    return devices


def split_grad_parts(joint: JointGraph, region: dict[str, Region], passes: dict[str, str],
                     devices: Callable[[Region], tuple[int, ...] | None]) -> JointGraph:
    """``joint`` with every gradient output summed from parts of regions on different device groups
    (``devices``) rewritten into one output per region (``region``/``passes`` updated for the nodes added
    and removed). A copy when anything is split: the captured graph is shared by plans of other
    placements (``CompiledStep.share_capture``)."""
    todo = [n.name for n in joint.gm.graph.nodes
            if n.name in joint.grad_of and _split_groups(joint, n, region, devices)]
    if not todo:
        return joint
    joint = _copy(joint)
    gm = joint.gm
    out_node = gm.graph.find_nodes(op="output")[0]
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in todo:
        g = nodes[name]
        by_region = _split_groups(joint, g, region, devices)
        if not by_region:  # a term is another gradient's part now
            continue
        parts = [_sum_in_region(gm, ts, g, reg, region, passes) for reg, ts in by_region.items()]
        _replace_output(out_node, g, parts)
        fqn = joint.grad_of.pop(g.name)
        joint.grad_of.update({p.name: fqn for p in parts})
        _erase_tree(gm, g, {t for ts in by_region.values() for t in ts})
    for gone in set(region) - {n.name for n in gm.graph.nodes}:
        region.pop(gone, None)
        passes.pop(gone, None)
    gm.recompile()
    return joint


def _split_groups(joint: JointGraph, g: fx.Node, region: dict[str, Region],
                  devices: Callable[[Region], tuple[int, ...] | None]) -> dict[Region, list[fx.Node]]:
    """The terms of gradient output ``g`` by region, when they come from regions on pairwise different
    device groups (else empty: nothing to split)."""
    terms = _summands(g)
    by_region: dict[Region, list[fx.Node]] = {}
    for t in terms:
        by_region.setdefault(region[t.name], []).append(t)
    groups = [devices(reg) for reg in by_region]
    taken = set(joint.grad_of) | {joint.loss}
    if len(by_region) < 2 or len(set(groups)) < len(groups) or any(
            t.op == "placeholder" or t.name in taken for t in terms):
        return {}
    return by_region


def _copy(joint: JointGraph) -> JointGraph:
    """``joint`` on a copy of its graph (same node names; node metadata shared, not copied)."""
    graph = copy.deepcopy(joint.gm.graph)
    assert [n.name for n in graph.nodes] == [n.name for n in joint.gm.graph.nodes]
    return dataclasses.replace(joint, gm=graph_module(joint.gm, graph), grad_of=dict(joint.grad_of))


def _sum_in_region(gm: fx.GraphModule, terms: list[fx.Node], like: fx.Node, reg: Region,
                   region: dict[str, Region], passes: dict[str, str]) -> fx.Node:
    """One region's part: its single term, or its terms summed (in graph order) right after the last."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    terms = sorted(terms, key=pos.__getitem__)
    part = terms[0]
    for t in terms[1:]:
        with gm.graph.inserting_after(t):
            part = gm.graph.call_function(_ADD, (part, t))
        part.meta.update(like.meta)
        region[part.name], passes[part.name] = reg, passes.get(t.name, "B")
    return part


def _replace_output(out_node: fx.Node, g: fx.Node, parts: list[fx.Node]) -> None:
    """``g``'s place among the joint graph's outputs goes to the first part; the others are appended (the
    loss stays first)."""
    outs = list(out_node.args[0])  # type: ignore[arg-type]
    outs[outs.index(g)] = parts[0]
    out_node.args = (tuple(outs + parts[1:]),)


def _erase_tree(gm: fx.GraphModule, g: fx.Node, keep: set[fx.Node]) -> None:
    """Remove ``g`` and the inner adds of its tree (now unused), never a term."""
    stack = [g]
    while stack:
        n = stack.pop()
        if n in keep or n.users:
            continue
        args = [a for a in n.args if isinstance(a, fx.Node)]
        gm.graph.erase_node(n)
        stack += args
