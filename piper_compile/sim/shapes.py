"""Concrete sizes for the simulator: symbol values (the batch symbol at the micro-batch size), bytes of
every DAG value and parameter, read from the plan's segments (``dag.segments``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from piper_compile.ir.dag import Kind, TrainingDAG
from piper_compile.ir.dims import dim_value
from piper_compile.sim.segment_memory import all_alias_maps, transient_bytes


def _hints(val: Any, out: dict[str, int], envs: set[int]) -> None:
    """Record the capture-time value of every backed symbol of the shape environment of ``val`` (a SymInt
    or a fake tensor), once per environment (``envs``: the ids of those read already)."""
    dims = [val] if isinstance(val, torch.SymInt) else list(val.shape) if isinstance(val, torch.Tensor) else []
    for d in dims:
        if not isinstance(d, torch.SymInt) or id(d.node.shape_env) in envs:
            continue
        envs.add(id(d.node.shape_env))
        env = getattr(d.node.shape_env, "backed_var_to_val", None) or getattr(d.node.shape_env, "var_to_val", {})
        for sym, v in env.items():
            if str(sym).startswith("s") and str(sym) not in out:
                try:
                    out[str(sym)] = int(v)
                except TypeError:
                    pass


def symbol_values(dag: TrainingDAG, overrides: dict[str, int] | None = None) -> dict[str, int]:
    """Symbol -> value used to make shapes concrete: capture-time values, with the batch symbol (dim 0
    of the batched user inputs) divided by the number of micro-batches, as the runtime does."""
    segments = dag.segments
    hints: dict[str, int] = {}
    envs: set[int] = set()
    batch_syms: set[str] = set()
    for seg in segments.values():
        phs = [n for n in seg.gm.graph.nodes if n.op == "placeholder"]
        for value, ph in zip(seg.inputs, phs):
            val = ph.meta.get("val")
            _hints(val, hints, envs)
            if value.startswith("input:") and isinstance(val, torch.Tensor) and val.dim() > 0:
                d0 = val.shape[0]
                if isinstance(d0, torch.SymInt) and isinstance(d0.node.expr, sympy.Symbol):
                    batch_syms.add(str(d0.node.expr))
    m = dag.meta.split or 1
    out = {s: (v // m if s in batch_syms else v) for s, v in hints.items()}
    out.update(overrides or {})
    return out


def concrete(dim: Any, symbols: dict[str, int]) -> int:
    """A dimension (int, SymInt or expression string such as ``"s95*s75"``) at the given symbol values."""
    return dim_value(dim.node.expr if isinstance(dim, torch.SymInt) else dim, symbols)


def dtype_bytes(dtype: str | torch.dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    d = getattr(torch, dtype, None)
    return d.itemsize if isinstance(d, torch.dtype) else 0


def numel(shape: Any, symbols: dict[str, int]) -> int:
    n = 1
    for d in shape:
        n *= concrete(d, symbols)
    return n


def _kept_itemsize(graph_dtype: torch.dtype, dag: TrainingDAG) -> int:
    """Bytes per element of a parameter as the rank keeps it: the graph's dtype, or under mixed precision
    (where the graph computes with the copies) the master weights' dtype."""
    prec = dag.meta.precision
    if prec is not None and str(graph_dtype).removeprefix("torch.") == prec.compute:
        return dtype_bytes(prec.master)
    return graph_dtype.itemsize


@dataclass
class Sizes:
    """Bytes of values, parameters and messages of one plan."""

    symbols: dict[str, int] = field(default_factory=dict)
    values: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)  # base value -> (shape, dtype)
    params: dict[str, int] = field(default_factory=dict)  # fqn -> bytes
    params_numel: dict[str, int] = field(default_factory=dict)  # fqn -> elements
    messages: dict[str, int] = field(default_factory=dict)  # SEND/RECV msg -> bytes
    # mixed precision: bytes per parameter element as kept (master), computed with, reduced (1: as kept)
    as_factor: dict[str, float] = field(default_factory=dict)
    aliases: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)  # segment -> alias_map
    graphs: dict[str, Any] = field(default_factory=dict)  # segment -> its graph (for transient bytes)
    fused_code: bool = True  # segments run as Inductor's code (else eagerly: every intermediate stored)
    _transient: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)

    @classmethod
    def from_dag(cls, dag: TrainingDAG | None, symbols: dict[str, int] | None = None) -> "Sizes":
        """Sizes for ``dag`` (empty when there is no DAG or it has no segments: everything 0 bytes),
        remembered on the DAG (the simulator, the cost model and the memory plan all ask)."""
        if dag is None:
            return cls()
        key = (len(dag.nodes), len(dag.order_edges), len(dag.segments), tuple(sorted((symbols or {}).items())))
        return dag.cached(f"sizes:{key[3]}", key, lambda: cls._from_dag(dag, symbols))

    @classmethod
    def _from_dag(cls, dag: TrainingDAG, symbols: dict[str, int] | None) -> "Sizes":
        syms = symbol_values(dag, symbols)
        out = cls(syms, fused_code=dag.meta.codegen != "eager")
        for seg in dag.segments.values():
            out.values.update(seg.out_meta)
            out.graphs[seg.name] = seg.gm
            phs = [n for n in seg.gm.graph.nodes if n.op == "placeholder"]
            for value, ph in zip(seg.inputs, phs):
                val = ph.meta.get("val")
                if value.startswith("param:") and isinstance(val, torch.Tensor):
                    out.params_numel[value[len("param:"):]] = numel(val.shape, syms)
                    out.params[value[len("param:"):]] = numel(val.shape, syms) * _kept_itemsize(val.dtype, dag)
        out.aliases = all_alias_maps(dag.segments.values())
        prec = dag.meta.precision
        if prec is not None:
            master = dtype_bytes(prec.master)
            out.as_factor = {"compute": dtype_bytes(prec.compute) / master, "reduce": dtype_bytes(prec.reduce) / master}
        for f, shard in dag.meta.ep_params.items():  # a rank holds E/G experts
            out.params_numel[f] //= len(shard.group)
            out.params[f] //= len(shard.group)
        for n in dag.of_kind(Kind.RECV):
            op = n.op
            if op.state:  # type: ignore[attr-defined]
                out.messages[op.msg] = out.params.get(op.state, 0)  # type: ignore[attr-defined]
            else:
                out.messages[op.msg] = out.tensor_bytes(op.shape, op.dtype)  # type: ignore[attr-defined]
        return out

    def tensor_bytes(self, shape: Any, dtype: str) -> int:
        return numel(shape, self.symbols) * dtype_bytes(dtype)

    def value_bytes(self, value: str) -> int:
        """Bytes of a computed value (``x@mb3``); 0 when unknown."""
        meta = self.values.get(value.rsplit("@mb", 1)[0])
        return self.tensor_bytes(*meta) if meta else 0

    def transient(self, segment: str, dropped: tuple[int, ...] = ()) -> int:
        """Bytes segment ``segment`` holds while it runs beyond its inputs and the outputs it keeps
        (``dropped``: output positions it writes into gradient buffers)."""
        key = (segment, dropped)
        if key not in self._transient:
            gm = self.graphs.get(segment)
            self._transient[key] = 0 if gm is None else transient_bytes(gm, self.symbols, dropped, self.fused_code)
        return self._transient[key]

    def params_bytes(self, fqns: Any, as_: str = "master") -> int:
        """Bytes of these parameters as kept (``master``), as computed with (``compute``: mixed precision's
        copies and ZeRO-3 gathers) or as their gradients are reduced (``reduce``)."""
        return int(sum(self.params.get(f, 0) for f in fqns) * self.as_factor.get(as_, 1.0))
