"""Segment passes: the joint graph cut into segments in named steps, each one a pass under the same rules
as the graph and DAG passes (``passes/driver.py``): run in ``CUT_PASSES`` order by ``run_cut_passes``,
timed (``Cuts.timings``), the pieces dumped after each with ``PIPER_DEBUG=1``, the optional ones
skippable by name with ``PIPER_SKIP_PASSES`` (debugging only).

* ``regions``: every node's region and pass (``capture/regions.py``); one piece per (pass, region). A
  gradient summed from parts of regions placed on different device groups (a tied weight) becomes one
  output per region (``capture/grad_parts.py``).
* ``split_backward``: the backward of regions a split-backward schedule names is cut into BI and BW.
* ``bucket_chunks``: backward (or BW) pieces cut at gradient bucket boundaries (each region's
  ``replicate`` bucket size); under ZeRO-3 also where a piece starts reading another bucket.
* ``cut_pieces``: ZeRO-3 forward pieces cut at bucket reads, cuts around nested regions and boundary ops
  (experts, tensor-parallel markers), ``getitem`` kept with its producer: the final pieces.
* ``remat``: which activations each backward piece recomputes instead of receiving (``capture/remat.py``).
* ``checkpoint``: in the regions a ``checkpoint`` directive matches, which forward values the backward
  recomputes and which piece recomputes each (``capture/checkpointing.py``).

``capture/segments.py`` then builds one segment per final piece: it only cuts along what these decided.
"""
from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import fx

from piper_compile.pass_runner import run_pass, skipped_passes
from piper_compile.capture.grad_parts import placement, split_grad_parts
from piper_compile.capture.joint import JointGraph
from piper_compile.capture.regions import Region, assign_regions, block_of, boundary_kind, param_derived
from piper_compile.capture.checkpointing import demote_zero3, owners, plan_checkpoint, with_user_checkpoints
from piper_compile.capture.remat import NO_REMAT, RematPlan, plan_remat
from piper_compile.directives.spec import ActivationWindow, Checkpoint

Key = tuple[str, Region, int]  # (pass, region, chunk index or -1)


@dataclass
class Cuts:
    """The joint graph's nodes as pieces, as the segment passes cut them, and what they decided."""

    joint: JointGraph
    bucket_bytes: "BucketBytes" = None
    split_bw: Callable[[Region], bool] | None = None
    chunk_fw: Callable[[Region], bool] | None = None
    remat: bool = True
    defer_forward_only: bool = False
    checkpoint: Callable[[Region], Checkpoint | None] | None = None  # the checkpoint directive of a region
    window: ActivationWindow = field(default_factory=ActivationWindow)  # micro-batches alive per region, stages
    region: dict[str, Region] = field(default_factory=dict)  # node -> region
    passes: dict[str, str] = field(default_factory=dict)  # node -> F/B
    derived: set[str] = field(default_factory=set)  # parameter-only nodes (recomputed where read)
    groups: dict[tuple[str, Region], list[fx.Node]] = field(default_factory=dict)
    parts: dict[tuple[str, Region], list[tuple[str, list[fx.Node]]]] = field(default_factory=dict)
    chunked: dict[tuple[str, Region], list[list[fx.Node]]] = field(default_factory=dict)
    bucket_of: dict[str, Any] = field(default_factory=dict)  # param value -> its gradient bucket
    keyed: dict[Key, list[fx.Node]] = field(default_factory=dict)  # the final pieces
    recompute: RematPlan = NO_REMAT
    checkpointed: dict[Region, int] = field(default_factory=dict)  # region -> activation bytes kept per micro-batch
    timings: dict[str, float] = field(default_factory=dict)

    def pieces(self) -> dict[Any, list[fx.Node]]:
        """The pieces as they stand: final ones once ``cut_pieces`` ran, else the parts so far."""
        if self.keyed:
            return dict(self.keyed)
        return {(p, reg, c): nodes for (_, reg), ps in self.parts.items() for p, part in ps
                for c, nodes in enumerate(self.chunked.get((p, reg), [part]))}


def regions_pass(cuts: Cuts) -> None:
    cuts.region, cuts.passes = assign_regions(cuts.joint.gm, cuts.defer_forward_only)
    # a tied weight on several stages: one gradient part per stage (on a copy of the joint graph)
    cuts.joint = split_grad_parts(cuts.joint, cuts.region, cuts.passes, placement(cuts.window.places))
    gm = cuts.joint.gm
    cuts.derived = param_derived(gm, cuts.joint)
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "output") and n.name not in cuts.derived:
            cuts.groups.setdefault((cuts.passes[n.name], cuts.region[n.name]), []).append(n)
    cuts.parts = {key: [(key[0], nodes)] for key, nodes in cuts.groups.items()}


def split_backward_pass(cuts: Cuts) -> None:
    out_node = cuts.joint.gm.graph.find_nodes(op="output")[0]
    for (pass_, reg), nodes in cuts.groups.items():
        if pass_ == "B" and cuts.split_bw is not None and cuts.split_bw(reg):
            bi, bw = split_backward(nodes, cuts.joint, out_node)
            cuts.parts[(pass_, reg)] = [("BI", bi), ("BW", bw)]


def bucket_chunks_pass(cuts: Cuts) -> None:
    joint = cuts.joint
    for (_, reg), ps in cuts.parts.items():  # backward first: forward chunks follow its buckets
        for part_pass, part in ps:
            cap = cuts.bucket_bytes(reg) if callable(cuts.bucket_bytes) else cuts.bucket_bytes
            if part_pass in ("B", "BW") and cap:
                zero3 = cuts.chunk_fw is not None and cuts.chunk_fw(reg)
                chunks = _chunk_backward(part, joint, cap, whole_blocks=zero3)
                if zero3:  # ZeRO-3: each piece reads one bucket
                    coarse = _buckets_of(chunks, joint, reg)
                    chunks = [piece for c in chunks for piece in _cut_at_bucket_reads(c, joint, coarse, cuts.derived)]
                cuts.chunked[(part_pass, reg)] = chunks
                cuts.bucket_of.update(_buckets_of(chunks, joint, reg))


def cut_pieces_pass(cuts: Cuts) -> None:
    gm = cuts.joint.gm
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    keyed: dict[Key, list[fx.Node]] = {}
    for (pass_, reg), ps in cuts.parts.items():
        for part_pass, part in ps:
            if (part_pass, reg) in cuts.chunked:
                chunks = cuts.chunked[(part_pass, reg)]
            elif part_pass == "F" and cuts.chunk_fw is not None and cuts.chunk_fw(reg) and cuts.bucket_of:
                chunks = _cut_at_bucket_reads(part, cuts.joint, cuts.bucket_of, cuts.derived)
            else:
                chunks = [part]
            nested = sorted(pos[n] for (p2, r2), ns in cuts.groups.items() if p2 == pass_ and set(r2) > set(reg)
                            for n in ns)
            if any(chunks):  # an empty part (e.g. the first stage's BI) stays: schedules name it
                chunks = _cut_at_boundaries(_cut_at_nested(chunks, nested, pos))
            for c, chunk in enumerate(chunks):
                keyed[(part_pass, reg, c if len(chunks) > 1 else -1)] = chunk
    cuts.keyed = _getitems_with_producer(keyed, gm)


def remat_pass(cuts: Cuts) -> None:
    if not cuts.remat:
        return
    seg_of = {n.name: key for key, ns in cuts.keyed.items() for n in ns}
    param_ok = _remat_param_rule(cuts.joint, cuts.keyed, seg_of, cuts.region, cuts.passes, cuts.derived,
                                 cuts.bucket_of, cuts.chunk_fw)
    cuts.recompute = plan_remat(cuts.joint, cuts.region, cuts.passes, cuts.derived, param_ok, boundary_kind)


def checkpoint_pass(cuts: Cuts) -> None:
    policy_of = with_user_checkpoints(cuts.joint, cuts.region, cuts.passes, cuts.recompute.nodes, cuts.checkpoint)
    if policy_of is None:
        return
    joint = cuts.joint
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    position = {name: i for i, name in enumerate(nodes)}
    zero3 = cuts.chunk_fw or (lambda reg: False)
    piece_buckets = _bucket_reads(joint, cuts.keyed, cuts.derived, cuts.bucket_of)

    keep: frozenset[str] = frozenset()
    while True:  # a value kept under ZeRO-3 changes what the others need: plan again until none is
        plan = plan_checkpoint(joint, cuts.region, cuts.passes, cuts.derived, boundary_kind, policy_of,
                               cuts.window, keep)
        handover = plan.handover(joint)
        owner, computes = owners(cuts.keyed, plan.nodes, handover, position, plan.replay)
        bad = demote_zero3(computes, nodes, lambda n: _param_roots(n, cuts.derived, joint), cuts.bucket_of,
                           piece_buckets, zero3)
        if not bad:
            break
        keep |= bad
    cheap = {v for v in cuts.recompute.nodes if cuts.region.get(v) not in plan.kept_bytes}
    cuts.recompute = RematPlan(frozenset(cheap | plan.nodes), cuts.recompute.released_bytes, handover, owner,
                               plan.replay)
    cuts.checkpointed = plan.kept_bytes


# (name, pass, may be skipped by name)
CUT_PASSES: list[tuple[str, Callable[[Cuts], None], bool]] = [
    ("regions", regions_pass, False),
    ("split_backward", split_backward_pass, True),
    ("bucket_chunks", bucket_chunks_pass, True),
    ("cut_pieces", cut_pieces_pass, False),
    ("remat", remat_pass, True),
    ("checkpoint", checkpoint_pass, False),
]


def run_cut_passes(cuts: Cuts) -> Cuts:
    """Every segment pass in order (less the optional ones skipped by name); returns ``cuts``."""
    skip = skipped_passes()
    for name, fn, optional in CUT_PASSES:
        if not (optional and name in skip):
            run_pass(name, lambda fn=fn: fn(cuts), cuts.timings, "segment pieces", lambda _: f"\n{_dump(cuts)}")
    return cuts


def _dump(cuts: Cuts) -> str:
    lines = []
    for (p, reg, c), nodes in cuts.pieces().items():
        names = [n.name for n in nodes]
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} nodes)" if len(names) > 6 else "")
        lines.append(f"  {p} {dict(reg)} #{c}: {shown}")
    if cuts.recompute is not NO_REMAT:
        lines.append(f"  recomputed in backward: {len(cuts.recompute.nodes)} nodes, {cuts.recompute.released_bytes} bytes "
                     "of kept activations released")
    for reg, kept in cuts.checkpointed.items():
        mine = [v for v in cuts.recompute.nodes if cuts.region.get(v) == reg]
        lines.append(f"  checkpoint {dict(reg)}: {len(mine)} forward values recomputed, {kept} bytes kept per "
                     f"micro-batch, {sum(1 for v in mine if v in cuts.recompute.handover and v in cuts.recompute.owner)} "
                     "recomputed once and handed to later backward pieces")
    return "\n".join(lines)


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


FIRST_BUCKET_BYTES = 1 << 20  # as DDP: a small first bucket starts communication early


def _chunk_backward(nodes: list[fx.Node], joint: JointGraph, cap_bytes: float,
                    whole_blocks: bool = False) -> list[list[fx.Node]]:
    """Cut a backward node list after the node whose gradient outputs fill a bucket (the first bucket
    at most 1 MiB, the others ``cap_bytes``), so each bucket's all-reduce can start while the rest of
    the backward still computes. ``whole_blocks`` (ZeRO-3, whose forward is cut where it reads another
    bucket): a bucket that fills inside a repeated block (``capture.regions.block_of``, the rule regional
    compilation cuts by) no larger than the bucket ends with that block, so its pieces are whole blocks and
    alike blocks compile once (a bucket smaller than a block is cut as asked; the first bucket too ends
    with its block, not at 1 MiB)."""
    blocks = [block_of(n) for n in nodes]
    for i in range(1, len(blocks)):  # a node that records no module belongs to the block before it
        blocks[i] = blocks[i] if blocks[i] is not None else blocks[i - 1]
    sizes: dict[Any, float] = {}
    for n, b in zip(nodes, blocks):
        if n.name in joint.grad_of:
            p = joint.params[joint.grad_of[n.name]]
            sizes[b] = sizes.get(b, 0.0) + p.numel() * p.element_size()
    chunks: list[list[fx.Node]] = [[]]
    size = 0.0
    cap = min(cap_bytes, FIRST_BUCKET_BYTES)
    for i, n in enumerate(nodes):
        chunks[-1].append(n)
        fqn = joint.grad_of.get(n.name)
        if fqn is not None:
            p = joint.params[fqn]
            size += p.numel() * p.element_size()
        here = blocks[i]
        inside = whole_blocks and here is not None and here[0] != "" and sizes.get(here, 0.0) <= cap_bytes
        if size >= cap and not (inside and i + 1 < len(nodes) and blocks[i + 1] == here):
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


def _remat_param_rule(joint: JointGraph, keyed: dict[Any, list[fx.Node]], seg_of: dict[str, Any],
                      region: dict[str, Region], passes: dict[str, str], derived: set[str], bucket_of: dict[str, Any],
                      chunk_fw: Callable[[Region], bool] | None) -> Callable[[fx.Node, str], bool]:
    """May a recomputation of kept value ``c`` read parameter ``param``? Always, except in ZeRO-3 regions,
    where each backward step gathers only the buckets it reads: there only a parameter of a bucket that
    every backward step reading ``c`` gathers anyway (a layer norm's weight, when its bucket is the one
    of the linear layer whose weight gradient reads the norm's output)."""
    if chunk_fw is None:
        return lambda c, param: True
    buckets = _bucket_reads(joint, keyed, derived, bucket_of)

    def ok(c: fx.Node, param: str) -> bool:
        if not chunk_fw(region[c.name]):
            return True
        b = bucket_of.get(param)
        readers = {seg_of[u.name] for u in c.users if passes.get(u.name) != "F" and u.name in seg_of}
        return b is not None and all(b in buckets(k) for k in readers)
    return ok


def _bucket_reads(joint: JointGraph, keyed: dict[Any, list[fx.Node]], derived: set[str],
                  bucket_of: dict[str, Any]) -> Callable[[Any], set[Any]]:
    """piece key -> the gradient buckets whose parameters the piece reads (ZeRO-3: the ones its step
    gathers), computed once per piece."""
    reads: dict[Any, set[Any]] = {}

    def buckets(key: Any) -> set[Any]:
        if key not in reads:
            reads[key] = {bucket_of.get(v) for n in keyed[key] for v in _param_roots(n, derived, joint)} - {None}
        return reads[key]
    return buckets


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
