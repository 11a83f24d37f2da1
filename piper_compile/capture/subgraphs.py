"""Nested compile regions: repeated blocks traced once, then inlined into piper's flat joint graph.

With ``torch.compiler.nested_compile_region`` on a block's ``forward`` (piper applies it to repeated
blocks itself, ``capture/blocks.py``), Dynamo traces the block once and AOTAutograd exports its forward and
backward once: the joint graph calls a shared body per block (``invoke_subgraph``) instead of repeating
the block's ops, which makes the trace and the export of a deep model cost about what one block costs.

Everything after the capture (regions, cuts, segments, schedules) works on a flat graph whose every
node records its module, tags and pass, so :func:`inline_subgraphs` expands each call in place:

* a node of a body takes the **call's** module path and tags: the body recorded the module path and the
  outer tags of the call it was traced in (its *origin*, the first forward call of that body), which the
  inlined copy replaces by those of its own call; tags set inside the block's own code stay;
* AOTAutograd's backward body of a region recomputes the region's forward before its backward (the body
  is a joint graph of its own). The inlined recompute is the forward call's nodes again: each such node is
  matched to the node of the paired forward call with the same op and inputs, so the flat graph computes
  the forward once, as a capture without regions does (``tests/unit/test_nested_regions.py`` compares both).
"""
from __future__ import annotations

import contextlib
import logging
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import fx

from piper_compile.errors import PiperCaptureError

log = logging.getLogger(__name__)

_CALL_ID = "call_id"  # what torch's invoke_subgraph writes into meta["custom"]: not a tag of the user's
_STACKS = ("nn_module_stack", "fwd_nn_module_stack")
_PLUMBING = (operator.getitem, torch.ops.aten.detach.default)  # not computing: not counted as recomputed
Stack = list[tuple[str, Any]]


@contextlib.contextmanager
def schemas_once() -> Iterator[None]:
    """While inside, torch's ``invoke_subgraph`` makes the schema of each region body once, not per call.

    Under autograd every call of a region asks for its schema (to refuse in-place updates of its inputs in
    training), and making it traces the whole body again: at 32 layers that was two thirds of the export.
    The schema depends only on the body (which inputs it writes, which outputs alias), so one per body,
    its identifier and its operands' kinds, is the same answer."""
    op = invoke_subgraph()
    if op is None or not hasattr(op, "gen_schema"):
        yield
        return
    made: dict[tuple[Any, ...], Any] = {}
    original = type(op).gen_schema

    def gen_schema(subgraph: Any, identifier: Any, *operands: Any) -> Any:
        body = getattr(subgraph, "subgraph", subgraph)
        key = (id(body), identifier, tuple(type(o) for o in operands))
        if key not in made:
            made[key] = (body, original(op, subgraph, identifier, *operands))  # keeps body alive: ids stay unique
        return made[key][1]

    op.gen_schema = gen_schema  # type: ignore[method-assign]
    try:
        yield
    finally:
        del op.gen_schema


_REGION_NAME = re.compile(r"\bsubgraph_\d+\b")


def canonical_region_names(text: str, names: dict[str, str]) -> str:
    """``text`` with Dynamo's nested-region names (``subgraph_3``: a count per process, so a second model
    traced in one process gets other numbers) numbered by first appearance (``names``, shared across the
    texts of one graph) instead."""
    return _REGION_NAME.sub(lambda m: names.setdefault(m.group(0), f"region_{len(names)}"), text)


def graph_code(gm: fx.GraphModule) -> str:
    """The code of ``gm`` and of its region bodies, region names numbered by appearance."""
    names: dict[str, str] = {}
    return "\n".join(canonical_region_names(g.code, names) for g in gm.modules() if isinstance(g, fx.GraphModule))


def invoke_subgraph() -> Any:
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def calls_of(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``invoke_subgraph`` calls of ``gm``, in graph order."""
    op = invoke_subgraph()
    if op is None:
        return []
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


@dataclass
class _Call:
    """What a call's inlined nodes take from it: module stack, outer tags, pass."""

    node: fx.Node
    stack: Stack
    tags: dict[str, Any]
    backward: bool
    call_id: Any

    @staticmethod
    def of(node: fx.Node) -> "_Call":
        backward = node.meta.get("partitioner_tag") == "is_backward"
        raw = node.meta.get("fwd_nn_module_stack" if backward else "nn_module_stack") \
            or node.meta.get("nn_module_stack") or {}
        custom = dict(node.meta.get("custom") or {})
        call_id = custom.pop(_CALL_ID, None)
        return _Call(node, list(raw.values()), custom, backward, call_id)


@dataclass
class _Inliner:
    gm: fx.GraphModule
    joint: bool  # AOTAutograd's joint graph (its nodes record their pass), not Dynamo's graph
    origin: dict[str, _Call] = field(default_factory=dict)  # forward body's identifier -> its first call
    forward_of: dict[Any, _Call] = field(default_factory=dict)  # call_id -> the forward call
    made: dict[Any, dict[Any, fx.Node]] = field(default_factory=dict)  # call_id -> (op, inputs) -> node
    recomputed: int = 0  # forward nodes of a backward body with no match (computed again)
    unmatched: list[fx.Node] = field(default_factory=list)  # those nodes, of the call being inlined

    def run(self) -> int:
        calls = calls_of(self.gm)
        for node in calls:
            call = _Call.of(node)
            if not call.backward:
                self.forward_of.setdefault(call.call_id, call)
                self.origin.setdefault(_body_key(node), call)
        for node in calls:
            self._inline(_Call.of(node))
        self._drop_bodies()
        self.gm.graph.lint()
        self.gm.recompile()
        if self.recomputed:
            log.debug("piper: %d forward op(s) of nested regions' backward bodies are computed again",
                     self.recomputed)
        return len(calls)

    def _origin_of(self, call: _Call) -> _Call:
        fw = self.forward_of.get(call.call_id) if call.backward else call
        if fw is None:
            raise PiperCaptureError(f"piper: internal: the backward region call {call.node.name} has no "
                                    f"forward call (call_id {call.call_id})")
        return self.origin[_body_key(fw.node)]

    def _inline(self, call: _Call) -> None:
        node = call.node
        body = getattr(self.gm, str(node.args[0].target))
        origin = self._origin_of(call)
        made = self.made.setdefault(call.call_id, {})
        env: dict[fx.Node, Any] = dict(zip(body.graph.find_nodes(op="placeholder"), node.args[2:]))
        outputs: tuple[Any, ...] = ()
        with self.gm.graph.inserting_before(node):
            for n in body.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outputs = tuple(fx.node.map_arg(n.args[0], lambda a: env[a]))
                    continue
                env[n] = self._attr(body, n) if n.op == "get_attr" else self._copy(n, env, call, origin, made)
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise PiperCaptureError(f"piper: internal: region call {node.name} is read by {user.op} "
                                        f"{user.target}, not by getitem")
            user.replace_all_uses_with(outputs[user.args[1]])
            self.gm.graph.erase_node(user)
        self.gm.graph.erase_node(node)
        _hoist(self.gm.graph, self.unmatched)
        self.unmatched = []

    def _attr(self, body: fx.GraphModule, n: fx.Node) -> fx.Node:
        """A body's constant (or a region nested in it) as an attribute of the graph it is inlined into."""
        name = f"_region_{str(n.target).replace('.', '_')}"
        while hasattr(self.gm, name) and getattr(self.gm, name) is not getattr(body, str(n.target)):
            name += "_"
        setattr(self.gm, name, getattr(body, str(n.target)))
        new = self.gm.graph.get_attr(name)
        new.meta = dict(n.meta)
        return new

    def _copy(self, n: fx.Node, env: dict[fx.Node, Any], call: _Call, origin: _Call,
              made: dict[Any, fx.Node]) -> fx.Node:
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        if _is_item(n) and isinstance(args[0], fx.Node) and _is_item(args[0]):
            return args[0]  # Dynamo passes a stamped-out call the float its first call reads with .item()
        recompute = call.backward and n.meta.get("partitioner_tag") == "is_forward"
        key = (n.target, _frozen(args), _frozen(kwargs)) if n.op == "call_function" else None
        if recompute and key is not None and key in made:
            return made[key]
        self.recomputed += recompute and n.target not in _PLUMBING
        new = self.gm.graph.call_function(n.target, args, kwargs) if n.op == "call_function" \
            else self.gm.graph.node_copy(n, lambda a: env[a])
        new.meta = _meta_for(n.meta, call, origin, self.joint)
        if not call.backward and key is not None:
            made.setdefault(key, new)
        if recompute:
            self.unmatched.append(new)
        return new

    def _drop_bodies(self) -> None:
        for n in list(self.gm.graph.find_nodes(op="get_attr")):
            if not n.users and isinstance(getattr(self.gm, str(n.target), None), fx.GraphModule):
                self.gm.graph.erase_node(n)
                if not self.gm.graph.find_nodes(op="get_attr", target=n.target):
                    delattr(self.gm, str(n.target))


def _hoist(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Move forward ops that a backward body computes with no match in its forward call (AOTAutograd's
    ``detach`` of a value the backward saves, say) from the backward call's place to right after their
    last input, where a flat capture has them: passes that cut the forward by position (ZeRO-3's
    chunks) then find each block's forward ops together. ``nodes`` in the order they were made; each
    follows those of them it reads."""
    if not nodes:
        return
    pos = {n: i for i, n in enumerate(graph.nodes)}
    moved: set[fx.Node] = set()
    for n in nodes:
        inputs = n.all_input_nodes
        if not inputs:
            continue
        anchor = max(inputs, key=pos.__getitem__)
        while anchor.next in moved:  # after the nodes moved behind the same input before it
            anchor = anchor.next
        if anchor.next is not n:
            anchor.append(n)
        moved.add(n)
        pos[n] = pos[anchor]


def _body_key(node: fx.Node) -> str:
    """A forward call's body, by its identifier (``fw_subgraph_0``): each call gets an attribute of its own."""
    return str(node.args[1])


def _frozen(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, slice):
        return ("slice", _frozen(x.start), _frozen(x.stop), _frozen(x.step))
    return x


def _meta_for(meta: dict[str, Any], call: _Call, origin: _Call, joint: bool) -> dict[str, Any]:
    """A body node's metadata as the call's copy has it: the call's module path, tags and pass."""
    out = dict(meta)
    if meta.get("custom"):  # a node without tags (a gradient sum AOTAutograd added) keeps none, as in a flat capture
        inner = {k: v for k, v in meta["custom"].items()
                 if k != _CALL_ID and not (k in origin.tags and origin.tags[k] == v)}
        pairing = {_CALL_ID: meta["custom"][_CALL_ID]} if _CALL_ID in meta["custom"] else {}  # a region inside
        out["custom"] = {**call.tags, **inner, **pairing}
    for key in _STACKS:
        if meta.get(key):
            out[key] = _restack(list(meta[key].values()), call.stack, origin.stack)
    if joint and "partitioner_tag" not in meta:
        out["partitioner_tag"] = "is_backward" if call.backward else "is_forward"
    if call.backward and "fwd_nn_module_stack" not in out and "nn_module_stack" in out:
        out["fwd_nn_module_stack"] = out["nn_module_stack"]
    return out


def _restack(body: Stack, here: Stack, origin: Stack) -> dict[str, tuple[str, Any]]:
    """``body``'s module stack (recorded in the origin call) moved to the call whose stack is ``here``:
    the origin's outer entries become ``here``'s, and inner paths below the origin's block move below
    this call's block (``blocks.0.ln1`` -> ``blocks.5.ln1``)."""
    k = len(origin)
    if not here or k == 0 or [p for p, _ in body[:k]] != [p for p, _ in origin]:
        return {str(p): (p, c) for p, c in body}
    old, new = str(origin[-1][0]), str(here[-1][0])
    inner = [(new + str(p)[len(old):] if str(p).startswith(old) else p, c) for p, c in body[k:]]
    return {str(p): (p, c) for p, c in [*here, *inner]}


def _is_item(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "item"


def read_as_constant(item: fx.Node, value: float) -> None:
    """Replace the ``.item()`` read ``item`` by ``value`` in its users, and drop it."""
    for user in list(item.users):
        user.args = fx.node.map_arg(user.args, lambda a: value if a is item else a)
        user.kwargs = fx.node.map_arg(user.kwargs, lambda a: value if a is item else a)
    item.graph.erase_node(item)


def _float_value(a: Any, values: dict[fx.Node, float]) -> float | None:
    """The value of a region operand that is a float attribute of the model: the input itself, or (in a
    call Dynamo stamped out from an earlier one) its ``.item()``."""
    if not isinstance(a, fx.Node):
        return None
    if _is_item(a) and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    return values.get(a)


def specialize_region_floats(gm: fx.GraphModule, values: dict[fx.Node, float]) -> None:
    """Dynamo's graph ``gm``: the float inputs in ``values`` (a module's float attribute, read with
    ``.item()``) become constants inside the nested regions they are passed to, where every call of the
    region passes the same value at that position, and the operand is dropped from the calls. Where calls
    differ (layers with different ``eps``) every region call is inlined instead, and the caller makes the
    inlined reads constants as in a flat graph."""
    seen: dict[tuple[str, int], set[Any]] = {}
    calls = calls_of(gm)
    for call in calls:
        for pos, a in enumerate(call.args[2:]):
            seen.setdefault((str(call.args[1]), pos), set()).add(_float_value(a, values))
    chosen = {k: next(iter(v)) for k, v in seen.items() if len(v) == 1 and None not in v}
    conflict = [k for k, v in seen.items() if len(v) > 1 and v - {None}]
    bodies = {str(c.args[1]): getattr(gm, str(c.args[0].target)) for c in calls}
    usable = all(_is_item(u) for (name, pos) in chosen
                 for u in bodies[name].graph.find_nodes(op="placeholder")[pos].users)
    if conflict or not usable:
        inline_subgraphs(gm, joint=False)
        return
    for (name, pos), value in sorted(chosen.items(), key=lambda kv: -kv[0][1]):  # last position first
        ph = bodies[name].graph.find_nodes(op="placeholder")[pos]
        for item in list(ph.users):
            read_as_constant(item, value)
        bodies[name].graph.erase_node(ph)
        for call in calls:
            if str(call.args[1]) == name:
                dropped = call.args[2 + pos]
                call.args = (*call.args[:2 + pos], *call.args[3 + pos:])
                if isinstance(dropped, fx.Node) and _is_item(dropped) and not dropped.users:
                    gm.graph.erase_node(dropped)
    for body in {id(b): b for b in bodies.values()}.values():
        body.recompile()


def _fresh_names(gm: fx.GraphModule) -> None:
    """Copy ``gm``'s graph into a new one, whose names in use are exactly its nodes': FX also keeps the names
    of nodes erased since (AOTAutograd erases many), which a graph loaded from the capture cache does not
    have, so inlined nodes would be named differently in an exported graph and its loaded copy, and the
    ranks' plan fingerprints differ."""
    graph = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls, tracer_extras=gm.graph._tracer_extras)
    out = graph.graph_copy(gm.graph, {})
    graph.output(out).meta = dict(gm.graph.find_nodes(op="output")[0].meta)  # the outputs' descriptions
    graph._codegen = gm.graph._codegen
    gm.graph = graph


def inline_subgraphs(gm: fx.GraphModule, joint: bool = True) -> int:
    """Expand every ``invoke_subgraph`` call of ``gm`` (the joint graph, or with ``joint=False`` Dynamo's
    graph) in place; the number of calls."""
    total = 0
    for _ in range(8):  # a region inside a region is a call in the body: inlined in the next round
        if not calls_of(gm):
            return total
        if joint:  # Dynamo's graph keeps its own (its placeholders carry attributes a copy loses)
            _fresh_names(gm)
        total += _Inliner(gm, joint).run()
    raise PiperCaptureError("piper: nested compile regions are nested more than 8 deep; mark fewer of them")
