"""Joint forward+backward capture with AOTAutograd (``aot_export_joint_with_descriptors``).

The backend receives Dynamo's FX graph whose placeholders are parameters, buffers, SymInts and user
inputs. We export the joint graph with Dynamo's own fake tensors (so the batch dimension stays
symbolic), and describe every placeholder and output with a name the rest of piper uses.
"""
from __future__ import annotations

import contextlib
import operator
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

from piper_compile.capture.cache import exported
from piper_compile.capture.subgraphs import inline_subgraphs, schemas_once
from piper_compile.errors import PiperCaptureError
from piper_compile.fxgraph import graph_module
from piper_compile.ir.dag import BUFFER_PREFIX, PARAM_PREFIX
from piper_compile.ir.dims import dim_value

PARAM, BUFFER, INPUT, SYM, TANGENT = "param", "buffer", "input", "sym", "tangent"
TANGENT_VALUE = "tangent"


@dataclass
class InputSpec:
    """One placeholder of the joint graph."""

    kind: str  # param | buffer | input | sym | tangent
    name: str  # fqn for params/buffers, source name for inputs
    value: str  # DAG value name
    arg_index: int | None  # position in the compiled function's call args
    batched: bool = False  # sliced into micro-batches (inputs) / equal to the batch size (syms)
    symbol: Any = None  # sympy symbol for SymInt inputs
    cast_to: torch.dtype | None = None  # mixed precision: an input the step casts to this dtype (retrace.py)


@dataclass
class JointGraph:
    gm: fx.GraphModule
    inputs: list[InputSpec]
    value_of: dict[str, str]  # joint placeholder node name -> value name
    loss: str  # joint node name of the loss
    grad_of: dict[str, str]  # joint node name -> param fqn whose gradient it is
    params: dict[str, nn.Parameter]
    buffers: dict[str, torch.Tensor]
    batch_symbols: frozenset[Any]  # sympy symbols of the batch dimension (empty when it is static)
    batch_size: int  # the concrete batch size seen at capture
    dynamo_gm: fx.GraphModule
    how: str = "captured"  # "captured", "loaded" (capture/cache.py), "uncacheable" or "off"
    seconds: float = 0.0  # the joint export's (or its load's) wall time
    region_calls: int = 0  # nested compile region calls inlined (capture/subgraphs.py)
    key: str | None = None  # the joint-graph cache's key (None: not cached)

    def symbol_values(self, args: Any, mb_size: int) -> dict[str, int]:
        """The size symbols' values in a call with ``args`` split into micro-batches of ``mb_size``."""
        return {str(s.symbol): mb_size if s.batched else int(args[s.arg_index])
                for s in self.inputs if s.kind == SYM and s.symbol is not None}

    def batch_facts(self) -> dict[str, Any]:
        """The batch fields of the passes' context (``passes/context.PassContext``), as keywords."""
        return {"batched_values": {s.value for s in self.inputs if s.batched},
                "batch_symbols": {str(x) for x in self.batch_symbols}, "batch_size": self.batch_size,
                "static_batch_op": find_batch_constant(self.dynamo_gm, self.batch_size, self.batch_symbols),
                "specialized_input": specialized_input(self.inputs, self.dynamo_gm, self.batch_symbols,
                                                       self.batch_size)}

    def spec(self, value: str) -> InputSpec | None:
        for s in self.inputs:
            if s.value == value:
                return s
        return None


_KEY = re.compile(r"\['([^']+)'\]|\[(\d+)\]|\.(\w+)")
_SKIP = {"_modules", "_parameters", "_buffers"}


def source_names(gm: fx.GraphModule) -> list[str]:
    """Dynamo source of every placeholder (``L['self']._modules['a']._parameters['weight']``). Read it in
    the backend call: Dynamo drops ``grapharg`` from the graph's metadata once compilation ends."""
    return [_source_name(n) for n in gm.graph.find_nodes(op="placeholder")]


def _source_name(node: fx.Node) -> str:
    ga = node.meta.get("grapharg")
    src = getattr(ga, "source", None) or getattr(node, "_dynamo_source", None)
    if src is None:
        return node.meta.get("piper_source", node.name)  # a graph loaded from disk (capture/forward_cache.py)
    name = src.name() if callable(src.name) else src.name
    return str(name)


def fqn_from_source(source: str) -> str:
    """``L['self']._modules['blocks']._modules['0']._parameters['weight']`` -> ``blocks.0.weight``."""
    parts = [next(g for g in m.groups() if g is not None) for m in _KEY.finditer(source)]
    parts = [p for p in parts[1:] if p not in _SKIP]
    return ".".join(parts) or source


def _check_single_loss(gm: fx.GraphModule, sources: list[str]) -> None:
    out = gm.graph.find_nodes(op="output")[0]
    outs = out.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    vals = [o.meta.get("example_value") if isinstance(o, fx.Node) else o for o in outs]
    if len(vals) == 1 and _is_loss(vals[0]):
        return
    stored = _stored_buffers(gm, outs[1:], sources)
    if stored:
        raise PiperCaptureError(_buffer_update_error(stored, "in place (`self.calls += 1`)"))
    shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals]
    hint = ""
    if len(vals) > 1 and _is_loss(vals[0]) and not any(_is_loss(v) for v in vals[1:]):
        hint = (" A transformers model called with labels= returns its logits with the loss: compile a module "
                "whose forward returns the loss alone, e.g. `class WithLoss(nn.Module)` holding the model as "
                "`self.m` with `def forward(self, **batch): return self.m(**batch).loss`.")
    raise PiperCaptureError(
        f"piper: the captured graph returns {len(vals)} value(s) {shapes}, not one scalar loss. Either the "
        "model's forward does not return a scalar loss, stores a tensor on the model (`self.x = ...`), or "
        "Dynamo split the model into several graphs (a graph break: print(), .item(), data-dependent "
        "control flow). piper needs one graph for the whole step: return the loss from forward, and "
        "compile with fullgraph=True to see where the graph breaks (TORCH_LOGS=graph_breaks lists them)." + hint
    )


def _is_loss(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()


_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow}


def _stored_buffers(gm: fx.GraphModule, extra: list[Any], sources: list[str]) -> list[str]:
    """The buffers behind extra graph outputs that are in-place updates of them (``self.calls += 1``:
    Dynamo returns the new value to store it back on the module)."""
    source = dict(zip(gm.graph.find_nodes(op="placeholder"), sources))
    names: list[str] = []
    for o in extra:
        while isinstance(o, fx.Node) and o.op == "call_function" and o.target in _IN_PLACE:
            o = o.args[0]
        if isinstance(o, fx.Node) and o.op == "placeholder" and "_buffers" in source.get(o, ""):
            names.append(fqn_from_source(source[o]))
    return names


def _buffer_update_error(names: list[str], how: str) -> str:
    """What piper says of a forward that updates buffers ``names`` (``how``: the form it found)."""
    listed = ", ".join(f"'{n}'" for n in names)
    return (f"piper: the model's forward updates buffer{'s' if len(names) > 1 else ''} {listed} {how}. "
            "piper runs the forward once per micro-batch and replica, so the update would not happen as in "
            "eager training (once per step, on one copy), and it is not carried between steps yet. Do the "
            "update outside the compiled step (in the training loop, passing what forward needs as an "
            "argument), or use a module without running state (LayerNorm/RMSNorm rather than BatchNorm).")


def _describe_inputs(gm: fx.GraphModule, example_inputs: list[Any],
                     sources: list[str]) -> tuple[list[InputSpec], dict, dict]:
    specs: list[InputSpec] = []
    params: dict[str, nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    placeholders = gm.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(example_inputs):
        raise PiperCaptureError(f"piper: internal: {len(placeholders)} placeholders vs {len(example_inputs)} inputs")
    for i, (node, ex, src) in enumerate(zip(placeholders, example_inputs, sources)):
        if isinstance(ex, nn.Parameter):
            fqn = fqn_from_source(src)
            params[fqn] = ex
            specs.append(InputSpec(PARAM, fqn, PARAM_PREFIX + fqn, i))
        elif isinstance(ex, torch.Tensor) and "_buffers" in src:
            fqn = fqn_from_source(src)
            buffers[fqn] = ex
            specs.append(InputSpec(BUFFER, fqn, BUFFER_PREFIX + fqn, i))
        elif isinstance(ex, torch.Tensor):
            name = re.sub(r"[^A-Za-z0-9_.]", "", fqn_from_source(src).replace("L[", "")) or f"arg{i}"
            specs.append(InputSpec(INPUT, name, f"input:{name}", i))
        elif isinstance(ex, (int, torch.SymInt)):
            val = node.meta.get("example_value")
            sym = val.node.expr if isinstance(val, torch.SymInt) else None
            specs.append(InputSpec(SYM, node.name, f"sym:{node.name}", i, symbol=sym))
        else:
            raise PiperCaptureError(
                f"piper: graph input {src!r} has unsupported type {type(ex).__name__}; pass tensors (and ints) only"
            )
    return specs, params, buffers


def _batch_symbols(specs: list[InputSpec], gm: fx.GraphModule) -> tuple[frozenset[Any], int]:
    """The batch size and the symbols of every tensor input whose leading size is a plain symbol of that
    size: with duck shaping off, ``tokens`` and ``labels`` get different symbols for the same batch. The
    batch size is the symbolic leading size most tensor inputs share (the first input Dynamo lifted on a
    tie): Dynamo lifts inputs in the order forward first uses them, so a table forward reads before its
    samples (``x + table.mean(0)``) must not decide it. Empty symbols when the batch is static."""
    vals = [gm.graph.find_nodes(op="placeholder")[s.arg_index].meta["example_value"] for s in specs
            if s.kind == INPUT]
    vals = [v for v in vals if v.dim() > 0]
    if not vals:
        return frozenset(), 0
    symbolic = [v.shape[0] for v in vals if isinstance(v.shape[0], torch.SymInt) and v.shape[0].node.expr.is_Symbol]
    if not symbolic:
        return frozenset(), int(vals[0].shape[0])  # static, or SymInts Dynamo specialised to constants
    hints = [int(d.node.hint) for d in symbolic]
    batch = max(hints, key=lambda h: (hints.count(h), -hints.index(h)))
    return frozenset(d.node.expr for d, h in zip(symbolic, hints) if h == batch), batch


def specialized_input(specs: list[InputSpec], gm: fx.GraphModule, batch_symbols: frozenset[Any],
                      batch: int) -> str | None:
    """The first tensor input whose leading size was dynamic when Dynamo lifted it, and that a guard then
    fixed at the batch size while other inputs keep the batch dynamic: micro-batches would cut those and
    not this one (a size mismatch deep in the compiled step, or each micro-batch reading the whole tensor)."""
    if not batch_symbols:
        return None
    for s, node in zip(specs, gm.graph.find_nodes(op="placeholder")):
        val = node.meta["example_value"]
        if s.kind != INPUT or val.dim() == 0 or not isinstance(val.shape[0], torch.SymInt):
            continue
        expr = val.shape[0].node.expr
        if expr.is_number and int(expr) == batch:
            return s.name
    return None


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def source_of(node: fx.Node) -> str | None:
    """Where the user's code made ``node``: ``path:line in fn: `code` `` (the innermost frame of Dynamo's
    stack trace), or None when the graph recorded none."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    path, line, fn, code = frames[-1]
    return f"{path}:{line} in {fn}: `{code.strip()}`"


def describe_op(node: fx.Node, batch: int | None) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    where = source_of(node)
    return (f"{target}(... {batch} ...)" if batch is not None else f"{target}(...)") + (f" ({where})" if where else "")


def _int_args(node: fx.Node) -> list[int]:
    ints: list[int] = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda x: ints.append(x) if type(x) is int else None)
    return ints


def has_batch(size: Any, symbols: frozenset[Any]) -> bool:
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols & symbols)


def _batched(val: Any, symbols: frozenset[Any]) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() > 0 and has_batch(val.shape[0], symbols)


def find_batch_constant(gm: fx.GraphModule, batch: int, batch_symbols: frozenset[Any] = frozenset()) -> str | None:
    """Name the first op of Dynamo's graph that hard-codes the batch size: with a static batch, the
    first op holding the literal; with a symbolic one, an op that turns a batched input into an output
    whose leading dimension is that literal (``x.view(8, -1)``), which would run wrong on micro-batches.
    The bodies of nested compile regions are searched too."""
    for node in (n for g in gm.modules() if isinstance(g, fx.GraphModule) for n in g.graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        literal = batch in _int_args(node)
        if not batch_symbols:
            if literal:
                return describe_op(node, batch)
            continue
        out = node.meta.get("example_value")
        if not (isinstance(out, torch.Tensor) and out.dim() > 0):
            continue
        if not any(_batched(a.meta.get("example_value"), batch_symbols) for a in node.all_input_nodes):
            continue
        lead = out.shape[0]
        lead_batched = has_batch(lead, batch_symbols)
        if literal and not lead_batched and int(lead) == batch:
            return describe_op(node, batch)
        if _is_reshape(node) and not lead_batched:  # e.g. x.view(8, -1): samples mixed across rows
            return describe_op(node, None)
    return None


def _is_reshape(node: fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in ("view", "reshape", "_unsafe_view", "view_as", "reshape_as", "unflatten")


def capture_joint(gm: fx.GraphModule, example_inputs: list[Any], sources: list[str] | None = None,
                  fakes: tuple[Any, ...] | None = None) -> JointGraph:
    """Export the joint graph of Dynamo's graph ``gm`` and describe its inputs/outputs. ``fakes``: the
    placeholder values to trace with (default Dynamo's; tensor parallelism passes local shapes)."""
    sources = sources or source_names(gm)
    _check_single_loss(gm, sources)
    specs, params, buffers = _describe_inputs(gm, example_inputs, sources)
    if fakes is None:
        fakes = tuple(n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder"))
    t0 = time.perf_counter()
    jgm, how, key = exported(gm, tuple(fakes), _export_joint)
    regions = inline_subgraphs(jgm)  # after the cache: an entry keeps the compact graph
    seconds = time.perf_counter() - t0
    final_specs, value_of = _joint_inputs(jgm, specs)
    loss, grad_of = _joint_outputs(jgm, specs)
    batch_symbols, batch_size = _batch_symbols(specs, gm)
    _mark_batched(gm, specs, final_specs, batch_symbols)
    return JointGraph(jgm, final_specs, value_of, loss, grad_of, params, buffers, batch_symbols, batch_size, gm,
                      how, seconds, regions, key)


def _tracing_context(fakes: tuple[Any, ...]) -> Any:
    """A tracing context for the export, as Dynamo's own compile has: where AOTAutograd keeps what it
    traced of each nested compile region, so a region called k times is traced once, not k times."""
    from torch._guards import TracingContext, tracing

    if TracingContext.try_get() is not None:
        return contextlib.nullcontext()
    return tracing(TracingContext(torch._guards.detect_fake_mode(fakes)))


def _export_joint(gm: fx.GraphModule, fakes: tuple[Any, ...]) -> fx.GraphModule:
    """AOTAutograd's joint forward+backward graph of ``gm``, with flat placeholders and outputs."""
    try:
        with contextlib.ExitStack() as stack, torch.inference_mode(False), torch.enable_grad():
            stack.enter_context(_tracing_context(fakes))
            stack.enter_context(schemas_once())
            jgm = aot_export_joint_with_descriptors(stack, gm, fakes).graph_module
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise PiperCaptureError(
            f"piper: AOTAutograd could not export the joint forward+backward graph: {type(e).__name__}: {e}"
        ) from e
    jgm.graph._codegen = fx.graph.CodeGen()  # flat placeholders, flat outputs
    return graph_module(jgm, jgm.graph)  # its code made when first asked for (inlining rewrites it first)


def _joint_inputs(jgm: fx.GraphModule, specs: list[InputSpec]) -> tuple[list[InputSpec], dict[str, str]]:
    """The spec of every joint placeholder (the primals' in order, then tangents) and its value name."""
    value_of: dict[str, str] = {}
    primal_specs = iter(specs)
    final_specs: list[InputSpec] = []
    for node in jgm.graph.find_nodes(op="placeholder"):
        desc = type(node.meta.get("desc")).__name__
        tangent = desc.startswith("Tangent")
        spec = InputSpec(TANGENT, "tangent", TANGENT_VALUE, None) if tangent else next(primal_specs)
        final_specs.append(spec)
        value_of[node.name] = spec.value
    return final_specs, value_of


def _joint_outputs(jgm: fx.GraphModule, specs: list[InputSpec]) -> tuple[str, dict[str, str]]:
    """The loss output's name and the parameter each gradient output belongs to."""
    out_node = jgm.graph.find_nodes(op="output")[0]
    outs = list(out_node.args[0])
    descs = out_node.meta.get("desc") or [None] * len(outs)
    loss: str | None = None
    grad_of: dict[str, str] = {}
    mutated: list[Any] = []
    for o, d in zip(outs, descs):
        dname = type(d).__name__
        if dname == "PlainAOTOutput" and loss is None:
            loss = o.name
        elif dname == "GradAOTOutput" and o is not None:
            spec = specs[d.grad_of.idx]
            if spec.kind == PARAM and isinstance(o, fx.Node) and o.op != "placeholder":
                _check_dense(o, spec)
                grad_of[o.name] = spec.name
        elif dname not in ("GradAOTOutput", "PlainAOTOutput", "NoneType"):
            mutated.append(d)
    if mutated:
        raise PiperCaptureError(_mutation_error(mutated, specs) + _renorm_hint(jgm))
    assert loss is not None
    return loss, grad_of


def _check_dense(grad: fx.Node, spec: InputSpec) -> None:
    """Refuse a sparse gradient (``nn.Embedding(sparse=True)``): piper's buckets, reductions, clipping and
    optimizer runs are dense; torch failed deep in a segment instead."""
    val = grad.meta.get("val")
    if isinstance(val, torch.Tensor) and val.layout != torch.strided:
        raise PiperCaptureError(
            f"piper: the gradient of param '{spec.name}' is {val.layout} (nn.Embedding(sparse=True) or "
            "F.embedding(..., sparse=True)); piper reduces, buckets, clips and steps dense gradients. Build the "
            "embedding with sparse=False (the default): the dense gradient trains the same.")


def _renorm_hint(jgm: fx.GraphModule) -> str:
    """Where the in-place update is ``nn.Embedding(max_norm=...)``'s renormalization, what to do instead."""
    if not any("embedding_renorm" in str(n.target) for n in jgm.graph.nodes if n.op == "call_function"):
        return ""
    return (" Here it is nn.Embedding(max_norm=...), which renormalizes the rows it looks up in place on every "
            "call: build it without max_norm, or renormalize the weight under torch.no_grad() between steps.")


def _mutation_error(descs: list[Any], specs: list[InputSpec]) -> str:
    """The error for joint outputs ``descs`` that write inputs back (in-place updates in forward)."""
    idxs = [getattr(getattr(d, "mutated_input", None), "idx", None) for d in descs]
    found = [specs[i] for i in idxs if isinstance(i, int) and i < len(specs)]
    buffers = [s.name for s in found if s.kind == BUFFER]
    if buffers:
        return _buffer_update_error(buffers, "in place (`.mul_`, `.add_`, `.copy_`, BatchNorm's running statistics)")
    what = f"{found[0].kind} '{found[0].name}'" if found else f"an input ({descs[0]})"
    return (f"piper: the model's forward updates {what} in place; piper cannot carry an in-place update of "
            "an input through micro-batches and replicas. Compute on a copy (`x = x.clone()`, or an "
            "out-of-place op) inside forward.")


def _mark_batched(gm: fx.GraphModule, specs: list[InputSpec], final_specs: list[InputSpec],
                  batch_symbols: frozenset[Any]) -> None:
    """Set ``batched`` on size symbols and inputs that carry the batch; an input whose other dimension is
    the batch's symbol too cannot be sliced into micro-batches (error)."""
    for s in final_specs:
        if s.kind == SYM and s.symbol is not None:
            s.batched = s.symbol in batch_symbols
    for s, node in zip(specs, gm.graph.find_nodes(op="placeholder")):
        if s.kind != INPUT:
            continue
        val = node.meta["example_value"]
        for d, size in enumerate(val.shape[1:], start=1):
            if isinstance(size, torch.SymInt) and size.node.expr.free_symbols & batch_symbols:
                raise PiperCaptureError(
                    f"piper: dimension {d} of input {s.name!r} has the same symbolic size as the batch "
                    f"({size}), so slicing micro-batches would change it too. Dynamo unified them (a guard "
                    "in the model); mark only the batch dimension dynamic (torch._dynamo.mark_dynamic(x, 0) "
                    "with dynamic=None) or use a different batch size")
        s.batched = (val.dim() > 0 and isinstance(val.shape[0], torch.SymInt)
                     and val.shape[0].node.expr in batch_symbols)


def eval_sym(expr: str | int, values: dict[str, int]) -> int:
    """Evaluate a SymInt expression string with symbol values."""
    return dim_value(expr, values)
