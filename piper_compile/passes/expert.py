"""Expert parallelism: the ``shard`` directive and its lowering.

``shard`` marks the MoE expert steps (segments that are one ``piper::moe_experts`` op, or its backward)
of the matched regions. Lowering replaces each marked step by a chain on the expert-parallel group::

    forward:  COUNTS (A2A of per-expert counts, its own group) -> DISPATCH (A2A of the rows, sized by
              the counts) -> EXPERTS (local) -> COMBINE (A2A back) -> UNPERMUTE
    backward: DISPATCH (A2A of output grads) -> EXPERTS (local backward) -> COMBINE -> UNPERMUTE

The backward reuses the forward's routing (``route`` value: slot order, split sizes, counts) and the
tokens it received (``recv``), as an autograd all-to-all would save them. Expert weights are held as
local shards ``[E / ep, ...]`` on each rank; their gradients already sum every rank's tokens, so they
are not reduced across the group (``dag.meta["ep_params"]`` lists them for the gradient passes).
"""
from __future__ import annotations

import operator

from torch import fx

from piper_compile.capture.segments import boundary_kind
from piper_compile.directives.spec import Shard
from piper_compile.errors import PiperDirectiveError
from piper_compile.ir.dag import Kind, Node, TrainingDAG, param_fqn
from piper_compile.passes.context import PassContext
from piper_compile.passes.directive_passes import check_ranks, match

EP_ATTRS = ("ep_by", "ep_devices", "ep_stream")


def apply_shard(dag: TrainingDAG, d: Shard, ctx: PassContext) -> TrainingDAG:
    """Mark the expert steps of the matched regions for expert parallelism over ``d.devices``."""
    check_ranks(d, d.devices, ctx)
    nodes = [n for n in match(dag, d, d.filter, ctx) if n.attr("boundary") in ("moe_fwd", "moe_bwd")]
    if not nodes:
        raise d.error(f"filter {d.filter} matches no MoE experts op (piper_compile.nn.MoE / "
                      "piper_compile.nn.moe_experts), so there is nothing to shard",
                      "annotate the MoE layers (e.g. piper.annotate(block.moe, EP=i)) and filter on that tag; "
                      "a custom MoE layer must compute its experts with piper_compile.nn.moe_experts")
    for n in nodes:
        dag.replace(n.with_attrs(ep_by=d.index, ep_devices=d.devices, ep_stream=d.stream))
    return dag


def _derived(value: str, what: str) -> str:
    """``y@mb3`` -> ``y.what@mb3`` (the micro-batch suffix stays last)."""
    base, sep, mb = value.partition("@mb")
    return f"{base}.{what}{sep}{mb}"


def _op_node(ctx: PassContext, n: Node) -> fx.Node:
    """The expert op of step ``n``'s segment."""
    return next(x for x in ctx.segments[n.attr("segment")].gm.graph.nodes if boundary_kind(x))


def _op_args(ctx: PassContext, n: Node) -> dict[int, str]:
    """Argument position of the op -> the node's input value (through the segment's placeholders)."""
    phs = {p.name: i for i, p in enumerate(ctx.segments[n.attr("segment")].gm.graph.find_nodes(op="placeholder"))}
    return {k: n.inputs[phs[a.name]] for k, a in enumerate(_op_node(ctx, n).args)}


def _group(n: Node) -> tuple[int, ...]:
    devices = n.attr("ep_devices")
    group = tuple(devices) if devices is not None else n.devices
    if sorted(group) != sorted(n.devices):
        raise PiperDirectiveError(n.attr("ep_by"), {"shard": n.name},
                                  f"shard splits experts over ranks {list(group)} but {n.name} runs on ranks "
                                  f"{list(n.devices)}; expert parallelism shares the ranks of the data-parallel "
                                  "group the layer is replicated over", "leave out 'devices' (or name the ranks "
                                  "the region is placed on)")
    return tuple(n.devices)


def _chain(dag: TrainingDAG, n: Node, group: tuple[int, ...], steps: list[tuple[str, Kind, tuple[str, ...],
           tuple[str, ...], dict[str, object]]]) -> None:
    stream = n.attr("ep_stream") or "ep"
    base = {k: v for k, v in n.attrs if k not in EP_ATTRS + ("grads", "boundary")}  # keeps the op's segment
    names = []
    for role, kind, ins, outs, extra in steps:
        attrs = {**base, "ep_role": role, "ep_group": group, **extra}
        if kind is Kind.ALL_TO_ALL:
            attrs = {"ep_role": role, "ep_group": group, "mb": n.attr("mb", 0), "purpose": "ep", **extra}
        # the counts exchange has a group of its own: it never queues behind the rows another chain has in flight
        comm_stream = f"{stream}_counts" if role == "counts" else stream
        node = Node(f"{n.name}.{role}", kind, n.tags, group, comm_stream if kind.is_comm else n.stream,
                    ins, outs, tuple(sorted(attrs.items())))
        dag.add(node)
        if names:
            dag.add_order(names[-1], node.name)
        names.append(node.name)
    dag.substitute(n.name, names[0], names[-1])


def lower_expert_parallel(dag: TrainingDAG, ctx: PassContext) -> TrainingDAG:
    """Replace every expert step marked by ``shard`` (on more than one rank) by its all-to-all chain."""
    marked = [n for n in dag.of_kind(Kind.COMPUTE) if n.attr("ep_by") is not None]
    ep_params: dict[str, tuple[tuple[int, ...], int, str]] = dag.meta.setdefault("ep_params", {})
    fwd_of: dict[str, Node] = {}  # routing (idx) value -> forward step
    for n in marked:
        if n.attr("boundary") == "moe_fwd":
            fwd_of[_op_args(ctx, n)[1]] = n
    for n in marked:
        group = _group(n)
        if len(group) == 1:
            dag.replace(n.with_(attrs=tuple((k, v) for k, v in n.attrs if k not in EP_ATTRS)))
            continue
        args = _op_args(ctx, n)
        w0 = 2 if n.attr("boundary") == "moe_fwd" else 3
        experts = int(_op_node(ctx, n).args[w0].meta["val"].shape[0])
        if experts % len(group):
            raise PiperDirectiveError(n.attr("ep_by"), {"shard": n.name},
                                      f"{experts} experts do not split evenly over {len(group)} ranks {list(group)}",
                                      f"use a number of experts divisible by {len(group)}, or shard over fewer ranks")
        weights = tuple(args[w0 + i] for i in range(3))
        for w in weights:
            ep_params[param_fqn(w)] = (group, experts, n.attr("ep_stream") or "ep")  # type: ignore[index]
        info: dict[str, object] = {"experts": experts}
        fwd_seg = ctx.segments[(n if n.attr("boundary") == "moe_fwd" else fwd_of.get(args[2], n)).attr("segment")]
        if fwd_seg.boundary == "moe_fwd":  # rows x features each all-to-all moves (the simulator's cost)
            info["shape"], info["dtype"] = fwd_seg.out_meta[fwd_seg.outputs[0]]
        if n.attr("boundary") == "moe_fwd":
            x, idx, y = args[0], args[1], n.outputs[0]
            recv, route, yrecv, yback, counts = (_derived(y, w) for w in ("recv", "route", "yrecv", "yback",
                                                                           "counts"))
            _chain(dag, n, group, [
                ("counts", Kind.ALL_TO_ALL, (idx,), (counts,), {"experts": experts}),  # no rows: latency only
                ("dispatch", Kind.ALL_TO_ALL, (x, idx, counts), (recv, route), info),
                ("experts", Kind.COMPUTE, (recv, route) + weights, (yrecv,), info),
                ("combine", Kind.ALL_TO_ALL, (yrecv, route), (yback,), info),
                ("unpermute", Kind.COMPUTE, (yback, route), (y,), info),
            ])
        else:
            f = fwd_of.get(args[2])
            if f is None:
                raise PiperDirectiveError(n.attr("ep_by"), {"shard": n.name},
                                          f"the backward expert step {n.name} is sharded but its forward is not",
                                          "let the shard filter match the forward and backward of the MoE region")
            y = f.outputs[0]
            recv, route = _derived(y, "recv"), _derived(y, "route")
            gy = args[0]
            seg = ctx.segments[n.attr("segment")]
            grad_outs = _grad_outputs(seg, n)
            ggrecv, gxrecv, gxback = (_derived(y, w) for w in ("grecv", "gxrecv", "gxback"))
            gx = grad_outs.get(0)
            ws = tuple(grad_outs.get(i + 1) or _derived(y, f"gw{i}") for i in range(3))
            grads = dict(n.attr("grads") or ())
            if all(w in grads for w in ws):  # the step adds the weight grads straight into their buffers
                extra: dict[str, object] = {"grads": tuple((w, grads[w]) for w in ws), "accumulate_grads": True}
            else:
                extra = {"grads": n.attr("grads")}
            chain = [
                ("dispatch", Kind.ALL_TO_ALL, (gy, route), (ggrecv,), info),
                ("experts", Kind.COMPUTE, (ggrecv, route, recv) + weights, (gxrecv,) + ws, {**info, **extra}),
            ]
            if gx is not None:
                chain += [("combine", Kind.ALL_TO_ALL, (gxrecv, route), (gxback,), info),
                          ("unpermute", Kind.COMPUTE, (gxback, route), (gx,), info)]
            _chain(dag, n, group, chain)
    return dag


def _grad_outputs(seg: object, n: Node) -> dict[int, str]:
    """Output index of the backward op (0: input grad, 1-3: weight grads) -> the node's output value."""
    out_node = seg.gm.graph.find_nodes(op="output")[0]  # type: ignore[attr-defined]
    where = {a.name: i for i, a in enumerate(out_node.args[0])}
    res: dict[int, str] = {}
    for x in seg.gm.graph.nodes:  # type: ignore[attr-defined]
        if x.op == "call_function" and x.target is operator.getitem and x.name in where:
            res[int(x.args[1])] = n.outputs[where[x.name]]
    return res
