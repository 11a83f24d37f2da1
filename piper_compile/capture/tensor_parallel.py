"""Tensor parallelism at capture: Dynamo's graph gets Megatron's markers around the sharded linear
layers and is captured with every rank's *local* parameter shapes.

For ``shard_tensor`` params ``{module glob: colwise | colwise:N | rowwise}``:

* column-parallel ``linear(x, W, b)``: ``x`` goes through ``tp_copy`` (its gradient is all-reduced);
  ``W`` ``[out, in]`` and ``b`` are split along ``out`` (``colwise:N``: each of N fused blocks is split);
* row-parallel ``linear(x, W, b)`` becomes ``tp_allreduce(linear(x, W)) + b`` with ``W`` split along ``in``.

The graph is then captured on fake parameters of the local shapes, so every later stage (segments,
DAG, Inductor) sees local shapes; activations between the layers (e.g. attention heads) are local too.
Sizes Dynamo baked into reshapes and expands (transformers' ``repeat_kv``) are fitted to the local
shapes first (``capture/tp_shapes.py``); what cannot be fitted gets an error naming the op.
"""
from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import fx

from piper_compile.capture.joint import fqn_from_source
from piper_compile.capture.tp_shapes import fit_local_shapes
from piper_compile.errors import PiperCaptureError
from piper_compile.ir.shard import ParamShard
from piper_compile.nn.tp import ALLREDUCE_OP, COPY_OP


def _linear_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (torch._C._nn.linear, torch.nn.functional.linear)]


def _arg(n: fx.Node, i: int, name: str) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name)


def shard_linears(gm: fx.GraphModule, sources: list[str], params: tuple[tuple[str, str], ...],
                  size: int) -> tuple[dict[str, ParamShard], dict[int, tuple[int, ...]]]:
    """Insert the markers into ``gm`` (in place) for every linear layer matched by ``params``; returns
    the shards by parameter FQN and the local shape of every sharded placeholder (by position)."""
    phs = gm.graph.find_nodes(op="placeholder")
    fqn_of = {ph: fqn_from_source(src) for ph, src in zip(phs, sources)}
    index = {ph: i for i, ph in enumerate(phs)}
    shards: dict[str, ParamShard] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    matched: set[str] = set()
    copies: dict[Any, fx.Node] = {}
    for lin in _linear_nodes(gm):
        x, w, b = _arg(lin, 0, "input"), _arg(lin, 1, "weight"), _arg(lin, 2, "bias")
        if not isinstance(w, fx.Node) or w not in fqn_of:
            continue
        module = fqn_of[w].rsplit(".", 1)[0]
        kind = next((k for pat, k in params if fnmatch.fnmatchcase(module, pat)), None)
        if kind is None:
            continue
        matched.update(pat for pat, _ in params if fnmatch.fnmatchcase(module, pat))
        base, _, n = kind.partition(":")
        parts = int(n) if n else 1
        for t in (w, b):
            if isinstance(t, fx.Node) and len(t.users) > 1:
                raise PiperCaptureError(f"piper: shard_tensor: {fqn_of[t]} is used outside the linear layer "
                                        f"{module} (a tied or shared weight), so it cannot be split there; "
                                        "leave that layer out of params")
        _check_divisible(w, 0 if base == "colwise" else 1, parts, size, fqn_of[w])
        if base == "colwise":  # one f per input, shared by the layers reading it (q, k, v: one all-reduce)
            if x not in copies:
                with gm.graph.inserting_before(lin):
                    copies[x] = gm.graph.call_function(COPY_OP, (x,))
            lin.replace_input_with(x, copies[x])
            targets = [(w, 0), (b, 0)]
        else:
            with gm.graph.inserting_after(lin):
                reduced = gm.graph.call_function(ALLREDUCE_OP, (lin,))
            lin.replace_all_uses_with(reduced, delete_user_cb=lambda u: u is not reduced)
            if isinstance(b, fx.Node):
                lin.args = (x, w, None) if len(lin.args) > 2 else lin.args
                lin.kwargs = {k: v for k, v in lin.kwargs.items() if k != "bias"}
                with gm.graph.inserting_after(reduced):
                    biased = gm.graph.call_function(torch.add, (reduced, b))
                reduced.replace_all_uses_with(biased, delete_user_cb=lambda u: u is not biased)
            targets = [(w, 1)]
        for t, dim in targets:
            if isinstance(t, fx.Node):
                shard = ParamShard(fqn_of[t], dim, parts if dim == 0 else 1, size)
                shards[shard.fqn] = shard
                shapes[index[t]] = shard.local_shape(tuple(t.meta["example_value"].shape))
    unmatched = [pat for pat, _ in params if pat not in matched]
    if unmatched:
        names = sorted({fqn_of[_arg(n, 1, "weight")].rsplit(".", 1)[0] for n in _linear_nodes(gm)
                        if _arg(n, 1, "weight") in fqn_of})
        raise PiperCaptureError(f"piper: shard_tensor: params {unmatched} match no linear layer of the model; its "
                                f"linear layers are {names[:12]}{' ...' if len(names) > 12 else ''}")
    fit_local_shapes(gm, local_fakes(gm, shapes), shards, fqn_of, size)
    gm.recompile()
    return shards, shapes


def _check_divisible(w: fx.Node, dim: int, parts: int, size: int, fqn: str) -> None:
    n = int(w.meta["example_value"].shape[dim])
    if n % (parts * size):
        raise PiperCaptureError(f"piper: shard_tensor: {fqn} has {n} {'output' if dim == 0 else 'input'} features, "
                                f"which do not split into {parts} block(s) x {size} ranks; pick a tensor-parallel "
                                "size that divides it")


def local_fakes(gm: fx.GraphModule, shapes: dict[int, tuple[int, ...]]) -> tuple[Any, ...]:
    """Dynamo's fake placeholder values, with the sharded parameters replaced by fakes of local shape."""
    fakes = []
    for i, ph in enumerate(gm.graph.find_nodes(op="placeholder")):
        fake = ph.meta["example_value"]
        if i in shapes:
            with fake.fake_mode:
                fake = torch.empty(shapes[i], dtype=fake.dtype, device=fake.device,
                                   requires_grad=fake.requires_grad)
        fakes.append(fake)
    return tuple(fakes)
