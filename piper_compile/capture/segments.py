"""Segments: the joint graph cut into one sub-graph per piece the segment passes cut
(``capture/cut_passes.py``: one per region and pass F/B, split into BI/BW, bucket chunks, ...); each
segment's graph copies its nodes, recomputes what it may, and reads everything else as an input.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from piper_compile.capture.cut_passes import BucketBytes, Cuts, run_cut_passes
from piper_compile.capture.joint import JointGraph
from piper_compile.capture.regions import Region, RegionCycleError, boundary_kind, region_label
from piper_compile.capture.checkpointing import replay_inputs
from piper_compile.capture.remat import HANDOVER_SUFFIX, RematPlan
from piper_compile.directives.spec import ActivationWindow, Checkpoint
from piper_compile.fxgraph import graph_module



@dataclass
class Segment:
    """A compiled unit: one region's forward (F) or backward (B) nodes of the joint graph."""

    name: str  # e.g. "F.PP1"
    region: Region
    pass_: str  # F | B
    gm: fx.GraphModule
    inputs: tuple[str, ...]  # value names, in placeholder order
    outputs: tuple[str, ...]  # value names, in output order
    loss: str | None = None  # output value that is the loss
    grads: tuple[tuple[str, str], ...] = ()  # (output value, param fqn)
    out_meta: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)  # value -> (shape, dtype)
    boundary: str | None = None  # "moe_fwd" / "moe_bwd" / "tp_allreduce" / ...: the segment is that one op


def _value(node: fx.Node, joint: JointGraph) -> str:
    return joint.value_of.get(node.name, node.name)


def _meta_of(node: fx.Node) -> tuple[tuple[str, ...], str]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(str(s) for s in val.shape), str(val.dtype).replace("torch.", "")
    return (), "sym"


def _is_scalar(node: fx.Node) -> bool:
    """A Python scalar computed in the graph (a size, a symbolic float such as ``sqrt(2 / math.pi)`` from a
    float Dynamo passed as a 0-dim input, a symbolic bool): never a tensor, so it never travels as one."""
    val = node.meta.get("val")
    return node.op != "placeholder" and isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _symexpr(node: fx.Node, symbols: frozenset[str]) -> str | None:
    """``symexpr:<expression>`` for a size computed from the graph's input symbols (the executor evaluates
    it from their values); None for anything else (a float, an unbacked size from ``.item()``)."""
    val = node.meta.get("val")
    if isinstance(val, int) and not isinstance(val, bool):
        return f"symexpr:{val}"
    if isinstance(val, torch.SymInt) and {str(f) for f in val.node.expr.free_symbols} <= symbols:
        return "symexpr:" + _expr_text(val.node.expr)
    return None


@functools.lru_cache(maxsize=4096)
def _expr_text(expr: Any) -> str:
    """A sympy size expression as the executor reads it (printing one costs milliseconds; blocks repeat them)."""
    return str(expr).replace(" ", "").replace(",", ";")


def extract_segments(joint: JointGraph, bucket_bytes: BucketBytes = None,
                     split_bw: Callable[[Region], bool] | None = None,
                     chunk_fw: Callable[[Region], bool] | None = None, remat: bool = True,
                     timings: dict[str, float] | None = None,
                     checkpoint: Callable[[Region], Checkpoint | None] | None = None,
                     window: ActivationWindow | None = None) -> list[Segment]:
    """Cut the joint graph into segments: one per region and pass; the backward of regions for which
    ``split_bw`` holds is cut into BI and BW; backward (or BW) segments are further cut into
    bucket-sized chunks when ``bucket_bytes`` is given (one size, or a region's own: its ``replicate``
    directive's ``bucket_size``), and so are the forward segments of regions for
    which ``chunk_fw`` holds (ZeRO-3). Parameter-only values are recomputed by each segment that reads
    them, and with ``remat`` so are cheap activations the backward can rebuild from what it keeps
    anyway (``capture/remat.py``). The cuts are the segment passes' (``capture/cut_passes.py``); this
    builds one segment per piece and checks the segment graph is acyclic. ``timings`` (if given) gets
    the seconds of each segment pass. ``checkpoint`` gives a region's checkpoint directive (or None);
    ``window`` says how many micro-batches of each region's activations are alive at once and where it
    is placed (a ``budget_mb`` policy budgets each stage's kept activations over them)."""
    timings = timings if timings is not None else {}
    extra: dict[str, Any] = {"timings": timings, "checkpoint": checkpoint, "window": window or ActivationWindow()}
    try:
        return _extract(Cuts(joint, bucket_bytes, split_bw, chunk_fw, remat, False, **extra))
    except RegionCycleError as first:  # e.g. RMSNorm backward's pow(rsqrt, 3) joined a forward region
        try:
            return _extract(Cuts(joint, bucket_bytes, split_bw, chunk_fw, remat, True, **extra))
        except RegionCycleError:
            raise first from None  # the default rule's message names the regions as the user tagged them


def _extract(cuts: Cuts) -> list[Segment]:
    """One segment per piece the segment passes cut."""
    run_cut_passes(cuts)
    joint = cuts.joint
    out_node = joint.gm.graph.find_nodes(op="output")[0]
    symbols = frozenset(str(s.symbol) for s in joint.inputs if s.symbol is not None)
    built = {key: _segment_graph(joint, key, nodes, cuts.derived, cuts.recompute, cuts.region, symbols)
             for key, nodes in cuts.keyed.items()}
    # a value is a segment output exactly when another segment reads it (after recomputation decided what
    # each segment reads: a recomputed value's own inputs are read by the backward segments that copy it)
    read = {v for _, _, inputs in built.values() for v in inputs}
    handed = {key: [n for n in built[key][1] if cuts.recompute.owner.get(n.name) == key
                    and n.name + HANDOVER_SUFFIX in read] for key in cuts.keyed}
    by_key = {key: _build_segment(joint, key, nodes, *built[key], read, out_node, handed[key])
              for key, nodes in cuts.keyed.items()}
    _check_acyclic(by_key, {n.name: key for key, ns in cuts.keyed.items() for n in ns})
    return list(by_key.values())


def _segment_graph(joint: JointGraph, key: tuple[str, Region, int], nodes: list[fx.Node], derived: set[str],
                   remat: RematPlan, region: dict[str, Region],
                   symbols: frozenset[str]) -> tuple[fx.Graph, dict[fx.Node, fx.Node], list[str]]:
    """The graph of one segment without its output: ``nodes`` copied, parameter-only values (and in a
    backward segment the recomputed activations) copied in from their inputs, every other value read from
    outside a placeholder. Returns the graph, the node map and the value names of the placeholders.

    Scalars are never received from another region (which may run on other ranks, and a RECV carries
    tensors): sizes of the input symbols are recomputed from the symbol values (``symexpr:``), any other
    scalar (``sqrt(2 / math.pi)`` of GPT-2's GELU, from a float Dynamo passed as a 0-dim input) by copying
    its computation here. Within a region a non-size scalar is handed over as the Python value it is."""
    backward = key[0] != "F"
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []

    def load(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if backward and remat.received(a.name, key):  # checkpointed: an earlier backward piece recomputed it
            ph = g.placeholder(f"in{len(inputs)}")
            ph.meta.update(a.meta)
            inputs.append(a.name + HANDOVER_SUFFIX)
            env[a] = ph
            return ph
        if backward and a.name in remat.replay:  # dropout's output from its input and the kept mask
            rp = remat.replay[a.name]
            x, mask = replay_inputs(a, rp)
            env[a] = g.call_function(torch.ops.aten.native_dropout_backward.default, (load(x), load(mask), rp.scale))
            env[a].meta.update(a.meta)
            return env[a]
        if a.name in derived or (backward and remat.recomputes(a.name)):  # recomputed here, not received
            env[a] = g.node_copy(a, load)
            return env[a]
        value = _symexpr(a, symbols) if _is_scalar(a) else None
        if value is None and _is_scalar(a) and region.get(a.name) != key[1]:
            env[a] = g.node_copy(a, load)
            return env[a]
        if value is None:
            value = _value(a, joint)
        ph = g.placeholder(f"in{len(inputs)}")
        ph.meta.update(a.meta)
        inputs.append(value)
        env[a] = ph
        return ph

    member = {n.name for n in nodes}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.name not in member:
                load(a)
        env[n] = g.node_copy(n, lambda a: env[a])
    if backward:  # the parts of a recomputed tuple this piece hands on (a getitem: no work)
        by_name = {n.name: n for n in joint.gm.graph.nodes}
        for v, owner in remat.owner.items():
            if owner == key:
                load(by_name[v])
    return g, env, inputs


def _build_segment(joint: JointGraph, key: tuple[str, Region, int], nodes: list[fx.Node], g: fx.Graph,
                   env: dict[fx.Node, fx.Node], inputs: list[str], read: set[str], out_node: fx.Node,
                   handed: list[fx.Node] = ()) -> Segment:  # type: ignore[assignment]
    """Finish a segment from :func:`_segment_graph`: its outputs are its values some other segment reads
    (``read``: every segment's input values), the joint graph's outputs (loss, gradients) and the
    checkpointed activations it recomputed that later backward pieces read (``handed``)."""
    pass_, reg, chunk = key
    outputs: list[str] = []
    out_nodes: list[fx.Node] = []
    out_meta: dict[str, tuple[tuple[str, ...], str]] = {}
    for n in nodes:
        if n.name in read or out_node in n.users:
            outputs.append(n.name)
            out_nodes.append(env[n])
            out_meta[n.name] = _meta_of(n)
    for n in handed:
        outputs.append(n.name + HANDOVER_SUFFIX)
        out_nodes.append(env[n])
        out_meta[n.name + HANDOVER_SUFFIX] = _meta_of(n)
    g.output(tuple(out_nodes))
    seg_gm = graph_module(joint.gm, g)
    name = f"{pass_}.{region_label(reg) or 'all'}" + (f".c{chunk}" if chunk >= 0 else "")
    loss = joint.loss if joint.loss in outputs else None
    grads = tuple((v, joint.grad_of[v]) for v in outputs if v in joint.grad_of)
    boundary = next((b for b in map(boundary_kind, nodes) if b), None)
    return Segment(name, reg, pass_, seg_gm, tuple(inputs), tuple(outputs), loss, grads, out_meta, boundary)


def _check_acyclic(by_key: dict[Any, Segment], seg_of: dict[str, Any]) -> None:
    segments = list(by_key.values())
    deps: dict[str, set[str]] = {s.name: set() for s in segments}
    witness: dict[tuple[str, str], str] = {}
    for s in segments:
        for v in s.inputs:
            src = seg_of.get(v)
            if src is not None and by_key[src].name != s.name:
                deps[s.name].add(by_key[src].name)
                witness[(by_key[src].name, s.name)] = v
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for d in sorted(deps[name]):
            if state.get(d) == 1:
                cyc = path[path.index(d):] + [d] if d in path else [d, name]
                via = ", ".join(f"{witness.get((b, a), '?')}" for a, b in zip(cyc, cyc[1:]))
                regions = sorted({c.split('.')[1] for c in cyc})
                raise RegionCycleError(
                    f"piper: region(s) {regions} are not contiguous: segments {' <- '.join(cyc)} depend on each "
                    f"other (through values {via}), so no stage order can run them. A region must be one "
                    "contiguous piece of the computation: annotate whole blocks, and do not come back to a "
                    "region after another region has started."
                )
            if state.get(d) is None:
                visit(d, path + [d])
        state[name] = 2

    for s in segments:
        if s.name not in state:
            visit(s.name, [s.name])
