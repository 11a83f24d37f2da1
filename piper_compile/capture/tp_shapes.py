"""Local shapes for tensor parallelism: after :func:`~piper_compile.capture.tensor_parallel.shard_linears`
marked Dynamo's graph, rewrite the integer sizes that Dynamo baked in for the *full* model so the graph
runs on every rank's *local* shard.

Dynamo specializes shapes, so code such as transformers' ``repeat_kv``
(``x[:, :, None].expand(b, n_kv, n_rep, t, d).reshape(b, n_kv * n_rep, t, d)``) reaches the graph with
the full head counts as constants. :func:`fit_local_shapes` walks the graph in order on fake tensors of
the local shapes and, for every node reading a tensor split by a column-parallel layer, knows which of
its dimensions is split (the local size is ``1/size`` of the full one Dynamo recorded in
``meta["example_value"]``) and how many fused blocks that dimension holds (``colwise:N`` gives ``N``;
``chunk`` separates them). Then:

* ``view``/``reshape``/``unflatten``/``flatten``: the split dimension's shard is one contiguous block
  (per fused block), so in the full reshape it must be the outermost non-1 dimension of the group of
  dimensions it merges with, and the output dimension that gets split is the outermost one of its group
  past the fused-block index (``(b, t, 4*16) -> (b, t, 4, 16)`` splits the 4 heads). Integer sizes of
  that dimension are rewritten to the local size (``-1`` stays);
* ``expand``: the split dimension keeps its local size (``expand(b, 2, 2, t, d)`` on one local kv head
  becomes ``expand(b, 1, 2, t, d)``);
* ``split``/``chunk`` on the split dimension must cut along whole fused blocks; explicit sizes are
  rewritten to local ones;
* ``cat`` along the split dimension concatenates blocks;
* every other op must keep the split dimension (an op that reduces over it, indexes into it, or mixes
  along it -- softmax, layer_norm, ... -- would see only this rank's part): the output has at least as
  many split dimensions as its most split input, except the row-parallel linears, whose output is
  all-reduced.

Every executed node's local shape is checked against the full one (equal, or ``1/size`` along the split
dimensions); anything this cannot make consistent raises a :class:`PiperCaptureError` naming the op and
its source line. Nodes that read no split tensor are not touched.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
from torch import fx

from piper_compile.capture.joint import source_of
from piper_compile.errors import PiperCaptureError
from piper_compile.ir.shard import ParamShard

Split = dict[int, int]  # split dimension -> number of fused blocks in it (1: one contiguous shard)

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_RESHAPE = {"view", "reshape", "_unsafe_view", "unflatten", "flatten", "view_as", "reshape_as"}
_EXPAND = {"expand", "expand_as"}
_SPLIT = {"split", "split_with_sizes", "chunk"}
_CAT = {"cat", "concat", "concatenate"}
# ops that work along one dimension: (position, keyword, default) of that dimension argument
_ALONG_DIM = {"softmax": (1, "dim", None), "log_softmax": (1, "dim", None), "_softmax": (1, "dim", None),
              "cumsum": (1, "dim", None), "cumprod": (1, "dim", None), "logcumsumexp": (1, "dim", None),
              "flip": (1, "dims", None), "roll": (2, "dims", None), "sort": (1, "dim", -1), "argsort": (1, "dim", -1),
              "normalize": (2, "dim", 1), "unbind": (1, "dim", 0), "tensor_split": (2, "dim", 0),
              "narrow": (1, "dim", None), "select": (1, "dim", None), "index_select": (1, "dim", None),
              "gather": (1, "dim", None)}
_NORMS = {"layer_norm", "rms_norm", "group_norm"}


class _Unfit(Exception):
    """A rule found the local shapes inconsistent; the walker turns it into a PiperCaptureError."""


def fit_local_shapes(gm: fx.GraphModule, fakes: tuple[Any, ...], shards: dict[str, ParamShard],
                     fqn_of: dict[fx.Node, str], size: int) -> list[fx.Node]:
    """Rewrite the size arguments of ``gm`` (in place, no recompile) so it runs on the local shards.

    ``fakes``: the placeholder values with sharded parameters at their local shapes (``local_fakes``);
    ``shards``: how each parameter is split (by FQN); ``fqn_of``: the parameter FQN of each placeholder;
    ``size``: the tensor-parallel group size. Returns the nodes whose arguments were rewritten."""
    if size == 1 or not shards:
        return []
    colwise: dict[fx.Node, int] = {}
    rowwise: set[fx.Node] = set()
    for n in gm.graph.nodes:
        w = _linear_weight(n)
        shard = shards.get(fqn_of.get(w, "")) if w is not None else None
        if shard is not None and shard.dim == 0:
            colwise[n] = shard.parts
        elif shard is not None:
            rowwise.add(n)
    with _no_new_guards(fakes):
        return _Walker(gm, size, colwise, rowwise).run(fakes)


def _no_new_guards(fakes: tuple[Any, ...]) -> Any:
    """The walk runs ops on Dynamo's fakes only to learn local shapes: it must not add guards to Dynamo's
    shape environment. On torch 2.11 a row-parallel ``linear`` on the local shard evaluated ``batch == 4``
    there, which specialized the batch and sequence sizes of the whole capture (a static joint graph, so
    micro-batches were cut from the targets but not from the tokens)."""
    mode = torch._guards.detect_fake_mode(fakes)
    env = getattr(mode, "shape_env", None)
    return env.suppress_guards() if env is not None else contextlib.nullcontext()


def _linear_weight(n: fx.Node) -> fx.Node | None:
    if n.op != "call_function" or n.target not in _LINEAR:
        return None
    w = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
    return w if isinstance(w, fx.Node) else None


# -- shape rules (full shapes as ints; raise _Unfit) ----------------------------------------------------

def _groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up the dimensions of two shapes of equal numel into groups of equal products."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            gi, pa, i = [i], a[i], i + 1
        if j < len(b):
            gj, pb, j = [j], b[j], j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa, i = pa * a[i], i + 1
            elif pb < pa and j < len(b):
                gj.append(j)
                pb, j = pb * b[j], j + 1
            else:
                raise _Unfit(f"the full shapes {tuple(a)} and {tuple(b)} do not have the same number of elements")
        groups.append((gi, gj))
    return groups


def reshape_split(full_in: list[int], full_out: list[int], split: Split, size: int) -> Split:
    """Where the split (and its fused blocks) lands after reshaping ``full_in`` to ``full_out``."""
    out: Split = {}
    for gi, gj in _groups(full_in, full_out):
        dims = [d for d in gi if d in split]
        if not dims:
            continue
        if len(dims) > 1:
            raise _Unfit(f"it merges two split dimensions {dims}")
        d = dims[0]
        outer = [i for i in gi if i < d and full_in[i] != 1]
        if outer:
            raise _Unfit(f"it merges the split dimension {d} (size {full_in[d]}) under the outer dimension(s) "
                         f"{outer} (sizes {[full_in[i] for i in outer]}), so this rank's part of the merged "
                         "dimension is not one block")
        j, blocks = _split_target(gj, full_out, split[d], size)
        out[j] = blocks
    return out


def _split_target(gj: list[int], full_out: list[int], k: int, size: int) -> tuple[int, int]:
    """The output dimension of a group that carries a split with ``k`` fused blocks, and its blocks."""
    p = 1
    for j in gj:
        e = full_out[j]
        if e == 1:
            continue
        if k % (p * e) == 0:  # an index over the fused blocks (the 3 of a fused qkv): not split
            p *= e
            continue
        if (p * e) % k:
            raise _Unfit(f"its dimension {j} (size {e}) cuts across the {k} fused blocks of the split dimension")
        r = k // p
        if (e // r) % size:
            what = f"size {e}" if r == 1 else f"{r} fused blocks of size {e // r}"
            raise _Unfit(f"the split lands on its dimension {j} ({what}: e.g. the attention heads), which does not "
                         f"divide over {size} ranks")
        return j, r
    raise _Unfit(f"no output dimension of sizes {[full_out[j] for j in gj]} can carry the split")


def expand_split(full_in: list[int], full_out: list[int], split: Split) -> Split:
    """``expand`` keeps a split dimension where it is (right-aligned)."""
    offset = len(full_out) - len(full_in)
    out: Split = {}
    for d, k in split.items():
        if full_out[d + offset] != full_in[d]:
            raise _Unfit(f"it broadcasts the split dimension {d} (size {full_in[d]}) to {full_out[d + offset]}")
        out[d + offset] = k
    return out


def split_sizes(full: int, k: int, sizes: list[int], size: int) -> list[int]:
    """Blocks in each piece of ``split(sizes)`` along a split dimension of ``full`` entries in ``k`` blocks."""
    block = full // k
    if any(s % block for s in sizes):
        raise _Unfit(f"its pieces {sizes} are not whole fused blocks ({k} of {block} entries, split over "
                     f"{size} ranks) of the split dimension; use colwise:N for a layer whose output is N fused parts")
    return [s // block for s in sizes]


def local_shape(full: list[int], split: Split, size: int) -> list[int]:
    return [n // size if d in split else n for d, n in enumerate(full)]


def rewrite_sizes(sizes: list[Any], full: list[int], local: list[int], value: Callable[[fx.Node], Any],
                  divide: Callable[[fx.Node], fx.Node]) -> list[Any]:
    """``sizes`` (ints, -1 or SymInt nodes) with the entries whose local size differs set to it: an int
    equal to the full size becomes the local one, a node whose value (``value``) is the full size is
    divided by the tensor-parallel size (``divide`` inserts that division)."""
    new = list(sizes)
    for j, (a, f, l) in enumerate(zip(sizes, full, local)):
        if f == l or a == -1:
            continue
        if isinstance(a, int) and a == f:
            new[j] = l
        elif isinstance(a, fx.Node) and _hint(value(a)) in (f, l):
            new[j] = a if _hint(value(a)) == l else divide(a)
        else:
            raise _Unfit(f"its size {a!r} for dimension {j} is neither the full size {f} nor -1, so it cannot be "
                         f"rewritten to the local size {l}")
    return new


# -- the walk ---------------------------------------------------------------------------------------------

class _Walker:
    """Runs ``gm`` on local fakes node by node, rewriting size arguments (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, size: int, colwise: dict[fx.Node, int], rowwise: set[fx.Node]) -> None:
        self.gm, self.size, self.colwise, self.rowwise = gm, size, colwise, rowwise
        self.env: dict[fx.Node, Any] = {}
        self.split: dict[fx.Node, Any] = {}  # Split for a tensor, a list of them for a tuple of tensors
        self.rewritten: list[fx.Node] = []

    def run(self, fakes: tuple[Any, ...]) -> list[fx.Node]:
        phs = self.gm.graph.find_nodes(op="placeholder")
        mode = next((f.fake_mode for f in fakes if isinstance(f, torch.Tensor) and hasattr(f, "fake_mode")), None)
        for ph, fake in zip(phs, fakes):
            self.env[ph] = fake
            full = ph.meta.get("example_value")
            if isinstance(fake, torch.Tensor) and isinstance(full, torch.Tensor) and fake.shape != full.shape:
                self.split[ph] = self._compare(ph, fake, full)
        with mode if mode is not None else contextlib.nullcontext(), torch.no_grad():
            for n in self.gm.graph.nodes:
                if n.op not in ("placeholder", "output"):
                    self._visit(n)
        return self.rewritten

    def _visit(self, n: fx.Node) -> None:
        if not any(a in self.split for a in n.all_input_nodes):
            # reads nothing local: the full value is the local one; piper's markers have none recorded
            marker = isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "piper"
            self.env[n] = self._execute(n) if marker else n.meta.get("example_value")
            return
        try:
            self.split[n] = self._fit(n)
        except _Unfit as e:
            raise _error(n, str(e), self.size) from None

    def _fit(self, n: fx.Node) -> Any:
        op, x = _op(n), n.args[0] if n.args else None
        if op in _RESHAPE | _EXPAND and isinstance(x, fx.Node) and x in self.split:
            return self._fit_reshape(n, op, x)
        if op in _SPLIT and isinstance(x, fx.Node) and self._split_dim(n, x) in self.split.get(x, {}):
            return self._fit_split(n, op, x)
        if op in _CAT and isinstance(x, (list, tuple)):
            cat = self._cat_split(n, x)
            if cat is not None:
                return cat
        if op == "getitem" and isinstance(self.split.get(x), list) and isinstance(n.args[1], int):
            self.env[n] = self._execute(n)
            return self.split[x][n.args[1]]
        return self._fit_generic(n, op)

    def _fit_reshape(self, n: fx.Node, op: str, x: fx.Node) -> Split:
        full_in, full_out = _shape(self._full(x)), _shape(n.meta["example_value"])
        rule = expand_split if op in _EXPAND else lambda a, b, s: reshape_split(a, b, s, self.size)
        out = rule(full_in, full_out, self.split[x])
        local = local_shape(full_out, out, self.size)
        self._rewrite(n, op, full_out, local)
        self.env[n] = self._execute(n)
        if _shape(self.env[n]) != local:
            raise _Unfit(f"on the local shard it gives {tuple(_shape(self.env[n]))}, not {tuple(local)}")
        return out

    def _rewrite(self, n: fx.Node, op: str, full_out: list[int], local: list[int]) -> None:
        found = _sizes_arg(n, op)
        if found is None:
            return
        sizes, start, put = found
        span = slice(start, start + len(sizes))
        new = rewrite_sizes(sizes, full_out[span], local[span], lambda a: self.env[a], lambda a: self._divide(n, a))
        if new != sizes:
            put(new)
            self.rewritten.append(n)

    def _divide(self, n: fx.Node, a: fx.Node) -> fx.Node:
        """Insert ``a // size`` before ``n`` (a full size read off a whole tensor, e.g. ``x.shape[-1]``)."""
        with self.gm.graph.inserting_before(n):
            d = self.gm.graph.call_function(operator.floordiv, (a, self.size))
        d.meta.update(stack_trace=n.meta.get("stack_trace"))
        self.env[d] = self.env[a] // self.size
        return d

    def _split_dim(self, n: fx.Node, x: fx.Node) -> int:
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
        return dim % len(_shape(self._full(x))) if isinstance(dim, int) else -1

    def _fit_split(self, n: fx.Node, op: str, x: fx.Node) -> list[Split]:
        d = self._split_dim(n, x)
        full, k = _shape(self._full(x))[d], self.split[x][d]
        arg = n.args[1] if len(n.args) > 1 else n.kwargs.get("split_size_or_sections", n.kwargs.get("chunks"))
        if not all(isinstance(a, int) for a in (arg if isinstance(arg, (list, tuple)) else [arg])):
            raise _Unfit(f"its sizes {arg!r} along the split dimension {d} are computed, not constants")
        if op == "chunk":
            if full % arg or k % arg:
                raise _Unfit(f"chunk({arg}) does not cut the split dimension {d} ({k} fused block(s)) along whole "
                             "blocks; use colwise:N for a layer whose output is N fused parts")
            blocks = [k // arg] * arg
        else:
            sizes = [arg] * (full // arg) if isinstance(arg, int) else list(arg)
            blocks = split_sizes(full, k, sizes, self.size)
            local = arg // self.size if isinstance(arg, int) else [s // self.size for s in sizes]
            n.args = (n.args[0], local, *n.args[2:]) if len(n.args) > 1 else n.args
            self.rewritten.append(n)
        self.env[n] = self._execute(n)
        split = [{**{e: 1 for e in self.split[x] if e != d}, d: b} for b in blocks]
        fulls = n.meta["example_value"]
        for piece, full_piece, s in zip(self.env[n], fulls, split):
            if _shape(piece) != local_shape(_shape(full_piece), s, self.size):
                raise _Unfit(f"on the local shard its pieces have shape {tuple(piece.shape)}")
        return split

    def _cat_split(self, n: fx.Node, xs: list[Any] | tuple[Any, ...]) -> Split | None:
        full = _shape(n.meta["example_value"])
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        d = dim % len(full)
        splits = [self.split.get(a, {}) if isinstance(a, fx.Node) else {} for a in xs]
        if not any(d in s for s in splits):
            return None
        if not all(d in s for s in splits):
            raise _Unfit(f"it concatenates split and whole tensors along the split dimension {d}")
        self.env[n] = self._execute(n)
        out = {**splits[0], d: sum(s[d] for s in splits)}
        if _shape(self.env[n]) != local_shape(full, out, self.size):
            raise _Unfit(f"on the local shard it gives {tuple(self.env[n].shape)}")
        return out

    def _fit_generic(self, n: fx.Node, op: str) -> Any:
        self._check_mixing(n, op)
        self.env[n] = local = self._execute(n)
        full = n.meta.get("example_value")
        most = max((len(s) for a in n.all_input_nodes if isinstance(s := self.split.get(a), dict)), default=0)
        if full is None:  # inserted by piper (a bias add after the all-reduce): on whole tensors only
            if most:
                raise _Unfit("piper inserted it on a tensor split by shard_tensor (internal)")
            return {}
        if isinstance(local, torch.Tensor):
            return self._tensor_split(n, local, full, most)
        if isinstance(local, (list, tuple)) and not isinstance(local, torch.Size):
            return [self._tensor_split(n, lv, fv, most) if isinstance(lv, torch.Tensor) else {}
                    for lv, fv in zip(local, full)]
        return {}  # a size read off a local tensor: executed, nothing split

    def _tensor_split(self, n: fx.Node, local: torch.Tensor, full: Any, most: int) -> Split:
        out = self._compare(n, local, full)
        if len(out) < most and n not in self.rowwise:
            raise _Unfit("it reduces over, indexes into or broadcasts against the split dimension, so each rank "
                         "would compute on its part only")
        if n in self.colwise:
            return {d: self.colwise[n] for d in out}
        return self._carry_blocks(n, out, _shape(full))

    def _carry_blocks(self, n: fx.Node, out: Split, full_out: list[int]) -> Split:
        """Fused blocks survive an op that keeps the split dimension's full size (elementwise, transpose)."""
        fused = [(a, d, k) for a in n.all_input_nodes if isinstance(s := self.split.get(a), dict)
                 for d, k in s.items() if k > 1]
        if not fused or n in self.colwise:
            return out
        a, d, k = fused[0]
        same = [j for j in out if full_out[j] == _shape(self._full(a))[d]]
        if len(fused) > 1 or len(out) != 1 or not same:
            raise _Unfit(f"the {k} fused blocks of a colwise:{k} output reach it before chunk() separates them")
        return {same[0]: k}

    def _check_mixing(self, n: fx.Node, op: str) -> None:
        x = n.args[0] if n.args else None
        split = self.split.get(x) if isinstance(x, fx.Node) else None
        if not isinstance(split, dict) or not split:
            return
        ndim = len(_shape(self._full(x)))
        if op in _NORMS:
            shape = n.args[1] if len(n.args) > 1 else n.kwargs.get("normalized_shape")
            count = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
            dims = set(range(ndim - count, ndim)) if op != "group_norm" else {1}
        elif op in _ALONG_DIM:
            pos, key, default = _ALONG_DIM[op]
            dim = n.args[pos] if len(n.args) > pos else n.kwargs.get(key, default)
            dims = {v % ndim for v in (dim if isinstance(dim, (list, tuple)) else [dim]) if isinstance(v, int)}
        else:
            return
        if dims & set(split):
            raise _Unfit(f"it works along the split dimension {sorted(dims & set(split))}, of which this rank holds "
                         "a part only")

    def _full(self, x: fx.Node) -> Any:
        """The full (Dynamo) value of ``x``; nodes piper inserted have none, and only exist on whole tensors."""
        return x.meta["example_value"] if "example_value" in x.meta else self.env[x]

    def _compare(self, n: fx.Node, local: torch.Tensor, full: Any) -> Split:
        lo, fu = _shape(local), _shape(full)
        if len(lo) != len(fu) or any(a != b and a * self.size != b for a, b in zip(lo, fu)):
            raise _error(n, f"on the local shard it gives shape {tuple(lo)}, which is not a 1/{self.size} split of "
                            f"the full shape {tuple(fu)}", self.size)
        return {d: 1 for d, (a, b) in enumerate(zip(lo, fu)) if a != b}

    def _execute(self, n: fx.Node) -> Any:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: self.env[a])
        try:
            if n.op == "call_method":
                return getattr(args[0], n.target)(*args[1:], **kwargs)
            if n.op == "call_module":
                return self.gm.get_submodule(n.target)(*args, **kwargs)
            if n.op == "get_attr":
                return getattr(self.gm, n.target)
            return n.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- any failure on the local shapes is the user's to see
            raise _error(n, f"it fails on this rank's local shapes ({type(e).__name__}: {str(e).splitlines()[0]})",
                         self.size) from e


# -- small helpers ------------------------------------------------------------------------------------

def _hint(v: Any) -> int:
    return v if isinstance(v, int) else int(v.node.hint)


def _shape(t: Any) -> list[int]:
    return [_hint(s) for s in t.shape]


def _op(n: fx.Node) -> str:
    if n.op == "call_method":
        return str(n.target)
    if n.target is operator.getitem:
        return "getitem"
    return str(getattr(n.target, "__name__", n.target)).split(".")[0]


def _sizes_arg(n: fx.Node, op: str) -> tuple[list[Any], int, Callable[[list[Any]], None]] | None:
    """The size list of a view/reshape/expand/unflatten node, the first output dimension it sizes, and a
    setter that writes a new list back in the same form; None when the op takes no sizes."""
    if op not in ("view", "reshape", "_unsafe_view", "expand", "unflatten"):
        return None
    pos, start = (2, n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")) if op == "unflatten" else (1, 0)
    args = list(n.args)
    if len(args) > pos and isinstance(args[pos], (list, tuple, torch.Size)):
        kind = type(args[pos]) if not isinstance(args[pos], torch.Size) else tuple

        def put(new: list[Any]) -> None:
            n.args = (*args[:pos], kind(new), *args[pos + 1:])
        return list(args[pos]), start or 0, put
    key = next((k for k in ("size", "shape", "sizes") if k in n.kwargs), None)
    if key is not None:
        return list(n.kwargs[key]), start or 0, lambda new: n.update_kwarg(key, tuple(new))
    if len(args) > pos and all(isinstance(a, (int, fx.Node)) for a in args[pos:]):
        if any(isinstance(a, fx.Node) and not isinstance(a.meta.get("example_value"), (int, torch.SymInt))
               for a in args[pos:]):
            return None  # view(dtype) / expand_as-like forms

        def put_varargs(new: list[Any]) -> None:
            n.args = (*args[:pos], *new)
        return args[pos:], start or 0, put_varargs
    return None


def _where(n: fx.Node) -> str:
    return source_of(n) or f"graph node {n.name}"


def _error(n: fx.Node, reason: str, size: int) -> PiperCaptureError:
    return PiperCaptureError(
        f"piper: shard_tensor: {_op(n)} ({n.format_node()}) at {_where(n)} reads a tensor that the column-parallel "
        f"layers split over {size} ranks, and {reason}. Each rank holds a contiguous block of the split dimension "
        "(whole attention heads, whole fused parts); keep that dimension whole in reshapes (split it into "
        "(heads, head_dim) with heads divisible by the tensor-parallel size, or merge it only with the dimensions "
        "inside it), or leave the layers that produce it out of shard_tensor's params")


