"""What a segment holds while it runs, read from its graph: the one rule the memory plan
(``sim/simulate._Held``) and the runtime's own accounting (``ir/ops/compute.Segment``) both follow.

- **Aliases.** An output that is a view (``detach``, ``t``, ``view``, ...) or an in-place result of a
  parameter, a buffer, a batch input or another output of the same segment holds no storage of its own:
  :func:`alias_map` names them, and both sides count a storage once, until its last value is freed
  (:class:`SharedStorage`; the AOT graph often saves a tensor and its ``detach`` for the backward: counted
  twice, a language model's log-softmax is a whole extra vocabulary-sized tensor per micro-batch).
- **Transient bytes.** Between its inputs and its outputs a segment makes intermediates that die inside
  it (a recomputed activation, a loss's gradient of the logits before the matmul that consumes it).
  :func:`transient_bytes` walks the graph in order, freeing each storage after its last use as the FX
  code and Inductor's buffer reuse do, and returns the most bytes held at once beyond the outputs kept.
  Under Inductor a pointwise result (or a softmax's, :data:`_FUSED_COMPOSITES`) only pointwise ops and
  reductions read is fused into them and never stored (on CPU Inductor this lands within 0.1% of the
  allocator's peak on the test matrix, where counting only what matmuls make or read and reductions'
  results fell 8.3% short); run eagerly (``codegen="eager"``) every intermediate is. The walk counts intermediates only: inputs are counted live by the caller until the step ends.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from piper_compile.ir.dag import BUFFER_PREFIX, PARAM_PREFIX


def _alias_of(n: fx.Node, tuples: bool = True) -> fx.Node | None:
    """The node whose storage ``n``'s result shares: a view's or in-place op's first argument, a
    multi-output op's tuple for its ``getitem`` (``tuples``: the tuple holds its tensors while any is
    read); None for a fresh allocation."""
    if n.op != "call_function":
        return None
    if n.target is operator.getitem:
        return n.args[0] if tuples and isinstance(n.args[0], fx.Node) else None
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    return n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None


def _roots(nodes: Iterable[fx.Node], tuples: bool = True) -> dict[fx.Node, fx.Node]:
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        a = _alias_of(n, tuples)
        root[n] = root.get(a, a) if a is not None else n
    return root


def alias_map(gm: fx.GraphModule) -> dict[int, tuple[str, int]]:
    """Output position -> what its storage belongs to, for each output that is a view of an input
    (``("in", i)``: placeholder ``i``) or of an earlier output (``("out", j)``); fresh outputs are absent."""
    root = _roots(gm.graph.nodes, tuples=False)
    inputs = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    first: dict[fx.Node, int] = {}
    out: dict[int, tuple[str, int]] = {}
    for k, o in enumerate(gm.graph.output_node().args[0]):
        if not isinstance(o, fx.Node):
            continue
        r = root.get(o, o)
        if r in inputs and r is not o:
            out[k] = ("in", inputs[r])
        elif r in first:
            out[k] = ("out", first[r])
        else:
            first[r] = k
    return out


def all_alias_maps(segments: Iterable[Any]) -> dict[str, dict[int, tuple[str, int]]]:
    """:func:`alias_map` of every segment (``capture/segments.Segment``s) of a plan that has views."""
    maps = {seg.name: alias_map(seg.gm) for seg in segments}
    return {name: m for name, m in maps.items() if m}


EXTERNAL = ""  # the root of a view of a parameter, buffer or batch input: memory no activation counts


def root_value(amap: dict[int, tuple[str, int]], k: int, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> str | None:
    """The value whose storage output ``k`` of a segment call (its ``inputs``/``outputs`` value names)
    shares: another output, an input activation, :data:`EXTERNAL`; None for a fresh one."""
    at = amap.get(k)
    if at is None:
        return None
    if at[0] == "out":
        return outputs[at[1]]
    v = inputs[at[1]]
    return EXTERNAL if v.startswith((PARAM_PREFIX, BUFFER_PREFIX, "input:")) else v


class SharedStorage:
    """Live values grouped by the storage they share (``alias_map``): a view of a live value counts no bytes
    of its own, and the bytes stay counted until the last value of the group is freed; a view of a
    parameter or batch input (root :data:`EXTERNAL`) counts none, ever. The memory plan's walk and the
    runtime's accounting both keep one (``sim/memory_walk._Held``, ``runtime/step.Step``)."""

    def __init__(self) -> None:
        self.group: dict[str, str] = {}  # value -> its group (the value that first held the storage)
        self.members: dict[str, set[str]] = {}
        self.nbytes: dict[str, int] = {}

    def add(self, v: str, nbytes: int, root: str | None) -> int:
        """Value ``v`` is stored (``root``: the value it is a view of, if any): the bytes to count now."""
        if root == EXTERNAL:
            self.group[v] = EXTERNAL
            return 0
        g = self.group.get(root) if root else None
        if g is None:
            g = v
            self.members[g], self.nbytes[g] = set(), nbytes
        self.group[v] = g
        self.members[g].add(v)
        return 0 if g != v else nbytes

    def remove(self, v: str) -> tuple[int, str | None] | None:
        """``v`` is freed: (bytes to stop counting, a value of the group still live or None), or None
        when ``v`` was never added."""
        g = self.group.pop(v, None)
        if g is None:
            return None
        if g == EXTERNAL:
            return 0, None
        left = self.members[g]
        left.discard(v)
        if left:
            return 0, next(iter(left))
        del self.members[g]
        return self.nbytes.pop(g), None


def _bytes(val: Any, symbols: dict[str, int]) -> int:
    from piper_compile.sim.shapes import numel

    if isinstance(val, torch.Tensor):
        try:
            return numel(val.shape, symbols) * val.element_size()
        except ValueError:  # a data-dependent size (``.nonzero()``, a mask): known only when it runs
            return 0
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v, symbols) for v in val)
    return 0


_POINTWISE = torch.Tag.pointwise
_REDUCTION = getattr(torch.Tag, "reduction", None)  # torch >= 2.12 tags sum/amax/mean...; older: the set below
aten = torch.ops.aten
# Composite ops Inductor decomposes into reductions and pointwise code it fuses like any pointwise op: the
# softmax family (a max and a sum over the row, then pointwise). On the loss stage of a checkpointed pipeline
# the recomputed log-softmax is computed inside its gradient's loop there: counted stored, the plan was 13.7%
# over the CPU allocator's peak. The NLL's gradient (a scatter into zeros) is stored: Inductor's generated
# code allocates it beside the log-softmax's gradient (its ``scatter_upon_const_tensor`` pattern is a joint
# graph pass, which piper's segment compilation does not run).
_FUSED_COMPOSITES = frozenset({aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
                               aten._log_softmax_backward_data.default})
# Ops that read a fused producer inside their own loop (a reduction; the NLL's gather of one log-probability;
# its gradient, which reads only the log-probabilities' shape).
_READS_FUSED = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
                          aten.amax.default, aten.amin.default, aten.nll_loss_forward.default,
                          aten.nll_loss2d_forward.default, aten.nll_loss_backward.default,
                          aten.nll_loss2d_backward.default}) | _FUSED_COMPOSITES


def _fused_producer(n: fx.Node) -> bool:
    """Whether Inductor computes ``n``'s result inside the loops of the ops that read it."""
    return _POINTWISE in getattr(n.target, "tags", ()) or n.target in _FUSED_COMPOSITES


def _fused_reader(n: fx.Node) -> bool:
    """Whether ``n`` can read a fused producer's result without it being stored."""
    tags = getattr(n.target, "tags", ())
    return _POINTWISE in tags or (_REDUCTION is not None and _REDUCTION in tags) or n.target in _READS_FUSED


def _stored(r: fx.Node, members: list[fx.Node], keep: set[fx.Node], fused: bool) -> bool:
    """Whether root ``r``'s result is ever in memory: always run eagerly; under Inductor unless it is a
    fused producer (pointwise, :data:`_FUSED_COMPOSITES`) that only fused readers read."""
    if not fused or r in keep or not _fused_producer(r):
        return True
    users = [u for m in members for u in m.users if _alias_of(u) is None]
    return any(u.op == "output" or not _fused_reader(u) for u in users)


def transient_bytes(gm: fx.GraphModule, symbols: dict[str, int], dropped: Iterable[int] = (),
                    fused: bool = True) -> int:
    """Most bytes ``gm``'s intermediates hold at once beyond the outputs it keeps (``dropped``: output
    positions written into buffers and dropped at once, fused gradients); ``fused``: Inductor's code."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root = _roots(nodes)
    outs = list(gm.graph.output_node().args[0])
    gone = set(dropped)
    keep = {root[o] for i, o in enumerate(outs) if isinstance(o, fx.Node) and i not in gone}
    members: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        if n.op != "output":
            members.setdefault(root[n], []).append(n)
    last: dict[int, list[fx.Node]] = {}
    size: dict[fx.Node, int] = {}
    for r, ms in members.items():
        if r.op == "placeholder" or r in keep or not _stored(r, ms, keep, fused):
            continue
        size[r] = _bytes(r.meta.get("val"), symbols)
        end = max((pos[u] for m in ms for u in m.users if u.op != "output"), default=pos[r])
        last.setdefault(end, []).append(r)
    held = peak = made = 0
    for i, n in enumerate(nodes):
        if n in keep and n.op != "placeholder":
            made += _bytes(n.meta.get("val"), symbols)
        held += size.get(n, 0)
        peak = max(peak, held + made)
        held -= sum(size[r] for r in last.get(i, ()))
    return max(0, peak - made)
