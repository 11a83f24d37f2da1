"""Regions and segments: the joint graph cut into one sub-graph per (region tags, pass F/B).

Region rule for untagged nodes (documented in docs/design.md): an untagged node joins the region of
its *latest-computed* tagged input (so gradient accumulation of a tied weight lands in the region whose
backward runs last); a node with no tagged input joins the region of those of its users that starts first
in the graph (its earliest stage); a graph with no tags at all is one region ``{}``.
"""
from __future__ import annotations

import bisect
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from piper_compile.capture.annotate import AUTO_PREFIX
from piper_compile.capture.joint import JointGraph
from piper_compile.capture.remat import NO_REMAT, RematPlan, plan_remat
from piper_compile.errors import PiperCaptureError

Region = tuple[tuple[str, Any], ...]
RESERVED_TAGS = {"PASS", "MB"}


class RegionCycleError(PiperCaptureError):
    """Segments of regions depend on each other in a cycle (no stage order can run them)."""


def region_label(region: Region) -> str:
    return "".join(f"{k}{v}" for k, v in region)


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


def boundary_kind(node: fx.Node) -> str | None:
    """Ops that get a segment of their own, so a directive can replace them by communication plus local
    compute: the experts of :class:`piper_compile.nn.MoE` (``shard`` makes them expert parallel) and the
    tensor/sequence-parallel markers of :mod:`piper_compile.nn.tp` (``shard_tensor``)."""
    if node.op != "call_function":
        return None
    from piper_compile.nn.moe import BACKWARD_OP, FORWARD_OP
    from piper_compile.nn import tp

    return {FORWARD_OP: "moe_fwd", BACKWARD_OP: "moe_bwd", tp.ALLREDUCE_OP: "tp_allreduce",
            tp.ALL_GATHER_OP: "tp_all_gather", tp.REDUCE_SCATTER_OP: "tp_reduce_scatter",
            tp.GATHER_OP: "tp_gather", tp.SCATTER_OP: "tp_scatter"}.get(node.target)  # type: ignore[arg-type]


def _cut_at_nested(chunks: list[list[fx.Node]], nested: list[int], pos: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """Cut a region's pieces where a nested region (its tags plus more, e.g. ``{PP: 0, EP: 0}`` inside
    ``{PP: 0}``) runs in between, so the block before the nested part, the part and the block after it
    are separate segments instead of a cycle."""
    if not nested:
        return chunks
    out: list[list[fx.Node]] = []
    for chunk in chunks:
        cur: list[fx.Node] = []
        for n in chunk:
            if cur and bisect.bisect_left(nested, pos[n]) != bisect.bisect_left(nested, pos[cur[-1]]):
                out.append(cur)
                cur = []
            cur.append(n)
        out.append(cur)
    return [c for c in out if c]


def _cut_at_boundaries(chunks: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """Give every boundary op (with the getitems of its outputs) a chunk of its own; the pieces before and
    after it stay contiguous in graph order, so the cut never creates a cycle."""
    out: list[list[fx.Node]] = []
    for chunk in chunks:
        ops = [n for n in chunk if boundary_kind(n)]
        if not ops:
            out.append(chunk)
            continue
        owned = {u for op in ops for u in op.users if u.op == "call_function" and u.target is operator.getitem}
        cur: list[fx.Node] = []
        for n in chunk:
            if n in owned:
                continue
            if boundary_kind(n):
                out.append(cur)
                out.append([n] + [u for u in chunk if u in owned and u.args[0] is n])
                cur = []
            else:
                cur.append(n)
        out.append(cur)
    return [c for c in out if c]


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
    passes = {n.name: ("B" if n.meta.get("partitioner_tag") == "is_backward" else "F") for n in nodes}
    grad_seeds = {n.name for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")}
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
        return "symexpr:" + str(val.node.expr).replace(" ", "").replace(",", ";")
    return None


FIRST_BUCKET_BYTES = 1 << 20  # as DDP: a small first bucket starts communication early


def _chunk_backward(nodes: list[fx.Node], joint: JointGraph, cap_bytes: float) -> list[list[fx.Node]]:
    """Cut a backward node list after the node whose gradient outputs fill a bucket (the first bucket
    at most 1 MiB, the others ``cap_bytes``), so each bucket's all-reduce can start while the rest of
    the backward still computes."""
    chunks: list[list[fx.Node]] = [[]]
    size = 0.0
    cap = min(cap_bytes, FIRST_BUCKET_BYTES)
    for n in nodes:
        chunks[-1].append(n)
        fqn = joint.grad_of.get(n.name)
        if fqn is not None:
            p = joint.params[fqn]
            size += p.numel() * p.element_size()
            if size >= cap:
                chunks.append([])
                size, cap = 0.0, cap_bytes
    return [c for c in chunks if c]


def _buckets_of(chunks: list[list[fx.Node]], joint: JointGraph, reg: Region) -> dict[str, Any]:
    """param value -> (region, index of the backward chunk that finishes its gradient)."""
    return {f"param:{joint.grad_of[n.name]}": (reg, c) for c, chunk in enumerate(chunks)
            for n in chunk if n.name in joint.grad_of}


def _cut_at_bucket_reads(nodes: list[fx.Node], joint: JointGraph, bucket_of: dict[str, Any],
                         derived: set[str]) -> list[list[fx.Node]]:
    """Cut a node list where it starts reading parameters of another gradient bucket (ZeRO-3:
    a piece's buckets are all-gathered just before it and freed after it, so pieces aligned with the
    buckets gather each bucket once and bound the gathered memory). Pieces are contiguous in graph
    order, hence never cyclic. In a backward chunk this separates the input gradient through a layer
    of the previous bucket (it reads that layer's weight) from the layers of the chunk's own bucket."""
    chunks: list[list[fx.Node]] = [[]]
    current: Any = None
    for n in nodes:
        for b in (bucket_of.get(a) for a in _param_roots(n, derived, joint)):
            if b is None or b == current:
                continue
            if current is not None and chunks[-1]:
                chunks.append([])
            current = b
            break
        chunks[-1].append(n)
    return [c for c in chunks if c]


def _param_roots(n: fx.Node, derived: set[str], joint: JointGraph) -> list[str]:
    """Parameter values a node reads directly or through parameter-only ops (transposes, casts)."""
    out: list[str] = []
    stack = list(n.all_input_nodes)
    seen: set[str] = set()
    while stack:
        a = stack.pop()
        if a.name in seen:
            continue
        seen.add(a.name)
        if a.op == "placeholder":
            v = joint.value_of.get(a.name, "")
            if v.startswith("param:"):
                out.append(v)
        elif a.name in derived:
            stack.extend(a.all_input_nodes)
    return out


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


def split_backward(nodes: list[fx.Node], joint: JointGraph, out_node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """Cut one region's backward into BI (everything the gradients leaving the region -- input and
    activation gradients -- depend on) and BW (the rest: weight gradients). Reachability in the joint
    graph decides; values BW needs from BI become BI outputs when the segments are built."""
    member = {n.name for n in nodes}
    roots = [n for n in nodes if n.name not in joint.grad_of
             and any(u is out_node or u.name not in member for u in n.users)]
    bi: set[str] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.name in bi:
            continue
        bi.add(n.name)
        stack.extend(a for a in n.all_input_nodes if a.name in member)
    return [n for n in nodes if n.name in bi], [n for n in nodes if n.name not in bi]


BucketBytes = float | Callable[[Region], float | None] | None


def extract_segments(joint: JointGraph, bucket_bytes: BucketBytes = None,
                     split_bw: Callable[[Region], bool] | None = None,
                     chunk_fw: Callable[[Region], bool] | None = None, remat: bool = True) -> list[Segment]:
    """Cut the joint graph into segments: one per region and pass; the backward of regions for which
    ``split_bw`` holds is cut into BI and BW; backward (or BW) segments are further cut into
    bucket-sized chunks when ``bucket_bytes`` is given (one size, or a region's own: its ``replicate``
    directive's ``bucket_size``), and so are the forward segments of regions for
    which ``chunk_fw`` holds (ZeRO-3). Parameter-only values are recomputed by each segment that reads
    them, and with ``remat`` so are cheap activations the backward can rebuild from what it keeps
    anyway (``capture/remat.py``). Checks the segment graph is acyclic."""
    try:
        return _extract(joint, bucket_bytes, split_bw, chunk_fw, remat, False)
    except RegionCycleError as first:  # e.g. RMSNorm backward's pow(rsqrt, 3) joined a forward region
        try:
            return _extract(joint, bucket_bytes, split_bw, chunk_fw, remat, True)
        except RegionCycleError:
            raise first from None  # the default rule's message names the regions as the user tagged them


def _extract(joint: JointGraph, bucket_bytes: BucketBytes, split_bw: Callable[[Region], bool] | None,
             chunk_fw: Callable[[Region], bool] | None, remat: bool, defer_forward_only: bool) -> list[Segment]:
    gm = joint.gm
    region, passes = assign_regions(gm, defer_forward_only)
    derived = param_derived(gm, joint)
    groups: dict[tuple[str, Region], list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or n.name in derived:
            continue
        groups.setdefault((passes[n.name], region[n.name]), []).append(n)
    out_node = gm.graph.find_nodes(op="output")[0]
    parts: dict[tuple[str, Region], list[tuple[str, list[fx.Node]]]] = {}
    for (pass_, reg), nodes in groups.items():
        parts[(pass_, reg)] = [(pass_, nodes)]
        if pass_ == "B" and split_bw is not None and split_bw(reg):
            bi, bw = split_backward(nodes, joint, out_node)
            parts[(pass_, reg)] = [("BI", bi), ("BW", bw)]
    chunked: dict[tuple[str, Region], list[list[fx.Node]]] = {}
    bucket_of: dict[str, Any] = {}  # param value -> its gradient bucket (backward chunk)
    for (pass_, reg), ps in parts.items():  # backward first: forward chunks follow its buckets
        for part_pass, part in ps:
            cap = bucket_bytes(reg) if callable(bucket_bytes) else bucket_bytes
            if part_pass in ("B", "BW") and cap:
                chunks = _chunk_backward(part, joint, cap)
                if chunk_fw is not None and chunk_fw(reg):  # ZeRO-3: each backward piece reads one bucket
                    coarse = _buckets_of(chunks, joint, reg)
                    chunks = [piece for c in chunks for piece in _cut_at_bucket_reads(c, joint, coarse, derived)]
                chunked[(part_pass, reg)] = chunks
                bucket_of.update(_buckets_of(chunks, joint, reg))
    keyed: dict[tuple[str, Region, int], list[fx.Node]] = {}
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for (pass_, reg), ps in parts.items():
        for part_pass, part in ps:
            if (part_pass, reg) in chunked:
                chunks = chunked[(part_pass, reg)]
            elif part_pass == "F" and chunk_fw is not None and chunk_fw(reg) and bucket_of:
                chunks = _cut_at_bucket_reads(part, joint, bucket_of, derived)
            else:
                chunks = [part]
            nested = sorted(pos[n] for (p2, r2), ns in groups.items() if p2 == pass_ and set(r2) > set(reg) for n in ns)
            if any(chunks):  # an empty part (e.g. the first stage's BI) stays: schedules name it
                chunks = _cut_at_boundaries(_cut_at_nested(chunks, nested, pos))
            for c, chunk in enumerate(chunks):
                keyed[(part_pass, reg, c if len(chunks) > 1 else -1)] = chunk
    keyed = _getitems_with_producer(keyed, gm)
    seg_of = {n.name: key for key, ns in keyed.items() for n in ns}
    rp = NO_REMAT
    if remat:
        param_ok = _remat_param_rule(joint, keyed, seg_of, region, passes, derived, bucket_of, chunk_fw)
        rp = plan_remat(joint, region, passes, derived, param_ok, boundary_kind)
    symbols = frozenset(str(s.symbol) for s in joint.inputs if s.symbol is not None)
    built = {key: _segment_graph(joint, key, nodes, derived, rp, region, symbols) for key, nodes in keyed.items()}
    # a value is a segment output exactly when another segment reads it (after recomputation decided what
    # each segment reads: a recomputed value's own inputs are read by the backward segments that copy it)
    read = {v for _, _, inputs in built.values() for v in inputs}
    by_key = {key: _build_segment(joint, key, nodes, *built[key], read, out_node) for key, nodes in keyed.items()}
    _check_acyclic(by_key, seg_of)
    return list(by_key.values())


def _remat_param_rule(joint: JointGraph, keyed: dict[Any, list[fx.Node]], seg_of: dict[str, Any],
                      region: dict[str, Region], passes: dict[str, str], derived: set[str], bucket_of: dict[str, Any],
                      chunk_fw: Callable[[Region], bool] | None) -> Callable[[fx.Node, str], bool]:
    """May a recomputation of kept value ``c`` read parameter ``param``? Always, except in ZeRO-3 regions,
    where each backward step gathers only the buckets it reads: there only a parameter of a bucket that
    every backward step reading ``c`` gathers anyway (a layer norm's weight, when its bucket is the one
    of the linear layer whose weight gradient reads the norm's output)."""
    if chunk_fw is None:
        return lambda c, param: True
    reads: dict[Any, set[Any]] = {}

    def buckets(key: Any) -> set[Any]:
        if key not in reads:
            reads[key] = {bucket_of.get(v) for n in keyed[key] for v in _param_roots(n, derived, joint)} - {None}
        return reads[key]

    def ok(c: fx.Node, param: str) -> bool:
        if not chunk_fw(region[c.name]):
            return True
        b = bucket_of.get(param)
        readers = {seg_of[u.name] for u in c.users if passes.get(u.name) != "F" and u.name in seg_of}
        return b is not None and all(b in buckets(k) for k in readers)
    return ok


def _getitems_with_producer(keyed: dict[Any, list[fx.Node]], gm: fx.GraphModule) -> dict[Any, list[fx.Node]]:
    """Keep every ``getitem`` in the segment of the multi-output op it reads, so no tuple ever crosses a
    segment boundary (a BI/BW or bucket cut can otherwise fall between e.g. ``native_layer_norm_backward``
    and the getitems of its weight gradients; Inductor cannot return a tuple from a graph)."""
    where = {n: k for k, ns in keyed.items() for n in ns}
    for n, k in list(where.items()):
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            src = where.get(n.args[0])
            if src is not None and src != k:
                where[n] = src
    out: dict[Any, list[fx.Node]] = {k: [] for k in keyed}
    for n in gm.graph.nodes:  # graph order keeps every segment topologically sorted
        if n in where:
            out[where[n]].append(n)
    return out


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
    return g, env, inputs


def _build_segment(joint: JointGraph, key: tuple[str, Region, int], nodes: list[fx.Node], g: fx.Graph,
                   env: dict[fx.Node, fx.Node], inputs: list[str], read: set[str], out_node: fx.Node) -> Segment:
    """Finish a segment from :func:`_segment_graph`: its outputs are its values some other segment reads
    (``read``: every segment's input values) and the joint graph's outputs (loss, gradients)."""
    pass_, reg, chunk = key
    outputs: list[str] = []
    out_nodes: list[fx.Node] = []
    out_meta: dict[str, tuple[tuple[str, ...], str]] = {}
    for n in nodes:
        if n.name in read or out_node in n.users:
            outputs.append(n.name)
            out_nodes.append(env[n])
            out_meta[n.name] = _meta_of(n)
    g.output(tuple(out_nodes))
    seg_gm = fx.GraphModule(joint.gm, g)
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

