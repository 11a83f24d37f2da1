"""Lowering passes run after the user's directives: default placement, SEND/RECV on cross-group
edges, bucketed gradient reduction, tied-parameter gradient transfer, optimizer updates, loss reduce."""
from __future__ import annotations

from collections import defaultdict

from piper_compile.errors import PiperDirectiveError, PiperError
from piper_compile.ir.dag import Kind, Node, TrainingDAG, make_tags
from piper_compile.ir.ops import (GradReduce, LossReduce, NormReduce, ParamGather, Recv, RecvPart, Send, TpCollective,
                                  Update)
from piper_compile.passes.context import PassContext
from piper_compile.passes.expert import lower_expert_parallel
from piper_compile.passes.tensor_parallel import dp_subgroups, lower_tensor_parallel
from piper_compile.passes.zero import ZeroGroup, group_label, holders, insert_param_gather, zero_layout

P2P_FWD, P2P_BWD, P2P_GRAD, LOSS_STREAM, NORM_STREAM = "pp_fwd", "pp_bwd", "pp_grad", "loss", "norm"


def lower_placement(dag: TrainingDAG, ctx: PassContext) -> TrainingDAG:
    """Unplaced work runs on every rank; a multi-rank group must be replicated; groups have one size."""
    for n in list(dag):
        if n.kind is Kind.COMPUTE and not n.devices:
            dag.replace(n.with_(devices=ctx.world))
    sizes: set[int] = set()
    for n in dag.of_kind(Kind.COMPUTE):
        sizes.add(len(n.devices))
        if len(n.devices) > 1 and not n.attr("replicated") and n.attr("tp_by") is None:
            idx = n.attr("placed_by")
            how = f"place directive #{idx} puts it" if idx is not None else "with no place directive it runs"
            raise PiperDirectiveError(
                idx, {"region": n.name}, f"{n.name} runs on {len(n.devices)} ranks {list(n.devices)} ({how} on a "
                "group) but no replicate directive covers it, so the replicas would train apart",
                'add {"op": "replicate", "filter": {...}} for it, or place it on a single rank')
    if len(sizes) > 1:
        raise PiperDirectiveError(None, {"group_sizes": sorted(sizes)},
                                  f"regions are placed on device groups of different sizes {sorted(sizes)}",
                                  "give every stage the same number of data-parallel replicas")
    used = {r for n in dag.of_kind(Kind.COMPUTE) for r in n.devices}
    idle = sorted(set(ctx.world) - used)
    if idle:
        raise PiperDirectiveError(None, {"world_size": ctx.world_size},
                                  f"the directives use ranks {sorted(used)} but the world has {ctx.world_size} ranks "
                                  f"(ranks {idle} would idle and wait forever)",
                                  f"launch {len(used)} processes, or place work on every rank")
    _check_order_devices(dag)
    return dag


def _check_order_devices(dag: TrainingDAG) -> None:
    for (a, b), idx in dag.meta.order_by.items():
        if a in dag.nodes and b in dag.nodes and dag.nodes[a].devices != dag.nodes[b].devices:
            raise PiperDirectiveError(idx, {"order": [a, b]}, f"orders {a} (ranks {list(dag.nodes[a].devices)}) "
                                      f"before {b} (ranks {list(dag.nodes[b].devices)}): different device groups",
                                      "order only work placed on the same ranks")


def _recv_meta(ctx: PassContext, producer: Node, value: str) -> tuple[tuple[str, ...], str]:
    if isinstance(producer.op, TpCollective):  # a collective standing for a marker step (tensor parallel)
        return producer.op.shape, producer.op.dtype
    seg = ctx.segments[producer.op.segment]  # type: ignore[attr-defined]
    base = value.rsplit("@mb", 1)[0]
    return seg.out_meta[base]


def insert_p2p(dag: TrainingDAG, ctx: PassContext) -> TrainingDAG:
    """Every value consumed on another device group travels by one SEND/RECV pair per target group."""
    prod = dag.producers()
    renames: dict[tuple[str, tuple[int, ...]], str] = {}
    for consumer in list(dag.of_kind(Kind.COMPUTE)):
        new_inputs = list(consumer.inputs)
        for i, v in enumerate(consumer.inputs):
            p = dag.nodes.get(prod.get(v, ""))
            if p is None or p.devices == consumer.devices:
                continue
            if set(p.devices) & set(consumer.devices):
                raise PiperError(f"piper: {p.name} (ranks {list(p.devices)}) feeds {consumer.name} (ranks "
                                 f"{list(consumer.devices)}): device groups that overlap partly cannot exchange "
                                 "data; place stages on disjoint rank groups")
            key = (v, consumer.devices)
            if key not in renames:
                renames[key] = _add_send_recv(dag, ctx, p, consumer, v)
            new_inputs[i] = renames[key]
        if new_inputs != list(consumer.inputs):
            dag.replace(consumer.with_(inputs=tuple(new_inputs)))
    return dag


def _add_send_recv(dag: TrainingDAG, ctx: PassContext, p: Node, c: Node, v: str) -> str:
    stream = c.attr("p2p_stream") or (P2P_FWD if p.tag("PASS") == "F" else P2P_BWD)
    dst = group_label(c.devices)
    shape, dtype = _recv_meta(ctx, p, v)
    if dtype == "sym":  # capture recomputes scalars in the consuming region (capture/segments.py: _segment_graph)
        raise PiperError(f"piper: internal: the scalar {v} produced by {p.name} (ranks {list(p.devices)}) would be "
                         f"received by {c.name} (ranks {list(c.devices)}) as a tensor; scalars must be recomputed "
                         "on the consuming ranks. Please report this with the model")
    out = f"{v}>{dst}"
    tags = tuple((k, val) for k, val in p.tags)
    mb = p.attr("mb", 0)
    send = Node(f"SEND.{v}>{dst}", Send(out, c.devices, mb), tags, p.devices, stream, (v,), ())
    recv = Node(f"RECV.{v}>{dst}", Recv(out, p.devices, tuple(shape), dtype, mb), tags, c.devices, stream, (), (out,))
    dag.add(send)
    dag.add(recv)
    return out


def _grad_writers(dag: TrainingDAG) -> dict[str, list[Node]]:
    writers: dict[str, list[Node]] = defaultdict(list)
    for n in dag.of_kind(Kind.COMPUTE):
        for _, fqn in n.op.grad_outputs():
            writers[fqn].append(n)
    return writers


def _buckets(fqns: list[str], writers: dict[str, list[Node]]) -> list[list[str]]:
    """One bucket per backward segment (chunk): capture cut backward at bucket-size boundaries, so a
    bucket is complete as soon as its chunk of the last micro-batch has run."""
    out: list[list[str]] = []
    last = None
    for f in fqns:
        seg = writers[f][0].op.segment  # type: ignore[attr-defined]
        if seg != last:
            out.append([])
            last = seg
        out[-1].append(f)
    return out


def _sync_node(dag: TrainingDAG, name: str, kind: Kind, group: tuple[int, ...], stream: str,
               bucket: list[str] | tuple[str, ...], after: list[Node], zero: int, suffix: str = "",
               **extra: object) -> Node:
    """One gradient reduction (all-reduce or reduce-scatter) of a bucket, ordered after ``after``."""
    op = GradReduce(name.split(".", 1)[1], tuple(bucket), zero, kind is Kind.REDUCE_SCATTER, **extra)  # type: ignore[arg-type]
    node = dag.add(Node(name + suffix, op, make_tags({"BUCKET": name.rsplit(".", 1)[1]}), group, stream))
    for w in after:
        dag.add_order(w.name, node.name)
    return node


def _reduce_group(dag: TrainingDAG, group: tuple[int, ...], fqns: list[str], writers: dict[str, list[Node]],
                  z: ZeroGroup | None, ready_after: dict[str, list[str]],
                  subgroups: tuple[tuple[int, ...], ...] | None = None, label: str = "") -> list[str]:
    """Gradient reduction of one replicated group (within each of ``subgroups`` when tensor parallel;
    ``label`` tells apart several reductions of one group); returns the nodes its update waits for."""
    extra = {"subgroups": subgroups} if subgroups else {}
    stream = writers[fqns[0]][0].attr("reduce_stream", "dp")
    label = group_label(group) + label
    deps: list[str] = []
    if z is None:
        plan = [(f"AR.{label}.b{b}", Kind.ALL_REDUCE, bucket, 0) for b, bucket in enumerate(_buckets(fqns, writers))]
    else:
        kind = Kind.REDUCE_SCATTER if z.level >= 2 else Kind.ALL_REDUCE
        prefix = "RS" if z.level >= 2 else "AR"
        plan = [(f"{prefix}.{b}", kind, bucket, z.level) for b, bucket in z.buckets]
        whole = [f for f in fqns if f in set(z.whole)]
        plan += [(f"AR.{label}.t{b}", Kind.ALL_REDUCE, bucket, 0) for b, bucket in enumerate(_buckets(whole, writers))]
    for name, kind, bucket, level in plan:
        writes = [w for f in bucket for w in writers[f]]
        if z is not None and z.per_microbatch and kind is Kind.REDUCE_SCATTER:
            nodes = _sync_per_microbatch(dag, name, group, stream, bucket, writes, level)
        else:
            nodes = [_sync_node(dag, name, kind, group, stream, bucket, writes, level, **extra)]
        for f in bucket:
            ready_after[f] = [n.name for n in nodes]
        deps += [n.name for n in nodes]
    return deps


def _sync_per_microbatch(dag: TrainingDAG, name: str, group: tuple[int, ...], stream: str,
                         bucket: tuple[str, ...] | list[str], writes: list[Node], zero: int) -> list[Node]:
    """ZeRO-2/3 with ``reduce_per_microbatch``: one reduce-scatter of the bucket after each micro-batch's
    last writer, accumulated into the gradient shard; the next micro-batch writes the bucket only after
    it (so a full bucket never lives across micro-batches)."""
    by_mb: dict[int, list[Node]] = defaultdict(list)
    for w in writes:
        by_mb[w.attr("mb", 0)].append(w)
    nodes: list[Node] = []
    for k in sorted(by_mb):
        nodes.append(_sync_node(dag, name, Kind.REDUCE_SCATTER, group, stream, bucket, by_mb[k], zero,
                                f".mb{k}", per_microbatch=True, mb=k))
        if len(nodes) > 1:
            for w in by_mb[k]:
                dag.add_order(nodes[-2].name, w.name)
    return nodes


def _exchange_parts(dag: TrainingDAG, writers: dict[str, list[Node]], index: dict[str, int]) -> None:
    """A gradient written in parts on several device groups (a tied weight, ``capture/grad_parts.py``):
    each group accumulates its part over the micro-batches; once per step, after its last writer, every
    other group sends its (local, unreduced) part to the group whose writers finish last, which adds each
    in (``RecvPart``, after its own writers, in group order) before reducing it over its replicas; the
    finished gradient then goes back to the holders as any tied gradient does. ``writers`` keeps only
    that group's writers, plus the part receives (they write the gradient too).

    The finished gradient comes back into the buffer the part was sent from, with no order edge from the
    part's SEND (waiting for it before posting the receive would block the host until the root's last
    backward, which may need this rank's later activation gradients): it can only arrive after the root
    received the part, so the send has read the buffer by then."""
    for fqn, ws in list(writers.items()):
        if all(w.devices is ws[0].devices for w in ws):  # one group (without hashing groups of thousands)
            continue
        by_group: dict[tuple[int, ...], list[Node]] = defaultdict(list)
        for w in ws:
            by_group[w.devices].append(w)
        if len(by_group) < 2:
            continue
        root = max(by_group, key=lambda g: max(index[w.name] for w in by_group[g]))
        writers[fqn] = list(by_group[root])
        for src in sorted(set(by_group) - {root}):
            msg = f"part:{fqn}.{group_label(src)}>{group_label(root)}"
            send = dag.add(Node(f"SEND.{msg}", Send(msg, root, state=fqn), (), src, P2P_GRAD))
            recv = dag.add(Node(f"RECV.{msg}", RecvPart(msg, src, state=fqn), (), root, P2P_GRAD))
            for w in by_group[src]:
                dag.add_order(w.name, send.name)
            for w in writers[fqn]:  # own writers and earlier groups' parts first: one summation order
                dag.add_order(w.name, recv.name)
            writers[fqn].append(recv)


def insert_grad_sync(dag: TrainingDAG, ctx: PassContext) -> TrainingDAG:
    """Bucketed gradient reduction per replicated group (once per step, after the bucket's last
    backward): ALL_REDUCE, or REDUCE_SCATTER for ZeRO-2/3; tied-gradient SEND/RECV to the other
    holders; the global gradient norm when clipping; one UPDATE per device group, followed for
    ZeRO-1/2 by the all-gather of the updated parameters."""
    if ctx.forward_only:
        return dag
    writers = _grad_writers(dag)
    held = holders(dag)
    layout = zero_layout(dag, ctx)
    index = {name: i for i, name in enumerate(dag.nodes)}
    _exchange_parts(dag, writers, index)
    index = {name: i for i, name in enumerate(dag.nodes)}
    by_group: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for fqn, ws in writers.items():
        by_group[ws[0].devices].append(fqn)
    ready_after: dict[str, list[str]] = {}  # fqn -> nodes after which its final gradient is ready
    update_deps: dict[tuple[int, ...], list[str]] = defaultdict(list)
    ep = dag.meta.ep_params
    for group, fqns in by_group.items():
        # Bucket in the order gradients finish: by the position of the last backward writing them.
        fqns.sort(key=lambda f: max(index[w.name] for w in writers[f]))
        tp = next((w.attr("tp_groups") for f in fqns for w in writers[f] if w.attr("tp_groups")), None)
        sub = dp_subgroups(tp) if tp else None
        alone = len(group) == 1 or (sub is not None and len(sub[0]) == 1)  # nothing to reduce with
        partial = [f for f in fqns if f in ctx.tp_partial]  # sequence parallel: summed over the whole group
        if partial:
            update_deps[group] += _reduce_group(dag, group, partial, writers, None, ready_after, label=".sp")
        rest = [f for f in fqns if f not in ep and f not in ctx.tp_partial]
        if not alone and rest:
            update_deps[group] += _reduce_group(dag, group, rest, writers, layout.get(group), ready_after, sub)
        for f in fqns:  # single-rank groups and expert shards: final as soon as written, nothing to reduce
            if (alone or f in ep) and f not in ctx.tp_partial:
                ready_after[f] = [w.name for w in writers[f]]
                update_deps[group].extend(ready_after[f])
    for fqn, groups in held.items():
        if fqn not in writers:
            continue
        src = writers[fqn][0].devices  # one group: the parts were exchanged (``_exchange_parts``)
        for dst in sorted(groups - {src}):
            msg = f"grad:{fqn}>{group_label(dst)}"
            send = dag.add(Node(f"SEND.{msg}", Send(msg, dst, state=fqn), (), src, P2P_GRAD))
            recv = dag.add(Node(f"RECV.{msg}", Recv(msg, src, state=fqn), (), dst, P2P_GRAD))
            for r in ready_after[fqn]:
                dag.add_order(r, send.name)
            update_deps[dst].append(recv.name)
    norm = _insert_grad_norm(dag, ctx, update_deps)
    for group in sorted({n.devices for n in dag.of_kind(Kind.COMPUTE)}):
        _insert_update(dag, group, held, writers, by_group, layout.get(group), update_deps[group] + norm)
    return dag


def _insert_grad_norm(dag: TrainingDAG, ctx: PassContext, update_deps: dict[tuple[int, ...], list[str]]) -> list[str]:
    """options['clip_grad_norm'] (and fp16 loss scaling, whose inf/NaN check it is): one world all-reduce
    of the squared gradient norm, after every
    gradient is final on every group and before any update."""
    if ctx.clip_grad_norm is None and not ctx.loss_scaling:
        return []
    node = dag.add(Node("AR.gradnorm", NormReduce(ctx.clip_grad_norm or 0.0), (), ctx.world, NORM_STREAM))
    for deps in update_deps.values():
        for d in deps:
            dag.add_order(d, node.name)
    return [node.name]


def _insert_update(dag: TrainingDAG, group: tuple[int, ...], held: dict[str, set[tuple[int, ...]]],
                   writers: dict[str, list[Node]], by_group: dict[tuple[int, ...], list[str]],
                   z: ZeroGroup | None, deps: list[str]) -> None:
    params = sorted(f for f, gs in held.items() if group in gs and f in writers)
    params += sorted(f for f in by_group.get(group, []) if f not in params)
    # gradient-norm accounting: each gradient counted once in the world (by its writer group)
    own = tuple(sorted(set(by_group.get(group, ()))))
    # expert shards: every rank updates (and counts in the gradient norm) its own experts
    ep = tuple(sorted(f for f in params if f in dag.meta.ep_params))
    op = Update(tuple(params), own, ep, z.level if z is not None else 0,
                tuple(b for b, _ in z.buckets) if z is not None else ())
    upd = dag.add(Node(f"UPD.{group_label(group)}", op, (), group, "compute"))
    for dep in deps:
        dag.add_order(dep, upd.name)
    for n in dag.of_kind(Kind.COMPUTE):  # the update rewrites parameters every compute step reads
        if n.devices == group:
            dag.add_order(n.name, upd.name)
    if z is not None and z.level <= 2:  # the updated shards back into every replica's parameters
        for b, fqns in z.buckets:  # tensor parallel: within each data-parallel subgroup (its own node)
            for sub in z.subgroups or (group,):
                name = f"AG.{b}" + (f".{group_label(sub)}" if z.subgroups else "")
                ag = dag.add(Node(name, ParamGather(b, tuple(fqns), z.level), (), sub, z.gather_stream))
                dag.add_order(upd.name, ag.name)


def insert_loss_reduce(dag: TrainingDAG, ctx: PassContext) -> TrainingDAG:
    """The step's loss: local mean over micro-batches, then the mean over replicas on every rank."""
    holders = [n for n in dag.of_kind(Kind.COMPUTE) if getattr(n.op, "loss", None)]
    if not holders:
        raise PiperError("piper: internal: no segment produces the loss")
    dag.meta.loss_group = holders[0].devices
    if ctx.world_size == 1:
        return dag
    ar = dag.add(Node("AR.loss", LossReduce(holders[0].devices), (), ctx.world, LOSS_STREAM))
    for n in holders:
        dag.add_order(n.name, ar.name)
    return dag


LOWERING_PASSES = [lower_placement, lower_tensor_parallel, lower_expert_parallel, insert_p2p, insert_grad_sync, insert_param_gather, insert_loss_reduce]
