"""Capturing each distinct joint graph once per machine: the AOTAutograd export on disk.

AOTAutograd's joint export (``capture/joint._export_joint``) is most of what a first step costs when
Inductor's cache already holds every segment: seconds per rank, paid again by every rank and every run.
Its result depends only on Dynamo's graph (code, constants, the metadata capture reads: tags, source lines,
module stacks), the placeholders' fake values (shapes, hints, strides, dtypes, devices), the AOTAutograd
configuration and the code of torch and piper. :func:`joint_key` hashes exactly those; :func:`exported`
keeps the exported graph under that key in Inductor's cache directory (``disk.cache_root``),
pickled with its node metadata by torch's ``GraphPickler`` (fake tensors and size symbols included).

Where a machine has fewer than two cores per rank, ranks missing an entry take turns on a machine-wide
lock per key, like segment compilation (``disk.one_at_a_time``): the first exports and writes, the others
wait and load what it wrote. Where each rank has two cores, they export side by side (waiting would add
the load to the export's time) and the first done writes. A second run of the job loads. The exported graph
and a loaded one plan alike (same code, same metadata: ``tests/unit/test_capture_cache.py``), and ranks
compare their plans' fingerprints at the first call. A graph whose key cannot be made safely (a module
call, or a custom op whose formulas the key cannot see) is exported every time (``"uncacheable"``); a
file that does not load is exported again and overwritten. ``PIPER_CAPTURE_CACHE`` chooses ("auto",
"turns", "each", "off").
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import operator
import os
import tempfile
from typing import Any, Callable, Iterator

import torch
from torch import fx
from torch._C._functorch import is_batchedtensor

from piper_compile.capture.subgraphs import calls_of, canonical_region_names
from piper_compile.disk import (TESTED_TORCH, cache_root, constant_bytes, one_at_a_time, torch_version,
                                 trace_settings, usable_cores)
from piper_compile.fxgraph import graph_module
from piper_compile.knobs import knob

log = logging.getLogger(__name__)

# Node metadata capture and its consumers read (regions, cuts, regional compilation, fallback messages),
# plus what AOTAutograd records for its own later use; provenance (``from_node``) and the source-function
# stacks (which hold the user's classes) are dropped, and so is ``tensor_meta``: nothing after the export
# reads it (segments are re-traced before Inductor sees them), it repeats ``val``'s symbolic sizes, and
# rebuilding those was a third of the load (8-layer GPT: 0.68 -> 0.44 s).
_KEEP = frozenset({"val", "custom", "stack_trace", "partitioner_tag", "nn_module_stack",
                   "fwd_nn_module_stack", "desc", "seq_nr", "is_gradient_acc", "original_aten",
                   "autograd_backward", "recompute", "ac_graph_id"})  # the last two: torch.utils.checkpoint's tags
_STACKS = ("nn_module_stack", "fwd_nn_module_stack")
_TORCH_MODULES = ("torch", "operator", "_operator", "math", "builtins", "piper_compile")
_SAFE_OP_NAMESPACES = frozenset({"aten", "prims", "piper", "_c10d_functional", "c10d_functional", "higher_order"})


def _hint(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        return x.node.hint
    return x


def _value_text(v: Any) -> str:
    """A placeholder's or node's fake value: symbolic and concrete shape, strides, dtype, device, kind."""
    if isinstance(v, torch.Tensor):
        # a value inside torch.vmap (a functorch BatchedTensor over a fake one) reads as the plain fake tensor
        # of its logical shape the forward cache keeps for it: the graph's vmap calls say that it is batched
        kind = "FakeTensor" if is_batchedtensor(v) else type(v).__name__
        return (f"T{kind}{tuple(v.shape)}{tuple(_hint(d) for d in v.shape)}{tuple(v.stride())}"
                f"{v.dtype}{v.device}{v.requires_grad}{isinstance(v, torch.nn.Parameter)}")
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"S{v}={_hint(v)}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_value_text(x) for x in v) + ")"
    return repr(v)


def _target_text(target: Any) -> str | None:
    """The name of a node's target, with the source of a Python function the key must see changes of;
    None when neither says what the target computes."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target) if str(target).split(".")[0] in _SAFE_OP_NAMESPACES else None
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop.{target.name()}"
    module = getattr(target, "__module__", None) or ""
    name = f"{module}.{getattr(target, '__qualname__', repr(target))}"
    if module.split(".")[0] in _TORCH_MODULES:
        return name
    try:
        return name + inspect.getsource(target)
    except (OSError, TypeError):
        return None


def _graph_text(gm: fx.GraphModule, h: Any, names: dict[str, str] | None = None,
                seen: set[int] | None = None) -> bool:
    """Feed ``gm``'s nodes (and its subgraphs and constants) into ``h``; False when one cannot be keyed. A
    subgraph or constant read again (a repeated block's body, once per call) is fed once, then named."""
    names = {} if names is None else names
    seen = set() if seen is None else seen
    for node in gm.graph.nodes:
        if node.op == "call_module":
            return False
        target = _target_text(node.target)
        if target is None:
            return False
        stacks = [[(p, getattr(c, "__qualname__", str(c))) for p, c in (node.meta.get(k) or {}).values()]
                  for k in _STACKS]
        h.update(canonical_region_names(f"{node.op}|{node.name}|{target}|{node.args}|{node.kwargs}|{node.meta.get('custom')}|"
                            f"{node.meta.get('stack_trace')}|{stacks}|{_value_text(node.meta.get('example_value'))}\n",
                            names).encode())
        if node.op == "get_attr" and not _attr_text(getattr(gm, str(node.target), None), h, names, seen):
            return False
    return True


def _attr_text(value: Any, h: Any, names: dict[str, str], seen: set[int]) -> bool:
    if value is not None and id(value) in seen:
        return True  # fed at its first read; the node's text names it
    seen.add(id(value))
    if isinstance(value, fx.GraphModule):
        return _graph_text(value, h, names, seen)
    if isinstance(value, torch.Tensor):
        h.update(_value_text(value).encode())
        if value.device.type != "meta" and not isinstance(value, torch._subclasses.FakeTensor):
            h.update(constant_bytes(value))
        return True
    return False


def joint_key(gm: fx.GraphModule, fakes: tuple[Any, ...]) -> str | None:
    """The cache key of the joint export of ``gm`` traced with ``fakes``; None: not cacheable."""
    h = hashlib.sha256(trace_settings().encode())
    if not _graph_text(gm, h):
        return None
    h.update(_value_text(tuple(fakes)).encode())
    return h.hexdigest()[:32]


def _directory() -> str:
    return os.path.join(cache_root(), "piper-capture")


def entry_path(key: str) -> str:
    """The file of the joint graph cached under ``key``."""
    return os.path.join(_directory(), f"{key}.pkl")


def _clean_meta(meta: dict[str, Any], inlined: bool = False) -> dict[str, Any]:
    """What the entry keeps of a node's metadata; ``inlined``: a region call or its ``getitem``, which
    capture replaces by the body's nodes (``capture/subgraphs.py``), so its fake value is never read (at
    32 layers they are most of the graph's values and half its load)."""
    out = {k: v for k, v in meta.items() if k in _KEEP and not (inlined and k == "val")}
    for k in _STACKS:  # classes by name: the model's own classes need not be importable to load
        if out.get(k):
            out[k] = {a: (p, getattr(c, "__qualname__", str(c))) for a, (p, c) in out[k].items()}
    return out


def _torch_attr(name: str) -> Any:
    return getattr(torch, name)


def _pickler() -> Any:
    """torch's ``GraphPickler``, writing memory formats and layouts by their name in ``torch``: pickle
    would name them through the first module holding ``torch`` (often ``__main__``), which another script
    does not have."""
    from torch.fx._graph_pickler import GraphPickler

    class Pickler(GraphPickler):
        def reducer_override(self, obj: object) -> Any:
            if isinstance(obj, (torch.memory_format, torch.layout)):
                return _torch_attr, (str(obj).removeprefix("torch."),)
            return super().reducer_override(obj)

    return Pickler


def _graphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the bodies of its nested compile regions."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


@contextlib.contextmanager
def pytree_registry_untouched() -> Iterator[None]:
    """Run ``GraphPickler`` against a copy of pytree's node registry. It registers ``slice`` for its work and
    removes it after, which bumps the version of ``torch.utils._pytree.SUPPORTED_NODES``; a model whose
    trace read the registry (transformers' models do) has a Dynamo guard on that version, built before
    piper's deferred capture ran, so the second call recompiled the step. The copy holds ``slice`` already:
    torch 2.11's pickler does not register it, so a Dynamo graph's ``x[:, :n]`` (a slice holding a node)
    stopped its writing with "Unexpected raw Node during pickling"."""
    from torch.utils import _pytree as pytree

    saved = pytree.SUPPORTED_NODES
    pytree.SUPPORTED_NODES = dict(saved)
    if slice not in saved:
        pytree.SUPPORTED_NODES[slice] = pytree.NodeDef(slice, _slice_children, _slice_of, None)
    try:
        yield
    finally:
        pytree.SUPPORTED_NODES = saved


def _slice_children(s: slice) -> tuple[list[Any], None]:
    return [s.start, s.stop, s.step], None


def _slice_of(children: list[Any], _context: None) -> slice:
    return slice(*children)


def _dumps(jgm: fx.GraphModule) -> bytes:
    from torch.fx._graph_pickler import Options

    saved = {n: n.meta for g in _graphs(jgm) for n in g.graph.nodes}
    try:
        calls = set(calls_of(jgm))
        for n in saved:
            n.meta = _clean_meta(n.meta, n in calls or (n.target is operator.getitem
                                                           and isinstance(n.args[0], fx.Node) and n.args[0] in calls))
        with pytree_registry_untouched():
            return _pickler().dumps(jgm, Options(ops_filter=None, node_metadata_key_filter=None))
    finally:
        for n, meta in saved.items():
            n.meta = meta


def _loads(data: bytes) -> fx.GraphModule:
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with warnings.catch_warnings(), pytree_registry_untouched():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation inside the unpickler
        gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True))
    assert isinstance(gm, fx.GraphModule)
    return graph_module(gm, gm.graph)  # its code made when first asked for (inlining rewrites it first)


def _load(path: str) -> fx.GraphModule | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as fh:
            return _loads(fh.read())
    except Exception as e:  # noqa: BLE001 - a stale or damaged entry: export again and overwrite it
        log.warning("piper: the cached joint graph %s did not load (%s: %s); capturing it again",
                    path, type(e).__name__, e)
        with contextlib.suppress(OSError):
            os.remove(path)
        return None


def _store(path: str, jgm: fx.GraphModule) -> bool:
    """Write ``jgm`` to ``path`` (atomically); False when its metadata cannot be pickled."""
    try:
        data = _dumps(jgm)
    except Exception as e:  # noqa: BLE001 - metadata the pickler cannot write: this graph is not cached
        log.info("piper: the joint graph is not cached (%s: %s)", type(e).__name__, e)
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)  # readers see the whole file or none
    return True


def _local_ranks() -> int:
    """Ranks of this job on this machine (torchrun's ``LOCAL_WORLD_SIZE``, else the process group's size)."""
    import torch.distributed as dist

    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit():
        return int(local)
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _take_turns(mode: str) -> bool:
    """Whether ranks missing the entry wait for one of them to export it ("turns"), or export side by side
    ("each"): "auto" exports side by side only where every rank has two cores of the machine (a rank's
    Inductor probe thread and compile workers run beside its export), as waiting adds the load to the
    export's time but saves the CPU of every other export."""
    if mode != "auto":
        return mode == "turns"
    return 2 * _local_ranks() > usable_cores()


def exported(gm: fx.GraphModule, fakes: tuple[Any, ...],
             export: Callable[[fx.GraphModule, tuple[Any, ...]], fx.GraphModule]) -> tuple[fx.GraphModule, str, str | None]:
    """``export(gm, fakes)``, or what an earlier export of the same key wrote: (graph, how, key) with how
    "captured" (exported here, and written unless another rank wrote it first), "loaded", "uncacheable"
    or "off" (``PIPER_CAPTURE_CACHE``; "auto" is off on a torch older than ``TESTED_TORCH``, whose
    ``GraphPickler``, a private module, no test here has run: an entry must never load subtly different)."""
    mode = knob("PIPER_CAPTURE_CACHE")
    if mode == "off" or (mode == "auto" and torch_version() < TESTED_TORCH):
        return export(gm, fakes), "off", None
    key = joint_key(gm, fakes)
    if key is None:
        return export(gm, fakes), "uncacheable", None
    path = entry_path(key)
    jgm = _load(path)
    if jgm is not None:
        return jgm, "loaded", key
    if _take_turns(mode):
        with one_at_a_time(f"capture-{key}"):
            if not os.path.exists(path):  # no rank holding the lock before wrote it: export it here
                jgm = export(gm, fakes)
                _store(path, jgm)
                return jgm, "captured", key
        jgm = _load(path)
        return (jgm, "loaded", key) if jgm is not None else (export(gm, fakes), "captured", key)
    jgm = export(gm, fakes)
    with one_at_a_time(f"capture-{key}"):  # the first rank done writes it
        if not os.path.exists(path):
            _store(path, jgm)
    return jgm, "captured", key
