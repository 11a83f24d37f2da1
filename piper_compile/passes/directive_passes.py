"""One pass per directive: place, split, replicate, order. Each validates its input and raises
``PiperDirectiveError`` (directive index + JSON, what is wrong, how to fix it)."""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, Iterable

from piper_compile.directives.spec import ANY, Checkpoint, Directive, Filter, Order, Place, Replicate, Split, filter_matches
from piper_compile.ir.dag import Kind, Node, TrainingDAG
from piper_compile.ir.ops import Segment as SegmentOp
from piper_compile.passes.context import PassContext


def _compute(dag: TrainingDAG) -> list[Node]:
    return dag.of_kind(Kind.COMPUTE)


def _regions_text(dag: TrainingDAG) -> str:
    seen: list[str] = []
    for n in _compute(dag):
        t = ",".join(f"{k}={v}" for k, v in n.tags if k != "PASS" and k != dag.meta.mb_tag)
        t = "{" + t + "}"
        if t not in seen:
            seen.append(t)
    return ", ".join(seen)


def match(dag: TrainingDAG, d: Directive, flt: Filter, ctx: PassContext, allow_empty: bool = False) -> list[Node]:
    """COMPUTE nodes matched by ``flt``; unknown tags and empty matches are errors."""
    known = ctx.tag_keys(dag)
    unknown = sorted(set(flt) - known)
    if unknown:
        mb_tag = dag.meta.mb_tag
        hint = (f" ({mb_tag!r} exists only after a split directive; put split before this directive)"
                if mb_tag in unknown else "")
        raise d.error(f"filter {flt} uses tag(s) {unknown} that no part of the model has{hint}; "
                      f"the model's tags are {sorted(known)}",
                      "annotate the model with that tag (piper.annotate) or fix the filter's tag name")
    nodes = [n for n in _compute(dag) if filter_matches(flt, n.tag_dict)]
    if not nodes and not allow_empty:
        raise d.error(f"filter {flt} matches no region; the model's regions are {_regions_text(dag)}",
                      "use a tag index that the model has, or '*'")
    return nodes


def check_ranks(d: Directive, ranks: Iterable[int] | None, ctx: PassContext) -> None:
    """Every rank a directive names exists in the world."""
    bad = sorted(r for r in ranks or () if r >= ctx.world_size)
    if bad:
        raise d.error(f"rank(s) {bad} are outside the world of {ctx.world_size} rank(s) (0..{ctx.world_size - 1})",
                      f"use ranks below {ctx.world_size}, or launch with more processes")


def _json(d: Directive | None) -> str:
    return json.dumps(d.raw if d is not None and d.raw is not None else d.to_json() if d is not None else None,
                      default=str, sort_keys=True)


def apply_place(dag: TrainingDAG, d: Place, ctx: PassContext) -> TrainingDAG:
    check_ranks(d, d.devices, ctx)
    for n in match(dag, d, d.filter, ctx):
        before = n.attr("placed_by")
        if before is not None and before != d.index and tuple(n.devices) != tuple(d.devices):
            raise d.error(f"it places {n.name} on ranks {list(d.devices)}, but directive #{before} "
                          f"{_json(ctx.directive(before))} already placed it on ranks {list(n.devices)}",
                          "place each region once: fix the filter or the devices of one of the two directives")
        dag.replace(n.with_(devices=tuple(d.devices)).with_attrs(placed_by=d.index, p2p_stream=d.stream or ""))
    return dag


def _replication(d: Replicate) -> dict[str, object]:
    """What a replicate directive sets on a region (two directives covering one region must agree)."""
    return {"reduce_stream": d.reduce_stream, "bucket_mb": d.bucket_size, "zero": d.zero,
            "gather_stream": d.gather_stream, "prefetch": d.prefetch, "reduce_mb": d.reduce_per_microbatch}


def apply_replicate(dag: TrainingDAG, d: Replicate, ctx: PassContext) -> TrainingDAG:
    check_ranks(d, d.devices, ctx)
    mine = _replication(d)
    for n in match(dag, d, d.filter, ctx):
        before = n.attr("replicated_by")
        differ = {k: (n.attr(k), v) for k, v in mine.items() if n.attr(k) != v}
        if before is not None and before != d.index and differ:
            what = ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in differ.items())
            raise d.error(f"it replicates {n.name}, which directive #{before} {_json(ctx.directive(before))} "
                          f"already replicates with other settings ({what})",
                          "replicate each region once (narrow one filter), or give both the same settings")
        devices = n.devices
        if d.devices is not None:
            if devices and tuple(sorted(devices)) != tuple(sorted(d.devices)):
                raise d.error(f"region {n.name} is placed on ranks {list(devices)} but replicate names "
                              f"{list(d.devices)}", "replicate over the ranks the region is placed on "
                              "(or leave out 'devices')")
            devices = tuple(d.devices)
        dag.replace(n.with_(devices=devices).with_attrs(replicated=True, replicated_by=d.index, **mine))
    return dag


def apply_split(dag: TrainingDAG, d: Split, ctx: PassContext) -> TrainingDAG:
    if dag.meta.split is not None:
        raise d.error("the model is already split into micro-batches", "give one split directive")
    nodes = match(dag, d, d.filter, ctx)
    missing = [n.name for n in _compute(dag) if n not in nodes]
    if missing:
        raise d.error(f"split covers only part of the model (not {missing})",
                      "split the whole model: use an empty filter {}")
    m = d.num_microbatches
    if m > 1 and (not ctx.batch_symbols or ctx.static_batch_op):
        mb = ctx.batch_size // m if m else "?"
        if not ctx.batch_symbols:
            where = f" The graph fixes it at {ctx.static_batch_op}." if ctx.static_batch_op else ""
            problem = f"the captured graph has a static batch size {ctx.batch_size}, so it cannot run on " \
                      f"micro-batches of {mb}.{where}"
        else:
            problem = f"the captured graph reshapes across the batch dimension at {ctx.static_batch_op}, so " \
                      f"micro-batches of {mb} would not compute what the batch of {ctx.batch_size} does"
        raise d.error(
            problem,
            "compile with dynamic=True (or torch._dynamo.mark_dynamic(x, 0)) and write the model with "
            "x.shape[0] / -1 instead of a literal batch size")
    if m > 1 and ctx.specialized_input is not None:
        raise d.error(
            f"input {ctx.specialized_input!r} had a dynamic batch size when Dynamo traced it, but a guard fixed "
            f"it at {ctx.batch_size} (a torch._check or a comparison of its shape[0] with a number) while other "
            "inputs keep the batch dynamic, so micro-batches would cut them and not it",
            "remove the check on the batch size, or compare it with another input's shape[0]")
    if ctx.batch_size and ctx.batch_size % m:
        raise d.error(f"the local batch of {ctx.batch_size} does not divide into {m} micro-batches",
                      f"use a batch size that is a multiple of {m}, or a micro-batch count that divides it")
    out = TrainingDAG(meta=dag.meta.copy(), segments=dag.segments)
    produced = set(dag.producers())

    def rename(v: str, k: int) -> str:
        return f"{v}@mb{k}" if (v in produced or ctx.is_batched(v)) else v

    for n in dag:
        assert isinstance(n.op, SegmentOp), n.name  # the split comes before any lowering
        for k in range(m):
            op = dataclasses.replace(n.op, loss=rename(n.op.loss, k) if n.op.loss else None,
                                     grads=tuple((rename(v, k), fqn) for v, fqn in n.op.grads))
            out.add(n.with_(name=f"{n.name}.mb{k}", op=op, tags=tuple(sorted({**n.tag_dict, d.dim_name: k}.items())),
                            inputs=tuple(rename(v, k) for v in n.inputs),
                            outputs=tuple(rename(v, k) for v in n.outputs)).with_attrs(mb=k))
    for a, b in dag.order_edges:
        for k in range(m):
            out.add_order(f"{a}.mb{k}", f"{b}.mb{k}")
    out.meta.split, out.meta.mb_tag, out.meta.split_by = m, d.dim_name, d.index
    return out


def _check_microbatches(dag: TrainingDAG, d: Order, ctx: PassContext) -> None:
    """An order that names micro-batches must name every one the split made (a schedule built for 2
    micro-batches used with split(4) would leave 2 of them in no stated order)."""
    if dag.meta.split is None:  # not split yet: match() says to put the split first
        return
    tag, m = dag.meta.mb_tag, dag.meta.split
    named = {f[tag] for g in d.filters for f in g if isinstance(f.get(tag), int)}
    if named and named != set(range(m)):
        split = ctx.directive(dag.meta.split_by if dag.meta.split_by is not None else -1)
        by = f"directive #{split.index} {_json(split)} splits" if split is not None else "the step has"
        missing = sorted(set(range(m)) - named)
        raise d.error(f"it orders micro-batches {sorted(named)} but {by} {m} micro-batch(es)"
                      + (f": {missing} would run in no stated order" if missing else ""),
                      f"build the schedule for {m} micro-batches (e.g. one_f_one_b(stages, {m})), or use '*' for "
                      "the micro-batch index")


def apply_order(dag: TrainingDAG, d: Order, ctx: PassContext) -> TrainingDAG:
    groups: list[list[Node]] = []
    for flts in d.filters:
        nodes: list[Node] = []
        for f in flts:
            if ctx.forward_only and f.get("PASS") not in (None, ANY, "F"):
                continue
            for n in match(dag, d, f, ctx, allow_empty=ctx.forward_only):
                if n not in nodes:
                    nodes.append(n)
        if nodes:
            groups.append(nodes)
    devs = {n.devices for g in groups for n in g}
    if len(devs) > 1:
        raise d.error(f"order spans regions on different device groups {sorted(map(list, devs))}; order edges "
                      "only sequence work on one device group", "write one order directive per device group "
                      "(cross-device order follows from the data and the sends/receives)")
    by = dag.meta.order_by
    for before, after in zip(groups, groups[1:]):
        for a in before:
            for b in after:
                dag.add_order(a.name, b.name)
                by[(a.name, b.name)] = d.index
    cycle = dag.find_cycle()
    if cycle:
        raise d.error(f"the order forms a cycle: {' -> '.join(cycle)} (a step would have to run before "
                      "itself, e.g. a backward before its forward or a later stage's data)",
                      "order steps consistently with the data flow (F before B of the same micro-batch)")
    _check_microbatches(dag, d, ctx)
    return dag


def apply_checkpoint(dag: TrainingDAG, d: Checkpoint, ctx: PassContext) -> TrainingDAG:
    """The recomputation itself happens when the joint graph is cut (``capture/checkpointing.py``): the
    backward segments of the matched regions already recompute; here the filter is checked like any
    other directive's."""
    match(dag, d, d.filter, ctx)
    return dag


DIRECTIVE_PASSES: dict[type, Callable[[TrainingDAG, Directive, PassContext], TrainingDAG]] = {
    Place: apply_place, Split: apply_split, Replicate: apply_replicate, Order: apply_order,  # type: ignore
    Checkpoint: apply_checkpoint,  # type: ignore
}
