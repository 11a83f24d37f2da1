"""Compile a segment for the concrete shapes it runs with.

Segments are captured with a symbolic batch size. At first execution with concrete inputs we retrace
the segment with ``make_fx`` (Inductor's decompositions, concrete shapes) and compile it with
``compile_fx_inner`` -- C++ on CPU, Triton on CUDA. One compiled artifact per input signature.
"""
from __future__ import annotations

import re
import time
import warnings
from typing import Any, Callable

import torch
from piper_compile.codegen import accumulate, artifacts, cache, regional, warmup
from piper_compile.knobs import knob
from piper_compile.sim.segment_memory import transient_bytes
from torch import fx

Signature = tuple[Any, ...]
_TRACED: dict[tuple[str, Signature, str], Any] = {}  # (structure_key, inputs, settings) -> Inductor's function


def forget_compiled() -> None:
    """Drop the functions kept for reuse in this process (tests that need a fresh compile)."""
    _TRACED.clear()
    cache.forget()


def _signature(args: list[Any]) -> Signature:
    """(shape, strides, dtype, device) of each tensor (or :class:`_Spec`) among ``args``; other args as they are."""
    return tuple((tuple(a.shape), tuple(a.stride()), a.dtype, str(a.device)) if isinstance(a, (torch.Tensor, _Spec))
                 else a for a in args)


class CompiledSegment:
    """Callable ``list of inputs -> list of outputs`` for one segment."""

    def __init__(self, name: str, gm: fx.GraphModule, mode: str = "inductor") -> None:
        if mode not in ("inductor", "eager"):
            raise ValueError(f"piper: codegen must be 'inductor' or 'eager', got {mode!r}")
        self.name = name
        self.gm = gm
        self.mode = mode
        self._cache: dict[Signature, Callable[[list[Any]], Any]] = {}
        self.compile_seconds = 0.0
        self.fallback: str | None = None  # why Inductor failed, when this segment runs eagerly instead
        self.fallback_op: str | None = None  # the op Inductor failed on, when the error names one
        self.fallback_source: str | None = None  # the user's source line that op came from
        # per graph compiled: "hit", "loaded" (a hit without re-trace: codegen/artifacts.py), "miss", "reused",
        # "bypass" or "off"
        self.outcomes: list[str] = []
        self.pieces = 1  # graphs the segment was cut into (codegen/regional.py: one per repeated block)
        self._cut: regional.Cut | None | bool = False  # False: not cut yet
        self._ahead: dict[tuple[Any, ...], Callable[[list[Any]], Any]] = {}  # compiled by precompile()
        self.fused: tuple[str, ...] = ()  # parameters whose gradients the segment accumulates itself
        self._outputs = 0  # outputs of the segment before fusing
        self._unfused = gm  # the graph before fusing (codegen="eager" fuses it its own way)
        self._fused: accumulate.Fused = ()  # (output position, buffer dtype) of each fused gradient
        self.temp_bytes = 0  # the largest fused gradient: held while it is written into its buffer
        self._transients: dict[tuple[Any, bool], int] = {}

    def fuse_gradients(self, fused: tuple[tuple[int, str, torch.dtype], ...]) -> None:
        """Before the segment first compiles: make it accumulate the gradients at these (output position,
        parameter, buffer dtype) into their buffers (``codegen/accumulate.py``); call it with the buffers
        and whether to add (:meth:`__call__`). Does nothing when a gradient's shape is not static."""
        positions = tuple(i for i, _, _ in fused)
        if self.fused or not fused or self._cache or self._ahead or not accumulate.fusable(self.gm, positions):
            return
        self._outputs = len(self.gm.graph.output_node().args[0])
        self._unfused = self.gm
        self._fused = tuple((i, d) for i, _, d in fused)
        self.temp_bytes = accumulate.temp_bytes(self.gm, positions)
        self.gm = accumulate.fuse(self.gm, self._fused)
        self.fused = tuple(f for _, f, _ in fused)

    def transient(self, symbols: dict[str, int], fused: bool, key: Any = None) -> int:
        """Bytes this segment holds while it runs beyond its inputs and kept outputs, at ``symbols``
        (``key``: a hashable stand-in for them, the step's; ``fused``: its gradients written into their
        buffers): ``sim/segment_memory``'s rule, as the memory plan counts it."""
        key = (tuple(sorted(symbols.items())) if key is None else key, fused)
        if key not in self._transients:
            dropped = tuple(i for i, _ in self._fused) if fused else ()
            self._transients[key] = max(self.temp_bytes if fused else 0, transient_bytes(
                self._unfused, symbols, dropped, self.mode != "eager"))
        return self._transients[key]

    def _regional(self) -> regional.Cut | None:
        if self._cut is False:
            self._cut = regional.cut(self.gm) if knob("PIPER_REGIONAL") else None
            self.pieces = 1 if self._cut is None else len(self._cut.pieces)
        return self._cut  # type: ignore[return-value]

    def _compile(self, args: list[Any]) -> Callable[[list[Any]], Any]:
        if self.mode == "eager":
            return accumulate.eager(self._unfused, self._fused) if self.fused else (lambda a: self.gm(*a))
        pieces = self._regional()
        if pieces is None:
            return self._compile_graph(self.gm, args, "")
        return regional.Runner(pieces, self._compile_graph)

    @property
    def unused_ahead(self) -> int:
        """Graphs :meth:`precompile` compiled that no run has used yet (their real inputs differed)."""
        return len(self._ahead)

    def precompile(self, symbols: dict[str, int], device: torch.device) -> None:
        """Compile this segment's graphs before it first runs, from their own input metadata at the size
        symbols' values (the first step's): a rank compiles every segment it runs before it waits on a
        peer, so pipeline stages compile at the same time instead of each after the one before it. The
        first run finds each function by its inputs' signature; a graph whose real inputs turn out
        different (another layout) is compiled then, as without this."""
        if self.mode == "eager":
            return
        cut = self._regional()
        graphs = [(self.gm, "")] if cut is None else [(p.gm, p.label) for p in cut.pieces]
        mode = None  # one fake mode for the pieces compiled here, made only if one is
        for gm, part in graphs:
            specs = input_specs(gm, symbols, device)
            if specs is None:
                continue  # a size known only when it runs
            same = (regional.structure_key(gm), _signature(specs), cache.settings())
            if same not in _TRACED and same not in self._ahead:  # else compiled already: no fakes needed
                mode = mode or _fake_mode()
                self._ahead[same] = self._compile_graph(gm, _fakes(specs, mode), part, same)

    def _compile_graph(self, gm: fx.GraphModule, args: list[Any], part: str,
                       same: tuple[str, Signature, str] | None = None) -> Callable[[list[Any]], Any]:
        """Inductor's function for ``gm`` (the segment, or its piece ``part``) on ``args`` (``same``: their
        key, when known); ``gm`` run eagerly, with a warning, when Inductor fails."""
        t0 = time.perf_counter()
        same = same or (regional.structure_key(gm), _signature(args), cache.settings())
        if same in self._ahead:  # compiled (and counted) ahead of the run
            return self._ahead.pop(same)
        if same in _TRACED:  # a graph like this one (another block, or segment) on inputs like these
            self.outcomes.append("reused")
            self.compile_seconds += time.perf_counter() - t0
            return _TRACED[same]
        try:
            compiled, outcome = self._inductor(gm, args, same)
            self.outcomes.append(outcome)
            _TRACED[same] = compiled
        except Exception as e:  # noqa: BLE001 - an Inductor bug must not stop training
            self._fell_back(gm, e, part)
            return lambda a: gm(*a)
        finally:
            self.compile_seconds += time.perf_counter() - t0
        return compiled  # boxed: it clears the list and frees each input after its last use

    def _fell_back(self, gm: fx.GraphModule, e: Exception, part: str) -> None:
        self.fallback = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        self.fallback_op = culprit_op(e)
        self.fallback_source = source_of(gm, self.fallback_op) if self.fallback_op else None
        where = f" (piece {part})" if part else ""
        if self.fallback_op:
            where += f" at {self.fallback_op}" + (f", from {self.fallback_source}" if self.fallback_source else "")
        warnings.warn(f"piper: Inductor could not compile segment {self.name} ({self.fallback}){where}; running "
                      "it eagerly (numerics unchanged; counted in piper.stats(step).fallbacks; set "
                      "codegen='eager' to silence)", stacklevel=3)

    @property
    def cache(self) -> str:
        """Inductor's FX graph cache for this segment: "miss" (a graph of it was compiled here), "hit"
        (loaded), "reused" (every graph's code was compiled in this process already), "bypass" or "off"."""
        for outcome in ("miss", "hit", "bypass", "off", "reused"):
            if outcome in self.outcomes or (outcome == "hit" and "loaded" in self.outcomes):
                return outcome
        return ""

    def _inductor(self, gm: fx.GraphModule, args: list[Any], same: tuple[str, Signature, str]) -> tuple[Any, str]:
        """(compiled function, cache outcome) of ``gm`` traced for ``args``' concrete shapes; ``same`` is its
        (structure key, input signature, Inductor settings)."""
        warmup.wait()
        args = _as_compiled_ahead(args)
        use_cache = bool(knob("PIPER_INDUCTOR_CACHE"))
        fast = artifacts.key(*same) if use_cache and artifacts.enabled() else None
        with torch.no_grad():
            if fast is not None:
                loaded = artifacts.load(fast, args)
                if loaded is not None:
                    return loaded, "loaded"
            from torch._inductor.decomposition import select_decomp_table  # a load does without its imports
            from torch.fx.experimental.proxy_tensor import make_fx

            static = make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
            compiled, how = cache.compile_once(static, args, use_cache=use_cache)
            if fast is not None and how in ("hit", "miss"):
                artifacts.remember(fast, static, compiled)
            return compiled, how

    def __call__(self, args: list[Any], key: Any = None, grads: tuple[Any, ...] = (), add: bool = False) -> list[Any]:
        """Run on ``args`` (the list is consumed: Inductor code clears it and drops each input after its
        last use, so inputs the caller no longer holds are freed during the segment). ``key`` (optional)
        stands for the input signature -- the runtime passes the step's symbol values, which determine
        every input shape -- so shapes are not re-hashed per call. A segment fusing gradients takes the
        buffers of :attr:`fused` as ``grads`` (overwritten, or added to when ``add``) and returns None in
        their outputs' places."""
        if self.fused:
            if len(grads) != len(self.fused):
                raise RuntimeError(f"piper: internal error: segment {self.name} accumulates {len(self.fused)} "
                                   f"gradients but was called with {len(grads)} buffers")
            args.extend(grads)
            args.append(accumulate.flag(grads[0].device, add))
            return accumulate.expand(self._run(args, key), tuple(i for i, _ in self._fused), self._outputs)
        return self._run(args, key)

    def _run(self, args: list[Any], key: Any) -> list[Any]:
        sig = _signature(args) if key is None else key
        fn = self._cache.get(sig)
        if fn is None:
            fn = self._cache[sig] = self._compile(args)
        with torch.no_grad():
            out = fn(args)
        return list(out)


def precompile(segments: dict[str, CompiledSegment], symbols: dict[str, int], device: torch.device,
               rank: int) -> None:
    """:meth:`CompiledSegment.precompile` of every segment (``PIPER_PRECOMPILE``), starting at a rank-
    dependent one: replicas that run the same segments compile different ones at once, and each then loads
    what the others compiled (``codegen/cache.py``)."""
    if not knob("PIPER_PRECOMPILE") or not segments:
        return
    names = sorted(segments)
    at = rank % len(names)
    for name in names[at:] + names[:at]:
        segments[name].precompile(symbols, device)


class _Spec:
    """A tensor input's metadata at concrete sizes, shaped like a tensor for :func:`_signature`."""

    def __init__(self, shape: list[int], stride: list[int], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self._stride, self.dtype, self.device = shape, stride, dtype, device

    def stride(self) -> list[int]:
        return self._stride


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def input_specs(gm: fx.GraphModule, symbols: dict[str, int], device: torch.device) -> list[Any] | None:
    """The inputs ``gm`` runs on when the size symbols take ``symbols``' values, from its placeholders'
    metadata: a tensor's concrete shape, strides, dtype and device (:class:`_Spec`), or an int; None when
    a size does not follow from them."""
    from piper_compile.capture.joint import eval_sym

    def size(s: Any) -> int:
        return int(s) if isinstance(s, int) else eval_sym(str(s.node.expr).replace(" ", ""), symbols)

    out: list[Any] = []
    try:
        for ph in gm.graph.find_nodes(op="placeholder"):
            val = ph.meta.get("val")
            if isinstance(val, torch.Tensor):
                where = _indexed(device) if val.device.type == device.type else val.device
                out.append(_Spec([size(d) for d in val.shape], [size(d) for d in val.stride()], val.dtype, where))
            elif isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool):
                out.append(size(val))
            else:
                return None
    except (TypeError, ValueError, AttributeError):  # a symbol without a value (an unbacked size)
        return None
    return out


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current>``, as tensors made on it report their device (signatures compare them)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _fakes(specs: list[Any], mode: Any) -> list[Any]:
    """Fake tensors of ``mode`` for the :class:`_Spec` among ``specs`` (ints as they are)."""
    with mode:
        return [torch.empty_strided(s.shape, s.stride(), dtype=s.dtype, device=s.device) if isinstance(s, _Spec)
                else s for s in specs]


def _as_compiled_ahead(args: list[Any]) -> list[Any]:
    """``args`` without ``requires_grad`` (no copy), as :meth:`CompiledSegment.precompile`'s fakes have them:
    torch 2.11's FX graph cache key reads it, so a graph compiled at first use (on the real parameters) and
    the same graph compiled ahead missed each other's cache entries. Inductor's code ignores it (a segment
    runs under ``no_grad``)."""
    return [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]


_TARGET = re.compile(r"target: ([\w.]+)")
_OP_NAME = re.compile(r"\b(?:aten|prims|torch\.ops\.\w+)\.\w+(?:\.\w+)?")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def culprit_op(exc: BaseException) -> str | None:
    """The op an Inductor failure is about: a fake-tensor exception's ``func``, a lowering error's
    ``target``, or the first op name in the messages of the exception chain."""
    chain, e, seen = [], exc, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    for e in chain:
        func = getattr(e, "func", None)  # DataDependentOutputException and its kin
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return str(func)
        found = _TARGET.search(str(e))
        if found:
            return found.group(1)
    found = next((m for e in chain for m in [_OP_NAME.search(str(e))] if m), None)
    return found.group(0) if found else None


def _packet(name: str) -> str:
    """``aten.tanh.default`` -> ``aten.tanh`` (any overload of the op); other names as they are."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("aten", "prims") and len(parts) == 3 else name


def source_of(gm: fx.GraphModule, op: str) -> str | None:
    """``file:line in function: code`` of the user's source of the first node of ``gm`` running ``op``
    (an overload name like ``aten.tanh.default`` or a packet like ``aten.tanh``)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and _packet(str(node.target)) == _packet(op):
            frames = _FRAME.findall(node.meta.get("stack_trace") or "")
            if frames:
                path, line, fn, code = frames[-1]
                return f"{path}:{line} in {fn}: {code.strip()}"
    return None
