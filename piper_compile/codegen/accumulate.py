"""Gradient accumulation inside the compiled backward segments.

A backward segment's parameter gradients used to come out of the segment as new tensors that the runtime
then added into the rank's gradient buffers (``GradBuffers.accumulate``: one more pass over every gradient,
per micro-batch). :func:`fuse` rewrites the segment's graph so that it writes them itself: each gradient
output ``g`` of parameter ``p`` becomes

    acc_p.copy_(where(add, acc_p + g, g))      # first write of the step: overwrite; later ones: add

where ``acc_p`` is ``p``'s view of its gradient buffer, an extra input, and ``add`` a 0-d boolean input
(``where`` rather than ``acc * add + g``: a buffer's stale contents may be inf or NaN). Inductor fuses the
add into the kernel that produces the gradient where it can, and writes the buffer in place. The
rewritten graph returns the segment's other outputs only; :func:`expand` puts ``None`` (the runtime's
"accumulated already") back in the gradients' places. The new nodes carry the module stack of the node
producing the gradient, so regional compilation (``codegen/regional.py``) keeps them in that block's piece.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

from piper_compile.fxgraph import graph_module

Fused = tuple[tuple[int, torch.dtype], ...]  # (output position, gradient buffer dtype) per fused gradient

_FLAGS: dict[tuple[str, bool], torch.Tensor] = {}


def flag(device: torch.device, add: bool) -> torch.Tensor:
    """The 0-d ``add`` input on ``device`` (one tensor per device and value, made once)."""
    key = (str(device), add)
    if key not in _FLAGS:
        _FLAGS[key] = torch.tensor(add, device=device)
    return _FLAGS[key]


def _fake_like(mode: Any, val: Any, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> Any:
    """A fake tensor (of fake mode ``mode``) for a new placeholder's metadata (read by
    ``compile.input_specs`` at precompile)."""
    with mode:
        return torch.empty(val.shape if shape is None else shape, dtype=dtype or val.dtype, device=val.device)


def fusable(gm: fx.GraphModule, positions: tuple[int, ...]) -> bool:
    """Whether the outputs at ``positions`` are static-shaped tensors (parameter gradients always are)."""
    outs = list(gm.graph.output_node().args[0])
    for i in positions:
        val = outs[i].meta.get("val") if isinstance(outs[i], fx.Node) else None
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
            return False
    return True


def temp_bytes(gm: fx.GraphModule, positions: tuple[int, ...]) -> int:
    """Bytes of the largest gradient output of ``gm`` at ``positions``: what a segment fusing them holds
    while one is written into its buffer. The kernel producing a gradient (a matmul: an extern call in
    Inductor's code, or an eager op) writes a fresh tensor, which is added into the buffer and dropped
    before the next gradient is made, so one such tensor is alive at a time (an upper bound where
    Inductor fuses the write into a reduction). The memory plan's rule is the same
    (``sim/memory_walk.memory_walk``)."""
    outs = list(gm.graph.output_node().args[0])
    vals = [outs[i].meta.get("val") for i in positions if isinstance(outs[i], fx.Node)]
    return max((v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)), default=0)


def fuse(gm: fx.GraphModule, fused: Fused, how: str = "where") -> fx.GraphModule:
    """``gm`` writing its gradient outputs at ``fused`` positions into buffers given as extra inputs: after
    its own inputs come one buffer per fused gradient (in ``fused`` order), then (``how="where"``) the 0-d
    ``add`` flag. ``how="copy"`` / ``"add"``: each gradient is copied / added in place (``copy_``, ``add_``:
    the runtime's own ops, for graphs run eagerly, which know on the host which one a call needs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()  # one per graph: making a mode costs more than the tensors
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        env[ph] = g.node_copy(ph, env.__getitem__)
    outs = list(gm.graph.output_node().args[0])
    writes: dict[fx.Node, list[tuple[fx.Node, torch.dtype]]] = {}
    for k, (i, dtype) in enumerate(fused):
        acc = g.placeholder(f"grad_acc{k}")
        acc.meta["val"] = _fake_like(fake, outs[i].meta["val"], dtype)
        writes.setdefault(outs[i], []).append((acc, dtype))
    mode: fx.Node | str = how
    if how == "where":
        mode = g.placeholder("grad_add")
        mode.meta["val"] = _fake_like(fake, outs[fused[0][0]].meta["val"], torch.bool, ())
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        env[n] = g.node_copy(n, env.__getitem__)
        for acc, dtype in writes.pop(n, []):
            _write(g, env[n], acc, mode, dtype, n.meta)
    for n, pending in writes.items():  # a gradient that is a segment input, passed through
        for acc, dtype in pending:
            _write(g, env[n], acc, mode, dtype, n.meta)
    taken = {i for i, _ in fused}
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for j, o in enumerate(outs) if j not in taken))
    g.lint()
    return graph_module(gm, g)


def _write(g: fx.Graph, grad: fx.Node, acc: fx.Node, add: fx.Node | str, dtype: torch.dtype,
           meta: dict[str, Any]) -> None:
    """``acc.copy_(where(add, acc + grad, grad))`` (``add`` a flag node), or ``acc.copy_(grad)`` /
    ``acc.add_(grad)`` (``add`` "copy" / "add"), right after ``grad`` (at the end for a segment input), the
    new nodes given ``grad``'s module stack."""
    aten = torch.ops.aten
    made: list[fx.Node] = []

    def call(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> fx.Node:
        after = made[-1] if made else (grad if grad.op != "placeholder" else None)
        if after is None:
            made.append(g.call_function(target, args, kwargs))
        else:
            with g.inserting_after(after):
                made.append(g.call_function(target, args, kwargs))
        return made[-1]

    if add == "copy":
        call(aten.copy_.default, (acc, grad))
    elif add == "add":
        call(aten.add_.Tensor, (acc, grad))
    else:
        cast = call(aten._to_copy.default, (grad,), {"dtype": dtype}) if meta["val"].dtype != dtype else grad
        summed = call(aten.add.Tensor, (acc, cast))
        call(aten.copy_.default, (acc, call(aten.where.self, (add, summed, cast))))
    for node in made:
        for k in ("nn_module_stack", "fwd_nn_module_stack", "stack_trace"):
            if k in meta:
                node.meta[k] = meta[k]


def eager(gm: fx.GraphModule, fused: Fused) -> Callable[[list[Any]], list[Any]]:
    """The fused segment's calling convention run without Inductor (``codegen="eager"``): the graph that
    copies or adds in place, as the call's flag says -- the runtime's own ops, one per gradient, each
    gradient dropped as soon as it is written (the memory plan counts none)."""
    graphs = {False: fuse(gm, fused, "copy"), True: fuse(gm, fused, "add")}

    def run(args: list[Any]) -> list[Any]:
        add = any(args[-1] is t for (_, value), t in _FLAGS.items() if value)  # one of flag()'s True tensors
        ins = args[:-1]
        args.clear()
        return list(graphs[add](*ins))

    return run


def expand(outs: list[Any], positions: tuple[int, ...], total: int) -> list[Any]:
    """The segment's outputs with ``None`` back in the fused gradients' places."""
    it = iter(outs)
    taken = set(positions)
    return [None if j in taken else next(it) for j in range(total)]


def fused_positions(program: Any) -> dict[str, tuple[tuple[int, str], ...]]:
    """Per segment of a training ``program``: (output position, parameter) of each gradient it accumulates
    itself -- all of a segment's gradients, when no other step reads any of them and every call of the
    segment returns them at the same positions; none with ``PIPER_FUSED_GRADS=0``. The one rule the runtime
    (``plan``) and the memory plan (``fused_values``) both follow."""
    from piper_compile.ir.ops import Segment
    from piper_compile.knobs import knob

    if not knob("PIPER_FUSED_GRADS"):
        return {}
    read = {v for ins in program.instrs for v in ins.node.inputs}
    found: dict[str, set[tuple[tuple[int, str], ...]]] = {}
    for ins in program.instrs:
        op = ins.node.op
        if isinstance(op, Segment) and op.grads:
            at = tuple((ins.node.outputs.index(v), f) for v, f in op.grads)
            found.setdefault(op.segment, set()).add(at if not any(v in read for v, _ in op.grads) else ())
    return {seg: next(iter(ats)) for seg, ats in found.items() if len(ats) == 1 and () not in ats}


def plan(program: Any, params: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, str, torch.dtype], ...]]:
    """``fused_positions`` with each gradient buffer's dtype: the parameter's (``GradBuffers``: fp32 under
    mixed precision)."""
    return {seg: tuple((i, f, params[f].dtype) for i, f in at) for seg, at in fused_positions(program).items()}


def fused_values(program: Any) -> frozenset[str]:
    """The gradient values of ``program`` its segments write into the gradient buffers themselves: they
    outlive no step as tensors of their own (the memory plan counts only the largest one of a step, while
    that step runs: :func:`temp_bytes`)."""
    segs = fused_positions(program)
    return frozenset(v for ins in program.instrs if getattr(ins.node.op, "segment", None) in segs
                     for v, _ in getattr(ins.node.op, "grads", ()))
