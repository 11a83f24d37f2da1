"""Regional compilation: repeated blocks of a segment compile once.

A stage's segment holds several identical blocks -- the children of one ``nn.ModuleList``, such as a
transformer's layers -- and Inductor compiling it as one graph compiles each block again: compile time
grows with depth. :func:`cut` splits a segment's graph into *pieces* along the blocks its nodes came from
(``nn_module_stack`` of forward nodes, ``fwd_nn_module_stack`` of backward ones): one piece per block, and
pieces for what lies between them (embeddings, the head and the loss). Identical blocks give pieces whose
graphs, once traced for concrete shapes, are the same code with the same input shapes, so the codegen
compiles the first and reuses it for every other (in this process; across ranks and runs the FX graph
cache does the same). :class:`Runner` runs the pieces in order, each input dropped after its last reader,
as one compiled graph drops its inputs.

Only tensors cross pieces: a scalar (a size) is recomputed in each piece that reads it, and a tuple
(``native_layer_norm``'s three outputs) stays with the ``getitem`` nodes that unpack it. A segment whose
blocks are tiny (a ``Linear`` each), or with fewer than two blocks of one kind, is compiled whole.
"""
from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from piper_compile.capture.regions import BlockKey as Key
from piper_compile.capture.regions import block_of
from piper_compile.disk import constant_bytes
from piper_compile.fxgraph import graph_module

MIN_BLOCK_NODES = 16  # a block of fewer nodes is not worth a graph of its own
MIN_PIECE_NODES = 4  # stray runs shorter than this join the piece before them



@dataclass
class Piece:
    """One sub-graph of a segment: reads ``inputs`` (slots), writes ``outputs`` (slots), and is the last
    reader of ``frees`` (slots the runner drops before running it)."""

    gm: fx.GraphModule
    key: Key
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] = ()
    frees: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return self.key[0].replace("L['self'].", "") or "outside blocks"


@dataclass
class Cut:
    """A segment cut into pieces: slots ``0 .. inputs-1`` are the segment's inputs, ``results`` the slots
    of its outputs."""

    pieces: list[Piece]
    inputs: int
    slots: int
    results: tuple[int, ...]


def _scalar(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


@dataclass
class _Run:
    key: Key
    nodes: list[fx.Node] = field(default_factory=list)


def _runs(nodes: list[fx.Node]) -> list[_Run]:
    """Consecutive nodes of one block as runs; a node recording no module, or unpacking a tuple, joins the
    run it follows; scalars belong to no run (each piece reading one recomputes it)."""
    runs: list[_Run] = []
    owner: dict[fx.Node, _Run] = {}
    for n in nodes:
        if _scalar(n):
            continue
        src = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else None
        key = block_of(n)
        if src is not None and src in owner:
            run = owner[src]
        elif runs and (key is None or key == runs[-1].key):
            run = runs[-1]
        else:
            run = _Run(key or ("", ""))
            runs.append(run)
        run.nodes.append(n)
        owner[n] = run
    return _merge(runs)


def _merge(runs: list[_Run]) -> list[_Run]:
    """Short stray runs join the run before them, then neighbouring runs of one block join."""
    out: list[_Run] = []
    for r in runs:
        if out and (len(r.nodes) < MIN_PIECE_NODES or r.key == out[-1].key):
            out[-1].nodes.extend(r.nodes)
        else:
            out.append(r)
    if len(out) > 1 and len(out[0].nodes) < MIN_PIECE_NODES:
        first = out.pop(0)
        out[0].nodes[:0] = first.nodes
    return out


def _repeated(runs: list[_Run]) -> bool:
    """At least two blocks of one class, each big enough to be compiled on its own."""
    seen: dict[str, int] = {}
    for r in runs:
        if r.key[0] and len(r.nodes) >= MIN_BLOCK_NODES:
            seen[r.key[1]] = seen.get(r.key[1], 0) + 1
    return any(c >= 2 for c in seen.values())


def cut(gm: fx.GraphModule) -> Cut | None:
    """``gm`` cut into one piece per block, or None when it is better compiled whole (no repeated blocks,
    or a value that is not a tensor would have to cross pieces)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    runs = _runs(nodes)
    if not _repeated(runs):
        return None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    slot = {p: i for i, p in enumerate(placeholders)}
    owner = {n: i for i, r in enumerate(runs) for n in r.nodes}
    builders = [_Builder(gm, slot, owner, i) for i in range(len(runs))]
    for b, r in zip(builders, runs):
        for n in r.nodes:
            b.load(n)  # its own node: copied
    results = []
    for a in gm.graph.output_node().args[0]:
        if not isinstance(a, fx.Node):
            return None  # a constant among the outputs: compile whole
        if a not in slot and a not in owner:  # a scalar output (a size, GPT-2's sqrt(2 / pi)): the last piece's
            owner[a] = len(builders) - 1
            builders[-1].load(a)
        results.append(_export(a, slot, owner, builders))
    crossing = {a for b in builders for a in b.reads if a.op != "placeholder"}
    if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in crossing):
        return None
    for a in crossing:
        _export(a, slot, owner, builders)
    done = _finish(gm, builders, runs, len(placeholders), slot, tuple(results))
    keys = [structure_key(p.gm) for p in done.pieces]
    return done if len(set(keys)) < len(keys) else None  # no two pieces alike: cutting only adds compilations


def _export(a: fx.Node, slot: dict[fx.Node, int], owner: dict[fx.Node, int], builders: list[_Builder]) -> int:
    """The slot of value ``a``: a segment input's, or a new one its owning piece writes."""
    if a not in slot:
        slot[a] = len(slot)
        builders[owner[a]].exported.append(a)
    return slot[a]


def _finish(gm: fx.GraphModule, builders: list[_Builder], runs: list[_Run], inputs: int,
            slot: dict[fx.Node, int], results: tuple[int, ...]) -> Cut:
    last: dict[int, int] = {}
    for i, b in enumerate(builders):
        for a in b.reads:
            last[slot[a]] = i
    for s in results:
        last[s] = len(builders)  # the segment's outputs outlive every piece
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    pieces = []
    for i, (b, r) in enumerate(zip(builders, runs)):
        b.exported.sort(key=position.__getitem__)  # graph order: alike blocks export alike
        b.g.output(tuple(b.env[a] for a in b.exported))
        b.g.lint()
        pieces.append(Piece(graph_module(gm, b.g), r.key, tuple(slot[a] for a in b.reads),
                            tuple(slot[a] for a in b.exported),
                            tuple(sorted({slot[a] for a in b.reads if last[slot[a]] == i}))))
    return Cut(pieces, inputs, len(slot), results)


class _Builder:
    """The graph of one piece: its nodes copied, scalars recomputed, every other value read a placeholder."""

    def __init__(self, gm: fx.GraphModule, slot: dict[fx.Node, int], owner: dict[fx.Node, int], index: int) -> None:
        self.g = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.reads: list[fx.Node] = []  # values read from outside, in placeholder order
        self.exported: list[fx.Node] = []  # values other pieces (or the segment's outputs) read
        self.owner, self.index, self.gm = owner, index, gm

    def load(self, a: fx.Node) -> fx.Node:
        if a in self.env:
            return self.env[a]
        if a.op != "placeholder" and (self.owner.get(a) == self.index or (_scalar(a) and a not in self.owner)):
            self.env[a] = self.g.node_copy(a, self.load)
            return self.env[a]
        ph = self.g.placeholder(f"in{len(self.reads)}")
        ph.meta.update(a.meta)
        self.reads.append(a)
        self.env[a] = ph
        return ph


def structure_key(gm: fx.GraphModule) -> str:
    """A hash of ``gm``'s computation with node names left out: identical blocks give the same key, so a
    piece like one already compiled skips even its trace (with the same input signature). Kept in
    ``gm.meta`` for as long as ``gm`` holds the same graph with the same number of nodes."""
    mark = (id(gm.graph), len(gm.graph.nodes))
    kept = gm.meta.get("piper_structure_key")
    if kept is not None and kept[0] == mark:
        return kept[1]
    gm.meta["piper_structure_key"] = (mark, _structure_key(gm))
    return gm.meta["piper_structure_key"][1]


def _structure_key(gm: fx.GraphModule) -> str:
    index: dict[fx.Node, int] = {}
    h = hashlib.sha256()

    def arg(a: Any) -> str:
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return "(" + ",".join(map(arg, a)) + ")"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{arg(v)}" for k, v in a.items()) + "}"
        return repr(a)

    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        h.update(f"{n.op}|{n.target if n.op != 'placeholder' else ''}|{arg(n.args)}|{arg(n.kwargs)}\n".encode())
        if n.op == "get_attr":  # a constant: its value too
            value = getattr(gm, str(n.target), None)
            if isinstance(value, torch.Tensor):
                h.update(constant_bytes(value))
            else:
                h.update(repr(value).encode())
    return h.hexdigest()[:32]


class Runner:
    """Runs a :class:`Cut`'s pieces in order with the boxed calling convention (the argument list is
    consumed); ``compile(gm, args, label)`` gives each piece's function on its first run, with that run's
    inputs (pieces compile one after the other, each fed by the outputs of those before it)."""

    def __init__(self, cut_: Cut, compile_: Callable[[fx.GraphModule, list[Any], str], Callable[[list[Any]], Any]]) -> None:
        self.cut = cut_
        self._compile = compile_
        self._fns: list[Callable[[list[Any]], Any] | None] = [None] * len(cut_.pieces)

    def __call__(self, args: list[Any]) -> list[Any]:
        c = self.cut
        vals: list[Any] = list(args) + [None] * (c.slots - c.inputs)
        args.clear()
        for i, p in enumerate(c.pieces):
            ins = [vals[s] for s in p.inputs]
            for s in p.frees:
                vals[s] = None
            fn = self._fns[i]
            if fn is None:
                fn = self._fns[i] = self._compile(p.gm, ins, p.label)
            for s, v in zip(p.outputs, fn(ins)):
                vals[s] = v
        return [vals[s] for s in c.results]
