"""Expert parallelism: the ``shard`` directive and its lowering.

``shard`` marks the MoE expert steps (segments that are one ``piper::moe_experts`` op, or its backward)
of the matched regions. Lowering replaces each marked step by a chain on the expert-parallel group::

    forward:  COUNTS (A2A of per-expert counts, its own group) -> DISPATCH (A2A of the rows, sized by
              the counts) -> EXPERTS (local) -> COMBINE (A2A back) -> UNPERMUTE
    backward: DISPATCH (A2A of output grads) -> EXPERTS (local backward) -> COMBINE -> UNPERMUTE

The backward reuses the forward's routing (``route`` value: slot order, split sizes, counts) and the
tokens it received (``recv``), as an autograd all-to-all would save them. Expert weights are held as
local shards ``[E / ep, ...]`` on each rank; their gradients already sum every rank's tokens, so they
are not reduced across the group (``dag.meta.ep_params`` lists them for the gradient passes).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

from torch import fx

from piper_compile.capture.regions import boundary_kind
from piper_compile.directives.spec import Shard
from piper_compile.errors import PiperDirectiveError
from piper_compile.ir.dag import Kind, Node, TrainingDAG, param_fqn
from piper_compile.ir.meta import ExpertShard
from piper_compile.ir.ops import ExpertA2A, ExpertCounts, ExpertStep, Op
from piper_compile.ir.ops import Segment as SegmentOp
from piper_compile.passes.context import PassContext
from piper_compile.passes.directive_passes import check_ranks, match

EP_ATTRS = ("ep_by", "ep_devices", "ep_stream", "ep_load")


def apply_shard(dag: TrainingDAG, d: Shard, ctx: PassContext) -> TrainingDAG:
    """Mark the expert steps of the matched regions for expert parallelism over ``d.devices``."""
    check_ranks(d, d.devices, ctx)
    nodes = [n for n in match(dag, d, d.filter, ctx) if _boundary(n) in ("moe_fwd", "moe_bwd")]
    if not nodes:
        raise d.error(f"filter {d.filter} matches no MoE experts op (piper_compile.nn.MoE / "
                      "piper_compile.nn.moe_experts), so there is nothing to shard",
                      "annotate the MoE layers (e.g. piper.annotate(block.moe, EP=i)) and filter on that tag; "
                      "a custom MoE layer must compute its experts with piper_compile.nn.moe_experts")
    for n in nodes:
        load = {"ep_load": d.load} if d.load != 1.0 else {}  # balanced routing: no attribute
        dag.replace(n.with_attrs(ep_by=d.index, ep_devices=d.devices, ep_stream=d.stream, **load))
    return dag


def _boundary(n: Node) -> str | None:
    return n.op.boundary if isinstance(n.op, SegmentOp) else None


def _derived(value: str, what: str) -> str:
    """``y@mb3`` -> ``y.what@mb3`` (the micro-batch suffix stays last)."""
    base, sep, mb = value.partition("@mb")
    return f"{base}.{what}{sep}{mb}"


def _op_node(ctx: PassContext, n: Node) -> fx.Node:
    """The expert op of step ``n``'s segment."""
    return next(x for x in ctx.segments[n.op.segment].gm.graph.nodes if boundary_kind(x))  # type: ignore[attr-defined]


def _op_args(ctx: PassContext, n: Node) -> dict[int, str]:
    """Argument position of the op -> the node's input value (through the segment's placeholders)."""
    phs = {p.name: i for i, p in enumerate(ctx.segments[n.op.segment].gm.graph.find_nodes(op="placeholder"))}  # type: ignore[attr-defined]
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


Step = tuple[str, tuple[str, ...], tuple[str, ...], Op]  # (role, inputs, outputs, op)


def _chain(dag: TrainingDAG, n: Node, group: tuple[int, ...], steps: list[Step]) -> None:
    """Replace step ``n`` by ``steps`` in a chain, on the expert-parallel group."""
    stream = n.attr("ep_stream") or "ep"
    notes = tuple((k, v) for k, v in n.attrs if k not in EP_ATTRS)  # placement and replication stay
    names = []
    for role, ins, outs, op in steps:
        # the counts exchange has a group of its own: it never queues behind the rows another chain has in flight
        comm_stream = f"{stream}_counts" if role == "counts" else stream
        node = Node(f"{n.name}.{role}", op, n.tags, group, comm_stream if op.kind.is_comm else n.stream, ins, outs,
                    notes if op.kind is Kind.COMPUTE else (("mb", n.attr("mb", 0)),))
        dag.add(node)
        if names:
            dag.add_order(names[-1], node.name)
        names.append(node.name)
    dag.substitute(n.name, names[0], names[-1])


def lower_expert_parallel(dag: TrainingDAG, ctx: PassContext) -> TrainingDAG:
    """Replace every expert step marked by ``shard`` (on more than one rank) by its all-to-all chain."""
    marked = [n for n in dag.of_kind(Kind.COMPUTE) if n.attr("ep_by") is not None]
    ep_params = dag.meta.ep_params
    fwd_of = {_op_args(ctx, n)[1]: n for n in marked if _boundary(n) == "moe_fwd"}  # routing value -> forward
    for n in marked:
        group = _group(n)
        if len(group) == 1:
            dag.replace(n.with_(attrs=tuple((k, v) for k, v in n.attrs if k not in EP_ATTRS)))
            continue
        args = _op_args(ctx, n)
        forward = _boundary(n) == "moe_fwd"
        w0 = 2 if forward else 3
        experts = int(_op_node(ctx, n).args[w0].meta["val"].shape[0])
        if experts % len(group):
            raise PiperDirectiveError(n.attr("ep_by"), {"shard": n.name},
                                      f"{experts} experts do not split evenly over {len(group)} ranks {list(group)}",
                                      f"use a number of experts divisible by {len(group)}, or shard over fewer ranks")
        weights = tuple(args[w0 + i] for i in range(3))
        for w in weights:
            ep_params[param_fqn(w)] = ExpertShard(group, experts, n.attr("ep_stream") or "ep")  # type: ignore[index]
        fwd_seg = ctx.segments[(n if forward else fwd_of.get(args[2], n)).op.segment]  # type: ignore[attr-defined]
        rows: tuple[tuple[Any, ...], str] = ((), "")
        if fwd_seg.boundary == "moe_fwd":  # rows x features each all-to-all moves (the simulator's cost)
            shape, dtype = fwd_seg.out_meta[fwd_seg.outputs[0]]
            rows = (tuple(shape), dtype)
        chain = _forward_chain(n, args, weights, experts, rows) if forward else \
            _backward_chain(ctx, n, args, weights, experts, rows, fwd_of)
        load = _load(n, group)
        _chain(dag, n, group, [(role, i, o, dataclasses.replace(op, load=load)  # type: ignore[type-var]
                                if load != 1.0 and isinstance(op, (ExpertA2A, ExpertStep)) else op)
                               for role, i, o, op in chain])
    return dag


def _load(n: Node, group: tuple[int, ...]) -> float:
    """The ``shard`` directive's ``load`` (the busiest rank's rows over balanced routing), at most what the
    group can send one rank."""
    load = n.attr("ep_load") or 1.0
    if load > len(group):
        raise PiperDirectiveError(n.attr("ep_by"), {"shard": n.name},
                                  f"load {load} is more rows than a rank can receive: the {len(group)} ranks "
                                  f"{list(group)} send at most {len(group)}x balanced routing's rows to one rank",
                                  f"give a load between 1 and {len(group)}")
    return load


def _forward_chain(n: Node, args: dict[int, str], weights: tuple[str, ...], experts: int,
                   rows: tuple[tuple[Any, ...], str]) -> list[Step]:
    seg, label, mb = n.op.segment, n.op.label, n.attr("mb", 0)  # type: ignore[attr-defined]
    x, idx, y = args[0], args[1], n.outputs[0]
    recv, route, yrecv, yback, counts = (_derived(y, w) for w in ("recv", "route", "yrecv", "yback", "counts"))
    return [
        ("counts", (idx,), (counts,), ExpertCounts(experts, mb)),  # no rows: latency only
        ("dispatch", (x, idx, counts), (recv, route), ExpertA2A("dispatch", experts, *rows, mb=mb)),
        ("experts", (recv, route) + weights, (yrecv,), ExpertStep("experts", seg, label, experts, *_rows(rows))),
        ("combine", (yrecv, route), (yback,), ExpertA2A("combine", experts, *rows, mb=mb)),
        ("unpermute", (yback, route), (y,), ExpertStep("unpermute", seg, label, experts, *_rows(rows))),
    ]


def _rows(rows: tuple[tuple[Any, ...], str]) -> tuple[Any, ...]:
    """ExpertStep's positional fields after ``experts``: no gradients, no accumulation, the rows."""
    return ((), False, rows[0], rows[1])


def _backward_chain(ctx: PassContext, n: Node, args: dict[int, str], weights: tuple[str, ...], experts: int,
                    rows: tuple[tuple[Any, ...], str], fwd_of: dict[str, Node]) -> list[Step]:
    f = fwd_of.get(args[2])
    if f is None:
        raise PiperDirectiveError(n.attr("ep_by"), {"shard": n.name},
                                  f"the backward expert step {n.name} is sharded but its forward is not",
                                  "let the shard filter match the forward and backward of the MoE region")
    op: SegmentOp = n.op  # type: ignore[assignment]
    mb, y = n.attr("mb", 0), f.outputs[0]
    recv, route = _derived(y, "recv"), _derived(y, "route")
    grad_outs = _grad_outputs(ctx.segments[op.segment], n)
    ggrecv, gxrecv, gxback = (_derived(y, w) for w in ("grecv", "gxrecv", "gxback"))
    gx = grad_outs.get(0)
    ws = tuple(grad_outs.get(i + 1) or _derived(y, f"gw{i}") for i in range(3))
    grads = dict(op.grads)
    accumulate = all(w in grads for w in ws)  # the step adds the weight grads straight into their buffers
    step_grads = tuple((w, grads[w]) for w in ws) if accumulate else op.grads
    chain: list[Step] = [
        ("dispatch", (args[0], route), (ggrecv,), ExpertA2A("dispatch", experts, *rows, mb=mb, forward=False)),
        ("experts", (ggrecv, route, recv) + weights, (gxrecv,) + ws,
         ExpertStep("experts", op.segment, op.label, experts, step_grads, accumulate, *rows, forward=False)),
    ]
    if gx is not None:
        chain += [("combine", (gxrecv, route), (gxback,), ExpertA2A("combine", experts, *rows, mb=mb, forward=False)),
                  ("unpermute", (gxback, route), (gx,),
                   ExpertStep("unpermute", op.segment, op.label, experts, (), False, *rows, forward=False))]
    return chain


def _grad_outputs(seg: object, n: Node) -> dict[int, str]:
    """Output index of the backward op (0: input grad, 1-3: weight grads) -> the node's output value."""
    out_node = seg.gm.graph.find_nodes(op="output")[0]  # type: ignore[attr-defined]
    where = {a.name: i for i, a in enumerate(out_node.args[0])}
    res: dict[int, str] = {}
    for x in seg.gm.graph.nodes:  # type: ignore[attr-defined]
        if x.op == "call_function" and x.target is operator.getitem and x.name in where:
            res[int(x.args[1])] = n.outputs[where[x.name]]
    return res
