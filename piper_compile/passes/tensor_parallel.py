"""Tensor parallelism: the ``shard_tensor`` directive pass and its lowering.

Capture already split the linear layers and inserted ``tp_allreduce`` markers (``capture/tensor_parallel``);
here the matched regions learn their tensor-parallel groups, and every marker step becomes a collective
over the group of the rank that runs it (``subgroups``: one collective node, SPMD over the region's ranks,
each rank reducing within its own group): ALL_REDUCE for ``tp_allreduce``; for sequence parallelism
ALL_GATHER (``tp_all_gather``, ``tp_gather``) and REDUCE_SCATTER (``tp_reduce_scatter``) along the
sequence dimension, while ``tp_scatter`` stays a local step (``tp_role="scatter"``: this rank's chunk).
Ranks of one tensor-parallel group see the same batch, so the gradients are reduced over the data-parallel
subgroups (one rank per tensor-parallel group, same position); under ZeRO-1 each data-parallel subgroup
shards the optimizer state of its (identical) buckets, which hold its position's pieces of the split layers.
"""
from __future__ import annotations

from piper_compile.capture.regions import boundary_kind
from piper_compile.directives.spec import ShardTensor
from piper_compile.errors import PiperDirectiveError
from piper_compile.ir.dag import Kind, Node, TrainingDAG
from piper_compile.ir.meta import TensorParallelSpec
from piper_compile.ir.ops import Segment as SegmentOp
from piper_compile.ir.ops import SequenceChunk, TpCollective
from piper_compile.passes.context import PassContext
from piper_compile.passes.directive_passes import check_ranks, match


def apply_shard_tensor(dag: TrainingDAG, d: ShardTensor, ctx: PassContext) -> TrainingDAG:
    """Mark the matched regions tensor-parallel (their groups are resolved once placement is known)."""
    check_ranks(d, [r for g in d.devices or () for r in g], ctx)
    for n in match(dag, d, d.filter, ctx):
        dag.replace(n.with_attrs(tp_by=d.index, tp_stream=d.stream))
    dag.meta.tp = TensorParallelSpec(d.index, d.devices, d.stream)
    return dag


def tp_groups(devices: tuple[int, ...], spec: tuple[tuple[int, ...], ...] | None, index: int) -> tuple[tuple[int, ...], ...]:
    """The tensor-parallel groups that partition a region's ranks ``devices``."""
    if spec is None:
        return (tuple(sorted(devices)),)
    mine = tuple(tuple(sorted(g)) for g in spec if set(g) & set(devices))
    if {r for g in mine for r in g} != set(devices):
        raise PiperDirectiveError(index, {"shard_tensor": list(map(list, spec))},
                                  f"tensor-parallel groups {[list(g) for g in mine]} do not partition the ranks "
                                  f"{list(devices)} a sharded region runs on",
                                  "give groups that together cover exactly the region's ranks")
    return mine


def dp_subgroups(groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Data-parallel subgroups: the i-th rank of every tensor-parallel group."""
    return tuple(tuple(g[i] for g in groups) for i in range(len(groups[0])))


def lower_tensor_parallel(dag: TrainingDAG, ctx: PassContext) -> TrainingDAG:
    """Every marker step becomes its collective within each rank's tensor-parallel group."""
    if dag.meta.tp is None:
        return dag
    index, spec, stream = dag.meta.tp.index, dag.meta.tp.groups, dag.meta.tp.stream
    sizes = set()
    for n in list(dag.of_kind(Kind.COMPUTE)):
        boundary = n.op.boundary if isinstance(n.op, SegmentOp) else None
        if n.attr("tp_by") is None:
            if boundary in _COLLECTIVES:
                raise PiperDirectiveError(index, {"shard_tensor": n.name}, f"{n.name} holds a layer split by params "
                                          "but the directive's filter does not match its region",
                                          "widen the filter (or leave it empty) to cover every sharded layer")
            continue
        if n.attr("zero", 0) > 1 and len(n.devices) > 1:
            raise PiperDirectiveError(index, {"zero": n.attr("zero")}, f"ZeRO-{n.attr('zero')} with shard_tensor is "
                                      f"not supported yet (region {n.name})", "use zero=1 (the optimizer state "
                                      "sharded over each data-parallel subgroup) or zero=0 on tensor-parallel regions")
        groups = tp_groups(n.devices, spec, index)
        sizes.add(len(groups[0]))
        n = n.with_attrs(tp_groups=groups)
        dag.replace(n)
        if boundary in _COLLECTIVES:
            _lower_marker(dag, n, boundary, groups, stream, ctx)
    dag.meta.tp_size = max(sizes) if sizes else 1
    return dag


_COLLECTIVES = {"tp_allreduce": "all_reduce", "tp_all_gather": "all_gather", "tp_gather": "all_gather",
                "tp_reduce_scatter": "reduce_scatter", "tp_scatter": "chunk"}
_SUFFIX = {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs"}


def _lower_marker(dag: TrainingDAG, n: Node, boundary: str, groups: tuple[tuple[int, ...], ...], stream: str,
                  ctx: PassContext) -> None:
    """Replace marker step ``n`` by its collective (or, for ``tp_scatter``, a local chunk step)."""
    op: SegmentOp = n.op  # type: ignore[assignment]
    seg = ctx.segments[op.segment]
    marker = next(x for x in seg.gm.graph.nodes if boundary_kind(x))
    dim, size = (marker.args[1], marker.args[2]) if len(marker.args) > 1 else (0, 1)  # sequence parallel: (x, dim, size)
    collective = _COLLECTIVES[boundary]
    if collective == "chunk":
        dag.replace(n.with_(op=SequenceChunk(op.segment, dim, size, groups, op.label)))
        return
    shape, dtype = seg.out_meta[n.outputs[0].rsplit("@mb", 1)[0]]
    tp = TpCollective(collective, groups, tuple(shape), dtype, dim, size, n.attr("mb", 0))
    name = f"{n.name}.{_SUFFIX[collective]}"
    dag.add(Node(name, tp, n.tags, n.devices, stream, n.inputs[:1], n.outputs[:1], (("mb", n.attr("mb", 0)),)))
    dag.substitute(n.name, name)
