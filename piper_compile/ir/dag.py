"""TrainingDAG: nodes are compute and communication steps of one training step, edges carry tensors
(data edges, derived from value names) or only order (order edges).

A node is a small frozen record. Values are named strings; a value has exactly one producer node or
is *external* (parameters, user inputs, the loss seed), which the runtime provides on every rank that
needs it. The DAG prints as one line per node and parses back (see ``to_text`` / ``parse_dag``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator

from piper_compile.ir.kind import Kind
from piper_compile.ir.meta import DagMeta, parse_meta, tuplify
from piper_compile.ir.ranks import compact, expand, pack, unpack
from piper_compile.ir.ops import Op, op_from_fields

TagValue = int | str
Tags = tuple[tuple[str, TagValue], ...]
Attrs = tuple[tuple[str, Any], ...]


PARAM_PREFIX = "param:"
BUFFER_PREFIX = "buffer:"

# Keys that were node annotations before ops were typed and are now an op's fields or its type: reading
# one from ``attrs`` would silently answer None. ``mb`` and ``zero`` stay annotations of compute steps too.
_NOT_ATTRS = frozenset({"purpose", "ep_role", "tp_role", "for", "state", "region_label", "segment", "grads",
                        "params", "msg", "dst", "src", "shape", "dtype", "subgroups", "bucket", "boundary", "loss",
                        "level", "scatter", "per_microbatch", "holders", "max_norm", "ep_params", "shards",
                        "norm_params", "experts", "accumulate", "role", "for_step", "label", "collective"})


def param_fqn(value: str) -> str | None:
    """The parameter FQN a value names: ``param:fqn`` (external) or ``param:fqn#step`` (a copy all-gathered
    for one compute step under ZeRO-3); ``None`` for any other value."""
    if not value.startswith(PARAM_PREFIX):
        return None
    return value[len(PARAM_PREFIX):].split("#", 1)[0]


def make_tags(d: dict[str, TagValue]) -> Tags:
    """Canonical (sorted) tuple form of a tag dict."""
    return tuple(sorted(d.items()))


def format_tags(tags: Tags | dict[str, TagValue]) -> str:
    """``{"PP":1,"PASS":"F"}`` -- JSON, so string tags that look like ints or hold separators round-trip."""
    items = tags.items() if isinstance(tags, dict) else tags
    return json.dumps(dict(items), separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Node:
    """One step of the training DAG, run SPMD-style by every rank in ``devices``. ``op`` says what the step
    is and holds its rules (``ir/ops``); ``attrs`` are annotations the directive passes leave on compute
    steps for the lowering passes (who placed or replicated it, with which settings)."""

    name: str
    op: Op
    tags: Tags = ()
    devices: tuple[int, ...] = ()
    stream: str = "compute"
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    attrs: Attrs = ()

    @property
    def kind(self) -> Kind:
        return self.op.kind

    def tag(self, key: str, default: Any = None) -> Any:
        for k, v in self.tags:
            if k == key:
                return v
        return default

    def attr(self, key: str, default: Any = None) -> Any:
        """A directive annotation (not the op's fields: read those from ``node.op``; asking for one of
        them, or for a key that became an op's type, raises rather than answer ``None`` forever)."""
        if key in _NOT_ATTRS:
            raise KeyError(f"piper: internal: {key!r} is not a node annotation: read it from node.op "
                           f"({type(self.op).__name__})")
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def tag_dict(self) -> dict[str, TagValue]:
        """The tags as a dict, made once per distinct tags (directive filters match every node, for every
        filter of every directive). Shared: read it, never change it."""
        return _tags_dict(self.tags)

    def with_(self, **changes: Any) -> "Node":
        return dataclasses.replace(self, **changes)

    def with_attrs(self, **changes: Any) -> "Node":
        d = dict(self.attrs)
        d.update(changes)
        return dataclasses.replace(self, attrs=tuple(sorted(d.items())))

    def with_op(self, **changes: Any) -> "Node":
        """This node with some fields of its op changed."""
        return dataclasses.replace(self, op=dataclasses.replace(self.op, **changes))

    def short(self, peer: int | None = None) -> str:
        """Compact label used in per-rank program listings, e.g. ``F1.mb3`` or ``SEND.x->r2``."""
        return self.op.short(self, peer)

    def to_text(self) -> str:
        dev = compact(self.devices) or "-"
        attrs = json.dumps(dict(self.attrs), sort_keys=True, separators=(",", ":"))
        op = json.dumps({k: pack(v) for k, v in self.op.fields().items()}, separators=(",", ":"))
        return (
            f"{self.kind.value} {self.name} dev={dev} stream={self.stream} "
            f"in={','.join(self.inputs) or '-'} out={','.join(self.outputs) or '-'} "
            f"tags={format_tags(self.tags)} op={self.op.NAME}{op} attrs={attrs}"
        )


@functools.lru_cache(maxsize=1 << 16)
def _tags_dict(tags: Tags) -> dict[str, TagValue]:
    return dict(tags)


def parse_node(line: str) -> Node:
    """Inverse of ``Node.to_text``."""
    kind, name, dev, stream, ins, outs, rest = line.split(" ", 6)
    assert rest.startswith("tags="), line
    decoder = json.JSONDecoder()
    tag_dict, end = decoder.raw_decode(rest, len("tags="))
    assert rest[end:].startswith(" op="), line
    brace = rest.index("{", end)
    op_name = rest[end + len(" op="):brace]
    op_fields, end = decoder.raw_decode(rest, brace)
    assert rest[end:].startswith(" attrs="), line

    def field_(text: str, key: str) -> str:
        assert text.startswith(key + "="), (text, key)
        return text[len(key) + 1 :]

    def names(text: str) -> tuple[str, ...]:
        return () if text == "-" else tuple(text.split(","))

    d = field_(dev, "dev")
    attrs = {k: tuplify(v) for k, v in json.loads(rest[end + len(" attrs="):]).items()}
    node = Node(name=name, op=op_from_fields(op_name, {k: unpack(v) for k, v in op_fields.items()}), tags=tuple(tag_dict.items()),
                devices=() if d == "-" else expand(d), stream=field_(stream, "stream"),
                inputs=names(field_(ins, "in")), outputs=names(field_(outs, "out")), attrs=tuple(sorted(attrs.items())))
    assert node.kind.value == kind, (line, node.kind)
    return node


@dataclass
class TrainingDAG:
    """The global DAG of one training step. Nodes keep insertion order (used as a stable tie-break).
    ``meta`` is the step's layout record (part of the text form); ``segments`` are the captured segments
    the COMPUTE nodes name (their code: not part of the text form, a pass that needs them gets them from
    its ``PassContext``)."""

    nodes: dict[str, Node] = field(default_factory=dict)
    order_edges: set[tuple[str, str]] = field(default_factory=set)
    meta: DagMeta = field(default_factory=DagMeta)
    segments: dict[str, Any] = field(default_factory=dict, repr=False)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def cached(self, what: str, key: Any, compute: Any) -> Any:
        """``compute()``, remembered on this DAG while ``key`` stays the same (e.g. a global order
        for a given node and edge count)."""
        hit = self._cache.get(what)
        if hit is None or hit[0] != key:
            hit = self._cache[what] = (key, compute())
        return hit[1]

    # -- construction -------------------------------------------------------------------------
    def add(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise ValueError(f"duplicate DAG node {node.name}")
        self.nodes[node.name] = node
        return node

    def replace(self, node: Node) -> None:
        assert node.name in self.nodes, node.name
        self.nodes[node.name] = node

    def remove(self, name: str) -> None:
        del self.nodes[name]
        self.order_edges = {(a, b) for a, b in self.order_edges if name not in (a, b)}

    def substitute(self, old: str, first: str, last: str | None = None) -> None:
        """Remove node ``old`` whose work nodes ``first`` .. ``last`` (already added) now do: order edges
        into ``old`` go to ``first``, out of it leave from ``last`` (default ``first``)."""
        for a, b in list(self.order_edges):
            if b == old:
                self.add_order(a, first)
            if a == old:
                self.add_order(last or first, b)
        self.remove(old)

    def add_order(self, before: str, after: str) -> None:
        assert before in self.nodes and after in self.nodes, (before, after)
        if before != after:
            self.order_edges.add((before, after))

    def copy(self) -> "TrainingDAG":
        return TrainingDAG(dict(self.nodes), set(self.order_edges), self.meta.copy(), self.segments)

    # -- queries ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def of_kind(self, *kinds: Kind) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind in kinds]

    def producers(self) -> dict[str, str]:
        """value name -> producing node name."""
        out: dict[str, str] = {}
        for n in self.nodes.values():
            for v in n.outputs:
                if v in out:
                    raise ValueError(f"value {v} produced by both {out[v]} and {n.name}")
                out[v] = n.name
        return out

    def consumers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for n in self.nodes.values():
            for v in n.inputs:
                out[v].append(n.name)
        return out

    def data_edges(self) -> list[tuple[str, str, str]]:
        """(producer, consumer, value) for every value with a producer."""
        prod = self.producers()
        return [(prod[v], n.name, v) for n in self.nodes.values() for v in n.inputs if v in prod]

    def predecessors(self) -> dict[str, set[str]]:
        preds: dict[str, set[str]] = {name: set() for name in self.nodes}
        for a, b, _ in self.data_edges():
            preds[b].add(a)
        for a, b in self.order_edges:
            preds[b].add(a)
        return preds

    def external_values(self) -> set[str]:
        prod = self.producers()
        return {v for n in self.nodes.values() for v in n.inputs if v not in prod}

    def find_cycle(self) -> list[str] | None:
        """A list of node names forming a cycle, or None if the DAG is acyclic."""
        preds = self.predecessors()
        succs: dict[str, list[str]] = defaultdict(list)
        for b, ps in preds.items():
            for a in ps:
                succs[a].append(b)
        color: dict[str, int] = {}
        for root in self.nodes:
            if root in color:
                continue
            stack: list[tuple[str, Iterator[str]]] = [(root, iter(succs[root]))]
            path = [root]
            color[root] = 1
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    color[node] = 2
                    stack.pop()
                    path.pop()
                elif color.get(nxt) == 1:
                    return path[path.index(nxt) :] + [nxt]
                elif nxt not in color:
                    color[nxt] = 1
                    stack.append((nxt, iter(succs[nxt])))
                    path.append(nxt)
        return None

    def topo_order(self, key: Any = None) -> list[str]:
        """Topological order; among ready nodes the smallest ``key(node)`` goes first
        (default: insertion order)."""
        import heapq

        index = {name: i for i, name in enumerate(self.nodes)}
        keyf = key or (lambda n: 0)
        preds = self.predecessors()
        indeg = {n: len(p) for n, p in preds.items()}
        succs: dict[str, list[str]] = defaultdict(list)
        for b, ps in preds.items():
            for a in ps:
                succs[a].append(b)
        heap = [(keyf(self.nodes[n]), index[n], n) for n, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        out: list[str] = []
        while heap:
            _, _, n = heapq.heappop(heap)
            out.append(n)
            for s in succs[n]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, (keyf(self.nodes[s]), index[s], s))
        if len(out) != len(self.nodes):
            raise ValueError(f"DAG has a cycle: {' -> '.join(self.find_cycle() or [])}")
        return out

    # -- text form ----------------------------------------------------------------------------
    def to_text(self) -> str:
        """``META`` line (when the meta is not a fresh DAG's), one line per node, one per order edge."""
        meta = self.meta.to_text()
        lines = [meta] if meta != "META {}" else []
        lines += [n.to_text() for n in self.nodes.values()]
        lines += [f"ORDER {a} -> {b}" for a, b in sorted(self.order_edges)]
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        counts: dict[str, int] = defaultdict(int)
        for n in self.nodes.values():
            counts[n.kind.value] += 1
        return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) + f", ORDER={len(self.order_edges)}"


def parse_dag(text: str) -> TrainingDAG:
    """Inverse of ``TrainingDAG.to_text`` (``segments`` are not part of the text form)."""
    dag = TrainingDAG()
    orders: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("META "):
            dag.meta = parse_meta(line)
        elif line.startswith("ORDER "):
            a, b = line[len("ORDER ") :].split(" -> ")
            orders.append((a, b))
        else:
            dag.add(parse_node(line))
    for a, b in orders:
        dag.add_order(a, b)
    return dag
