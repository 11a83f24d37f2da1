"""Sequence parallelism at capture (Megatron-SP): after :func:`shard_linears` marked the tensor-parallel
layers, activations *between* them are split along the sequence dimension across the group.

Every value of Dynamo's graph is either whole (the same full tensor on every rank of the group) or
split (this rank's chunk of the sequence). The rewrite walks the graph once:

* the all-reduce after a row-parallel layer (``tp_allreduce``) becomes ``tp_reduce_scatter``: split;
* the marker before a column-parallel layer (``tp_copy``) becomes ``tp_all_gather`` when its input is
  split (one gather per value, shared by the layers reading it, e.g. q/k/v projections);
* per-token ops (elementwise ops, layer/RMS norms, reductions over the hidden dimensions) keep their
  split input split; a whole operand that carries the sequence dimension (the residual stream coming
  from the embedding) is cut to this rank's chunk (``tp_scatter``);
* any other op reading a split value (attention, reshapes, the LM head, the graph output) gets it
  gathered whole first (``tp_gather``).

A whole tensor that needs a gradient and meets split values in a per-token op (a norm's weight, a
row-parallel layer's bias) gets only this rank's tokens' share of its gradient. Parameters read only
that way are returned as *partial*: the gradient reduction sums them over the whole group instead of
over the data-parallel subgroups. Any other such tensor goes through ``tp_copy``, whose backward
all-reduces within the group.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from piper_compile.capture.joint import fqn_from_source
from piper_compile.errors import PiperCaptureError
from piper_compile.nn.tp import (ALL_GATHER_OP, ALLREDUCE_OP, COPY_OP, GATHER_OP, REDUCE_SCATTER_OP,
                                 SCATTER_OP)

_POINTWISE_FUNCS: set[Any] = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt, torch.exp,
    torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.clamp, torch.where,
    F.gelu, F.silu, F.relu, F.dropout, F.sigmoid, F.tanh, torch._C._nn.gelu, torch._C._nn.silu,
}
_POINTWISE_METHODS = {"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid",
                      "relu", "to", "float", "half", "bfloat16", "type_as", "contiguous", "clone", "abs",
                      "clamp"}
_NORMS: set[Any] = {F.layer_norm, getattr(F, "rms_norm", F.layer_norm)}
_REDUCTIONS = {"mean", "sum", "amax", "amin"}


def _value(n: Any) -> Any:
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def _size(s: Any) -> Any:
    """A size comparable without guarding on symbols: the sympy expression of a SymInt, else the int."""
    return s.node.expr if isinstance(s, torch.SymInt) else int(s)


def _ndim(n: fx.Node) -> int:
    return _value(n).dim()


def _reduced_keeps_seq(node: fx.Node, r: int) -> int | None:
    """For ``x.mean(dims, keepdim)``-style reductions of a split ``x``: the new sequence position (from the
    right) when every reduced dimension lies right of the sequence axis, else None."""
    k = _ndim(node.args[0])  # type: ignore[arg-type]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [d % k for d in dims]
    if any(d <= k - r for d in dims):
        return None
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return r if keep else r - len(dims)


def _per_token(node: fx.Node, r: int) -> int | None:
    """The sequence position (from the right) of ``node``'s output when it computes every token on its
    own (so it can run on a chunk of the sequence), else None."""
    if node.op == "call_function" and node.target in _POINTWISE_FUNCS:
        out = r
    elif node.op == "call_method" and node.target in _POINTWISE_METHODS:
        out = r
    elif node.op == "call_function" and node.target in _NORMS:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        out = r if shape is not None and len(tuple(shape)) < r else None
    elif node.op == "call_method" and node.target in _REDUCTIONS:
        out = _reduced_keeps_seq(node, r)
    else:
        return None
    val = _value(node)  # (None for the bias add shard_linears inserted)
    if out is None or out < 1 or (isinstance(val, torch.Tensor) and val.dim() < out):
        return None
    return out


class _Rewrite:
    """One pass over the graph; ``seq[node]`` is the sequence axis (counted from the right) of a split
    value, absent for whole values."""

    def __init__(self, gm: fx.GraphModule, sources: list[str], dim: int, size: int) -> None:
        self.gm, self.g, self.dim, self.size = gm, gm.graph, dim, size
        phs = self.g.find_nodes(op="placeholder")
        self.params = {ph: fqn_from_source(src) for ph, src in zip(phs, sources) if "_parameters" in src}
        self.seq: dict[fx.Node, int] = {}
        self.full: dict[fx.Node, Any] = {}  # split value -> the whole sequence length (see _size)
        self.cache: dict[tuple[Any, ...], fx.Node] = {}
        self.partial_uses: dict[fx.Node, set[fx.Node]] = {}

    def marker(self, op: Any, x: fx.Node, axis: int, before: fx.Node) -> fx.Node:
        key = (op, x, axis)
        if key not in self.cache:
            with self.g.inserting_after(x) if x.op != "placeholder" else self.g.inserting_before(before):
                self.cache[key] = self.g.call_function(op, (x, axis, self.size))
        return self.cache[key]

    def gather(self, x: fx.Node, before: fx.Node) -> fx.Node:
        """``x`` whole (all-gathered; backward: this rank's chunk of the gradient)."""
        return self.marker(GATHER_OP, x, _ndim(x) - self.seq[x], before)

    def run(self) -> frozenset[str]:
        for node in list(self.g.nodes):
            if node.target is ALLREDUCE_OP:
                self.split_output(node)
            elif node.target is COPY_OP and node.args[0] in self.seq:
                x = node.args[0]
                node.replace_all_uses_with(self.marker(ALL_GATHER_OP, x, _ndim(x) - self.seq[x], node))
                self.g.erase_node(node)
            elif any(a in self.seq for a in node.all_input_nodes):
                self.visit(node)
        partial = self.settle_partial()
        self.gm.recompile()
        return partial

    def split_output(self, node: fx.Node) -> None:
        """g after a row-parallel layer: a reduce-scatter along the sequence dimension."""
        x = node.args[0]
        shape = tuple(_value(x).shape)
        if len(shape) <= self.dim:
            raise PiperCaptureError(f"piper: shard_tensor: sequence_parallel splits dimension seq_dim={self.dim}, but "
                                    f"the row-parallel output {x.name} has shape {list(shape)}; set seq_dim to its "
                                    "sequence dimension or drop sequence_parallel")
        node.target, node.args = REDUCE_SCATTER_OP, (x, self.dim, self.size)
        self.seq[node] = len(shape) - self.dim
        self.full[node] = _size(shape[self.dim])

    def visit(self, node: fx.Node) -> None:
        split = [a for a in node.all_input_nodes if a in self.seq]
        rs = {self.seq[a] for a in split}
        fulls = {self.full[a] for a in split}
        r = _per_token(node, next(iter(rs))) if len(rs) == 1 and len(fulls) == 1 else None
        plan = self.operands(node, r, next(iter(fulls))) if r is not None else None
        if plan is None:  # needs the whole sequence
            for a in split:
                node.replace_input_with(a, self.gather(a, node))
            return
        cuts, partial = plan
        for a, axis in cuts.items():
            sc = self.marker(SCATTER_OP, a, axis, node)
            self.seq[sc], self.full[sc] = r, next(iter(fulls))  # cut values are split like the others
            node.replace_input_with(a, sc)
        for a in partial:
            self.partial_uses.setdefault(a, set()).add(node)
        self.seq[node] = r  # type: ignore[assignment]
        self.full[node] = next(iter(fulls))

    def operands(self, node: fx.Node, r: int, full: Any) -> tuple[dict[fx.Node, int], list[fx.Node]] | None:
        """How the whole tensor operands of per-token ``node`` enter it: the ones carrying the sequence axis
        are cut to this rank's chunk (operand -> its axis), the ones needing a gradient get a partial one;
        None: an operand has the sequence axis at another length, so ``node`` cannot run split."""
        cuts: dict[fx.Node, int] = {}
        partial: list[fx.Node] = []
        for a in node.all_input_nodes:
            v = _value(a)
            if a in self.seq or not isinstance(v, torch.Tensor):
                continue
            m = v.dim()
            if m >= r and _size(v.shape[m - r]) != 1:
                if _size(v.shape[m - r]) != full:
                    return None
                cuts[a] = m - r
            elif v.requires_grad:
                partial.append(a)
        return cuts, partial

    def settle_partial(self) -> frozenset[str]:
        """Parameters read only by split per-token ops are reduced over the whole group; other partial
        operands get ``tp_copy`` (their gradient is all-reduced within the group right away)."""
        partial = set()
        for a, uses in self.partial_uses.items():
            if a in self.params and set(a.users) == uses:
                partial.add(self.params[a])
                continue
            first = next(n for n in self.g.nodes if n in uses)  # not among the placeholders
            with self.g.inserting_before(first):
                copied = self.g.call_function(COPY_OP, (a,))
            for u in uses:
                u.replace_input_with(a, copied)
        return frozenset(partial)


def split_sequence(gm: fx.GraphModule, sources: list[str], dim: int, size: int) -> frozenset[str]:
    """Rewrite ``gm`` (marked by ``shard_linears``) in place for sequence parallelism along ``dim`` over
    ``size`` ranks; returns the parameters whose gradients each rank holds only partially."""
    if not any(n.target is ALLREDUCE_OP for n in gm.graph.nodes):
        raise PiperCaptureError("piper: shard_tensor: sequence_parallel needs at least one rowwise layer (its "
                                "all-reduce becomes the reduce-scatter that splits the sequence); add one to params")
    return _Rewrite(gm, sources, dim, size).run()
