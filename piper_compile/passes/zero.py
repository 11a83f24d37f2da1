"""ZeRO lowering: the shard layout of every ZeRO group, and (ZeRO-3) the parameter all-gathers placed
before each compute step that reads sharded parameters.

Layout: a ZeRO group's parameters are cut into the same buckets as gradient reduction (one per
backward chunk, in the order gradients finish), so reduce-scatter, the sharded update and the
all-gather all work on one flat buffer per bucket. Parameters also used by another device group
(tied weights across pipeline stages) stay whole and are all-reduced: their gradient is shared
between groups and they are not sharded.
"""
from __future__ import annotations

import json
from collections import defaultdict

from piper_compile.errors import PiperDirectiveError
from piper_compile.ir.dag import PARAM_PREFIX as PARAM, Kind, Node, TrainingDAG, param_fqn
from piper_compile.ir.meta import ZeroGroup
from piper_compile.ir.ops import ParamGather
from piper_compile.ir.ranks import compact
from piper_compile.ir.order import schedule_order
from piper_compile.passes.context import PassContext
from piper_compile.passes.tensor_parallel import dp_subgroups

def group_label(devices: tuple[int, ...]) -> str:
    """``r0_1``, ``r0-3``, ``r0-16376:8``: a device group in node and bucket names."""
    return "r" + compact(tuple(devices), "_")


def holders(dag: TrainingDAG) -> dict[str, set[tuple[int, ...]]]:
    """Device groups that read each parameter."""
    by_group: dict[int, tuple[tuple[int, ...], set[str]]] = {}  # by identity: no hashing per node
    for n in dag.of_kind(Kind.COMPUTE):
        fqns = by_group.setdefault(id(n.devices), (n.devices, set()))[1]
        fqns.update(f for f in map(param_fqn, n.inputs) if f is not None)
    out: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for devices, fqns in by_group.values():
        for f in fqns:
            out[f].add(devices)
    return out


def zero_layout(dag: TrainingDAG, ctx: PassContext) -> dict[tuple[int, ...], ZeroGroup]:
    """Shard buckets of every group replicated with zero >= 1 over more than one rank; the same in the
    training and the forward-only DAG (it is derived from the segments, not from the backward nodes).
    Computed once per DAG and kept in ``dag.meta.zero``."""
    if dag.meta.zero is None:
        dag.meta.zero = _layout(dag, ctx)
    return dag.meta.zero


_GROUP_SETTINGS = ("zero", "gather_stream", "prefetch", "reduce_mb")


def check_group_settings(dag: TrainingDAG, ctx: PassContext) -> None:
    """Regions replicated on one device group share its ZeRO layout (one shard layout, gather stream and
    prefetch per group): two replicate directives that disagree on them for one group are an error."""
    first: dict[tuple[int, ...], Node] = {}
    for n in dag.of_kind(Kind.COMPUTE):
        if n.attr("replicated_by") is None or len(n.devices) < 2:
            continue
        m = first.setdefault(n.devices, n)
        differ = [k for k in _GROUP_SETTINGS if m.attr(k) != n.attr(k)]
        if differ:
            a, b = ctx.directive(m.attr("replicated_by")), ctx.directive(n.attr("replicated_by"))
            what = ", ".join(f"{k} {m.attr(k)!r} vs {n.attr(k)!r}" for k in differ)
            raise PiperDirectiveError(
                b.index if b is not None else None, b.to_json() if b is not None else {"region": n.name},
                f"it replicates {n.name} on ranks {list(n.devices)}, where directive #{m.attr('replicated_by')} "
                f"{json.dumps(a.to_json(), sort_keys=True) if a is not None else ''} replicates {m.name} with other ZeRO settings ({what}); "
                "the regions of one device group share one shard layout",
                "give every replicate directive of a device group the same zero/prefetch/gather_stream settings")


def _layout(dag: TrainingDAG, ctx: PassContext) -> dict[tuple[int, ...], ZeroGroup]:
    check_group_settings(dag, ctx)
    by_region: dict[object, Node] = {}
    for n in dag.of_kind(Kind.COMPUTE):
        if n.attr("zero", 0) and _sharding_ranks(n) > 1:
            by_region.setdefault(ctx.segments[n.op.segment].region, n)  # type: ignore[attr-defined]
    if not by_region:
        return {}
    held = holders(dag)
    groups: dict[tuple[int, ...], ZeroGroup] = {}
    for seg in ctx.segments.values():
        n = by_region.get(seg.region)
        if n is None or seg.pass_ not in ("B", "BI", "BW") or not seg.grads:  # BI: e.g. layer-norm weight grads
            continue
        tp = n.attr("tp_groups")
        g = groups.setdefault(n.devices, ZeroGroup(n.devices, n.attr("zero"), n.attr("gather_stream", "dp_gather"),
                                                   n.attr("prefetch", 1), bool(n.attr("reduce_mb", False)),
                                                   subgroups=dp_subgroups(tp) if tp else None))
        # expert shards stay local; sequence-parallel partial gradients are summed over the whole group
        fqns = [f for _, f in seg.grads if f not in dag.meta.ep_params and f not in ctx.tp_partial]
        # a gradient written in parts by several segments of one group (capture/grad_parts.py splits only
        # across groups, but the place pass decides): in the first one's bucket; its reduction waits for all
        placed = set(g.whole) | {f for _, b in g.buckets for f in b}
        fqns = [f for f in fqns if f not in placed]
        g.whole += [f for f in fqns if len(held.get(f, ())) > 1]
        sharded = tuple(f for f in fqns if len(held.get(f, ())) <= 1)
        if sharded:
            g.buckets.append((f"{group_label(n.devices)}.b{len(g.buckets)}", sharded))
    return groups


def _sharding_ranks(n: Node) -> int:
    """How many ranks share the ZeRO shards of ``n``'s region: its group, or under tensor parallelism a
    data-parallel subgroup (a tensor-parallel group alone has no replica to shard with)."""
    tp = n.attr("tp_groups")
    return len(dp_subgroups(tp)[0]) if tp else len(n.devices)


def _compute_order(dag: TrainingDAG) -> list[Node]:

    return [dag.nodes[name] for name in schedule_order(dag) if dag.nodes[name].kind is Kind.COMPUTE]


def insert_param_gather(dag: TrainingDAG, ctx: PassContext) -> TrainingDAG:
    """ZeRO-3: before every compute step that reads sharded parameters, one ALL_GATHER per bucket it
    reads, issued ``prefetch`` compute steps earlier on the same ranks; the gathered parameters are
    values of that step alone, so the runtime frees them right after it (resharding between
    micro-batches: peak parameter memory is a few buckets, not the stage)."""
    layout = {g: z for g, z in zero_layout(dag, ctx).items() if z.level >= 3}
    if not layout:
        return dag
    order = _compute_order(dag)
    for group, z in layout.items():
        _gather_for_group(dag, [n for n in order if n.devices == group], z)
    return dag


def _gather_for_group(dag: TrainingDAG, steps: list[Node], z: ZeroGroup) -> None:
    """The ALL_GATHERs of one ZeRO-3 group; consecutive compute steps reading one bucket share a gather
    (e.g. two forward chunks of a micro-batch), which is freed after the last of them."""
    bucket_of = z.bucket_of()
    fqns_of = dict(z.buckets)
    last: dict[str, tuple[int, str]] = {}  # bucket -> (index of the step that last gathered it, AG name)
    for i, n in enumerate(steps):
        needed: dict[str, list[str]] = defaultdict(list)
        for f in map(param_fqn, n.inputs):
            if f in bucket_of:
                needed[bucket_of[f]].append(f)
        rename: dict[str, str] = {}
        for b in sorted(needed, key=lambda b: int(b.rsplit(".b", 1)[1])):
            prev = last.get(b)
            if prev is not None and prev[0] == i - 1:  # share the previous step's gather
                ag = dag.nodes[prev[1]]
                tag = ag.op.for_step  # type: ignore[attr-defined]
                outs = tuple(f"{PARAM}{f}#{tag}" for f in needed[b])
                dag.replace(ag.with_(outputs=tuple(dict.fromkeys(ag.outputs + outs))))
            else:
                tag = n.name
                outs = tuple(f"{PARAM}{f}#{tag}" for f in needed[b])
                ag = dag.add(Node(f"AG.{b}@{tag}", ParamGather(b, tuple(fqns_of[b]), z.level, tag), n.tags, z.devices,
                                  z.gather_stream, (), outs))
                at = i - 1 - z.prefetch
                if at >= 0:
                    dag.add_order(steps[at].name, ag.name)
            last[b] = (i, ag.name)
            rename.update({f"{PARAM}{f}": o for f, o in zip(needed[b], outs)})
        if rename:
            dag.replace(n.with_(inputs=tuple(rename.get(v, v) for v in n.inputs)))
