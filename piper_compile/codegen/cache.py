"""Compiling each distinct segment once per job, and once per machine across runs.

Segments are compiled through Inductor's on-disk FX graph cache (``TORCHINDUCTOR_CACHE_DIR``, by default
one directory per user on the machine), which keys a graph by its code, input shapes and dtypes, the
Inductor configuration and the torch version. Ranks that run the same segment -- data-parallel replicas,
every rank of a ZeRO group, identical stages of interleaved schedules -- would otherwise all compile it at
the same moment, each missing the cache. ``disk.one_at_a_time`` makes them take turns per segment: a file lock
keyed by a hash of the same things, so the first rank compiles (a miss, written to the cache) and every
other rank then loads the artifact (a hit). Different segments compile in parallel. A mark beside the lock
says the artifact was written, after which ranks load it side by side without taking turns. A second run of
the job finds every segment in the cache. ``outcome`` reads Inductor's counters to say which it was.

Within one process, :func:`compile_once` keeps what it compiled by the same key, so a graph compiled
again -- the next identical block of a segment cut by ``codegen/regional.py``, or the same stage's segment
in another chunk -- reuses the function (the outcome "reused") without even loading it from disk.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Callable

import torch
from torch import fx

from piper_compile.disk import locks, one_at_a_time, constant_bytes


_COMPILED: dict[str, Callable[[list[Any]], Any]] = {}  # segment_key -> Inductor's function, this process

# Inductor lays the tensors around a CPU convolution out channels-last (its layout optimization, and the
# mkldnn fusions that replace aten.convolution), also a graph's outputs unless they are the user's, and
# compile_fx_inner takes none for the user's. The next segment, compiled for the joint graph's strides,
# then got channels-last tensors: a view of one failed to compile and to run eagerly (a conv net's step
# raised). Every segment output is the user's here (:func:`_outputs_as_traced`), with layout optimization
# off, so each keeps the strides piper planned with.
_FX_KWARGS: dict[str, Any] = {"layout_opt": False}


def forget() -> None:
    """Drop the functions compiled in this process (the on-disk cache stays)."""
    _COMPILED.clear()


def settings() -> str:
    """What else decides Inductor's code: its configuration and torch's deterministic mode."""
    import torch._inductor.config as inductor_config

    # the config module's own hash (kept until the configuration changes), as Inductor's cache key uses it
    return (f"{inductor_config.get_hash().hex()[:16]}{int(torch.are_deterministic_algorithms_enabled())}"
            f"{''.join(f'{k}={v}' for k, v in sorted(_FX_KWARGS.items()))}")


def segment_key(static: fx.GraphModule, args: list[Any]) -> str:
    """A hash of what the FX graph cache keys a segment by (its code, inputs, constants, the torch version)."""
    sig = [(tuple(a.shape), tuple(a.stride()), str(a.dtype), str(a.device)) if isinstance(a, torch.Tensor) else repr(a)
           for a in args]
    h = hashlib.sha256(f"{torch.__version__}|{settings()}|{static.code}|{sig}".encode())
    for node in static.graph.find_nodes(op="get_attr"):  # constants the graph holds: their values too
        value = getattr(static, str(node.target), None)
        if isinstance(value, torch.Tensor):
            h.update(constant_bytes(value))
    return h.hexdigest()[:32]


def compile_once(static: fx.GraphModule, args: list[Any], use_cache: bool = True) -> tuple[Any, str]:
    """(Inductor's function for ``static`` on inputs like ``args``, how it was had): "reused" (compiled in
    this process already), else through the FX graph cache with ranks taking turns ("hit", "miss",
    "bypass"), or "off" without the cache."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    key = segment_key(static, args)
    if key in _COMPILED:
        return _COMPILED[key], "reused"
    if not use_cache:
        compiled, how = compile_fx_inner(_outputs_as_traced(static), list(args), **_FX_KWARGS), "off"
    else:
        # A tracing context with a shape env lets Inductor's FX graph cache key the (static) graph.
        fakes = fakes_of(args)
        mode = detect_fake_mode(fakes)
        # Once a rank wrote the artifact, ranks load it side by side; only compiling takes turns.
        with (contextlib.nullcontext() if _written(key) else one_at_a_time(key)), tracing(TracingContext(mode)):
            before = counts()
            compiled = compile_fx_inner(_outputs_as_traced(static), fakes, **_FX_KWARGS)
            how = outcome(before, counts())
            if how in ("hit", "miss"):
                _mark_written(key)
    _COMPILED[key] = compiled
    return compiled, how


def _outputs_as_traced(static: fx.GraphModule) -> fx.GraphModule:
    """Mark every output of ``static`` as the user's: Inductor then gives each the strides it had before its
    own passes (as ``compile_fx`` does for a model's outputs)."""
    out = static.graph.find_nodes(op="output")[0]
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else out.args
    out.meta["user_visible_output_idxs"] = [i for i, v in enumerate(values) if isinstance(v, fx.Node)]
    return static


def fakes_of(args: list[Any]) -> list[Any]:
    """Fake example inputs for Inductor: ``args`` as they are when fake already (precompile's), else fakes of
    the real ones in a mode of their own. Inductor hashes a real tensor's values into its cache key (it takes
    it for a constant), so each rank's batch and weights would make a key of their own."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if detect_fake_mode(args) is not None:
        return list(args)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    return [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]


def _written(key: str) -> bool:
    """Whether a rank of this machine put segment ``key``'s artifact in the cache (so loading it needs no
    turn); a stale mark (the cache emptied since) only costs a compile without the lock."""
    return os.path.exists(os.path.join(locks(), f"{key}.done"))


def _mark_written(key: str) -> None:
    os.makedirs(locks(), exist_ok=True)
    with open(os.path.join(locks(), f"{key}.done"), "a"):
        pass


def counts() -> tuple[int, int]:
    """Inductor's FX graph cache (hits, misses) in this process so far."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])


def outcome(before: tuple[int, int], after: tuple[int, int]) -> str:
    """"hit" (loaded from the cache), "miss" (compiled, and written to it) or "bypass" (not cacheable)."""
    if after[0] > before[0]:
        return "hit"
    return "miss" if after[1] > before[1] else "bypass"
