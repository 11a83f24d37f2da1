"""Graph passes: what acts on Dynamo's FX graph before the joint capture cuts it into segments -- the
model's float attributes made constants (``specialize_floats``), ``shard_tensor``'s linear-layer sharding
with its shape fitting, and its sequence parallelism. Each is one named step in ``GRAPH_PASSES`` (in order), run by ``run_graph_passes`` under
the same rules as the DAG passes (``driver.py``): timed (``GraphContext.timings``), the FX graph
dumped after each with ``PIPER_DEBUG=1``, skippable by name with ``PIPER_SKIP_PASSES`` (debugging only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import fx

from piper_compile.pass_runner import run_pass, skipped_passes
from piper_compile.directives.spec import Directive, Place, ShardTensor
from piper_compile.ir.shard import ParamShard


@dataclass
class GraphContext:
    """What graph passes read (Dynamo's graph, its parameter sources, the directives, the world size)
    and what they leave for capture and planning."""

    gm: fx.GraphModule
    sources: Any
    directives: list[Directive]
    world: int
    example_inputs: list[Any] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    float_constants: dict[int, tuple[str, float]] = field(default_factory=dict)  # input -> (source, value)
    tp_shards: dict[str, ParamShard] = field(default_factory=dict)  # how each split layer is cut
    local_shapes: dict[Any, Any] | None = None  # placeholder -> this rank's shape (None: unchanged)
    tp_partial: frozenset[str] = frozenset()  # sequence parallel: gradients summed over the TP group

    def shard_tensor(self) -> tuple[ShardTensor, int] | None:
        """The ``shard_tensor`` directive and its tensor-parallel group size, if there is one."""
        dirs = [d for d in self.directives if isinstance(d, ShardTensor)]
        if not dirs:
            return None
        if len(dirs) > 1:
            raise dirs[1].error("a second shard_tensor directive", "list every layer in one shard_tensor's params")
        d = dirs[0]
        if d.devices is not None:
            return d, len(d.devices[0])
        if any(isinstance(x, Place) for x in self.directives):
            raise d.error("with place directives, shard_tensor needs 'devices' (its tensor-parallel groups)",
                          'add "devices": [[0, 1], [2, 3]] (ranks of one group see the same batch)')
        return d, self.world


def specialize_floats_pass(ctx: GraphContext) -> None:
    """Float attributes of the model (RMSNorm ``eps``, attention ``scaling``): under ``dynamic=True``
    Dynamo passes each as a 0-dim float64 input read with ``.item()``, which Inductor cannot compile
    (``DataDependentOutputException: aten._local_scalar_dense``: the segment would run eagerly). Their
    values at capture become constants, as ``torch._dynamo.config.specialize_float`` would make them;
    the step checks every call that they did not change (``ctx.float_constants``). Floats passed as
    forward arguments stay inputs."""
    from piper_compile.capture.subgraphs import read_as_constant, specialize_region_floats

    found = _float_attributes(ctx)
    specialize_region_floats(ctx.gm, {ph: value for ph, (_, _, value) in found.items()})
    for ph, (i, src, value) in found.items():
        for item in [u for u in ph.users if u.op == "call_method" and u.target == "item"]:
            read_as_constant(item, value)
        ctx.float_constants[i] = (src, value)
    if ctx.float_constants:
        ctx.gm.recompile()


def _float_attributes(ctx: GraphContext) -> dict[fx.Node, tuple[int, str, float]]:
    """The placeholders that are a float attribute of the model read with ``.item()`` (directly, or
    inside the nested compile regions they are passed to): (position, source, value)."""
    import torch

    from piper_compile.capture.subgraphs import invoke_subgraph

    region_call = invoke_subgraph()
    found: dict[fx.Node, tuple[int, str, float]] = {}
    for i, ph in enumerate(ctx.gm.graph.find_nodes(op="placeholder")):
        ex = ctx.example_inputs[i] if i < len(ctx.example_inputs) else None
        src = ctx.sources[i] if i < len(ctx.sources) else ""
        users = list(ph.users)
        if (isinstance(ex, torch.Tensor) and ex.dim() == 0 and ex.dtype == torch.float64 and src.startswith("L['self']")
                and users and all((u.op == "call_method" and u.target == "item") or u.target is region_call
                                  for u in users)):
            found[ph] = (i, src, float(ex))
    return found


def shard_linears_pass(ctx: GraphContext) -> None:
    """``shard_tensor``: split the listed linear layers in the graph, fit view/reshape sizes to the
    local shapes, mark the collectives (``capture/tensor_parallel.py``, ``capture/tp_shapes.py``)."""
    from piper_compile.capture.tensor_parallel import shard_linears

    found = ctx.shard_tensor()
    if found is not None:
        from piper_compile.capture.subgraphs import inline_subgraphs

        inline_subgraphs(ctx.gm, joint=False)  # the layers are split one by one: a shared body cannot be
        d, size = found
        ctx.tp_shards, ctx.local_shapes = shard_linears(ctx.gm, ctx.sources, d.params, size)


def sequence_parallel_pass(ctx: GraphContext) -> None:
    """``shard_tensor(sequence_parallel=True)``: activations between the split layers hold each rank's
    slice of the sequence (``capture/sequence_parallel.py``)."""
    from piper_compile.capture.sequence_parallel import split_sequence

    found = ctx.shard_tensor()
    if found is not None and found[0].sequence_parallel:
        d, size = found
        ctx.tp_partial = split_sequence(ctx.gm, ctx.sources, d.seq_dim, size)


GRAPH_PASSES: list[tuple[str, Callable[[GraphContext], None]]] = [
    ("specialize_floats", specialize_floats_pass),
    ("shard_linears", shard_linears_pass),
    ("sequence_parallel", sequence_parallel_pass),
]


def run_graph_passes(ctx: GraphContext) -> GraphContext:
    """Every graph pass in order (less those skipped by name); returns ``ctx`` with their results."""
    skip = skipped_passes()
    for name, fn in GRAPH_PASSES:
        if name not in skip:
            run_pass(name, lambda fn=fn: fn(ctx), ctx.timings, "FX graph", lambda _: f"\n{ctx.gm.graph}")
    return ctx
