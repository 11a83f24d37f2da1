"""Loading a segment's compiled code on a warm run without re-tracing it.

On a cache hit, Inductor's FX graph cache still needs the graph it keys: ``codegen/compile.py`` re-traces
each segment piece with ``make_fx`` at concrete shapes, and Inductor hashes the result
(``FxGraphCache.prepare_key``) to find the entry it wrote last time. On a warm first step that is most of
the compile time left (a third of a second per few graphs, plus Inductor's one-time hashing of its own
sources). Both are the same for the same piece on the same inputs.

So once Inductor has compiled or loaded a piece, piper writes down which FX-cache entry it was, keyed by
what decides that entry: the piece's structure (``regional.structure_key``: ops, arguments, constants),
its inputs' shapes, strides, dtypes and devices, Inductor's settings and the other process-wide settings
its own key reads (thread count, default dtype, matmul precision, ...), autocast and SDPA state, torch's
sources (by path, size and modification time), piper's source, and the machine (CPU capability, GPU name and
capability, Triton version); a run with a custom Inductor pass set takes the full path. A later run with the same key loads the entry directly
(``FxGraphCache._lookup_graph``) and prepares it as Inductor does on a hit (``post_compile``), skipping
the trace and the hashing. A missing or unreadable entry, a piece whose traced graph held constants, or
any error on the way falls back to the full path: the shortcut can only cost a fallback, never different
code.

Inductor's load-by-key path is private and its signature moves between versions, so the shortcut is on by
default only where it is tested (torch 2.13 and later; ``PIPER_FAST_LOAD``).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
from typing import Any, Callable

import torch
from torch import fx

from piper_compile.disk import cache_root, fast_load_on, trace_settings, write_record


def enabled() -> bool:
    """``PIPER_FAST_LOAD``: ``auto`` is on from torch 2.13 (the Inductor internals it uses are tested there)."""
    import torch._inductor.config as inductor_config

    if inductor_config.triton.cudagraphs:  # a hit's preparation then needs what only compile_fx knows
        return False
    return fast_load_on()


@functools.cache
def _torch_sources() -> str:
    """torch's Python sources, as Inductor's own key sees them (``torch_key``: their contents), by each file's
    path, size and modification time: an edited file changes it, and walking them costs a third of
    reading them (which each rank of a warm run would otherwise pay before loading any code)."""
    lines: list[str] = [torch.__version__]
    _walk(os.path.dirname(torch.__file__), ".", lines)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _walk(path: str, rel: str, lines: list[str]) -> None:
    """``path``'s source files (as ``torch_key``: ``.py``, the AOTI interface ``.cpp``, the linker script
    ``.ld``) by path, size and time, in name order, below it first where a folder comes (symbolic links to
    folders are not followed)."""
    with os.scandir(path) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            _walk(e.path, f"{rel}/{e.name}", lines)
        elif e.name.endswith((".py", ".cpp", ".ld")):
            st = e.stat()
            lines.append(f"{rel}/{e.name}:{st.st_size}:{st.st_mtime_ns}")


@functools.cache
def _machine() -> str:
    """What of this machine decides Inductor's code beyond its configuration."""
    parts = [platform.machine(), platform.python_version(), torch.backends.cpu.get_cpu_capability(), _torch_sources()]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        parts += [props.name, f"{props.major}.{props.minor}", str(torch.version.cuda)]
        try:
            from importlib.metadata import version

            parts.append(version("triton"))
        except Exception:  # noqa: BLE001 - no Triton: nothing of it decides the code
            parts.append("-")
    return "|".join(parts)


_CUSTOM_PASSES = ("pre_grad_custom_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                  "joint_custom_pre_pass", "joint_custom_post_pass", "_pre_fusion_custom_pass",
                  "_post_fusion_custom_pass", "custom_partitioner_fn")


def _process() -> str | None:
    """The process-wide settings Inductor's own key reads besides its configuration (``FxGraphHashDetails``):
    C++ thread count, default dtype, CUDA matmul precision, determinism details, cache tag, provenance
    level, the current device; None when a custom Inductor pass is set (its effect is not in any key piper
    can compute, so such runs take the full path)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.codegen.common import custom_backend_passes
    from torch._inductor.utils import parallel_num_threads

    if any(getattr(inductor_config, name, None) is not None for name in _CUSTOM_PASSES) \
            or any(p is not None for p in custom_backend_passes.values()):
        return None
    matmul = torch.backends.cuda.matmul
    return repr((parallel_num_threads(), torch.get_default_dtype(),
                 [getattr(matmul, a, None) for a in ("fp32_precision", "allow_tf32",
                                                     "allow_fp16_reduced_precision_reduction",
                                                     "allow_bf16_reduced_precision_reduction")],
                 torch.is_deterministic_algorithms_warn_only_enabled(),
                 torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
                 torch.compiler.config.cache_key_tag, inductor_config.trace.provenance_tracking_level,
                 getattr(inductor_config, "_fuse_ddp_communication_passes", None),
                 torch.cuda.current_device() if torch.cuda.is_available() else -1))


def key(structure: str, signature: Any, settings: str) -> str | None:
    """The key of a piece's FX-cache entry: its structure, its inputs' signature and everything else that
    decides the code Inductor makes of it (see the module's docstring); None where piper cannot tell."""
    process = _process()
    if process is None:
        return None
    text = f"{structure}|{signature!r}|{settings}|{trace_settings()}|{process}|{_machine()}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(k: str) -> str:
    return os.path.join(cache_root(), "piper-artifacts", k)


def _recorded(k: str) -> str | None:
    try:
        with open(_path(k)) as fh:
            return fh.read().strip()
    except OSError:
        return None


def remember(k: str, static: fx.GraphModule, compiled: Any) -> None:
    """Write down the FX-cache entry ``compiled`` came from (a piece traced to ``static``), unless the record
    names it already; nothing for a graph holding constants (loading it needs the traced graph), an entry
    without a key, or a cache directory that cannot be written."""
    inductor_key = getattr(compiled, "_fx_graph_cache_key", None)
    if not inductor_key or static.graph.find_nodes(op="get_attr") or _recorded(k) == inductor_key:
        return
    write_record(_path(k), inductor_key)


def load(k: str, args: list[Any]) -> Callable[[list[Any]], Any] | None:
    """The compiled piece written down under ``k``, loaded from Inductor's cache for inputs like ``args``;
    None when there is none or it cannot be loaded (the caller compiles as usual)."""
    inductor_key = _recorded(k)
    if inductor_key is None:
        return None
    from piper_compile.codegen.cache import fakes_of

    try:
        return _lookup(inductor_key, fakes_of(args))
    except Exception as e:  # noqa: BLE001 - the full path works without the shortcut
        import logging

        logging.getLogger(__name__).debug("piper: fast load of %s failed (%s); compiling as usual", k, e)
        return None


def _lookup(inductor_key: str, fakes: list[Any]) -> Any:
    """Inductor's cache-hit path for a known key: the entry, with the post-processing a hit gets."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.output_code import CompiledFxGraphConstants
    from torch._inductor.utils import BoxedBool

    from piper_compile.codegen import light_load

    light_load.install()
    mode = detect_fake_mode(fakes)
    with torch.utils._python_dispatch._disable_current_modes(), tracing(TracingContext(mode)), \
            light_load.no_compiler_import():
        constants = CompiledFxGraphConstants()
        graph, _ = FxGraphCache._lookup_graph(inductor_key, fakes, True, None, constants)
        if graph is None:
            return None
        graph.post_compile(fakes, constants, {"cudagraphs": BoxedBool(False), "is_backward": False,
                                              "static_input_idxs": (), "boxed_forward_device_index": None})
    return graph
