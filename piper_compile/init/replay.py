"""Replaying recorded init programs (``init/record.py``) on any piece of a tensor.

A piece is a list of *runs*: ``(flat start, destination)``, each a contiguous range of the full tensor in
row-major order and a 1-D tensor to write it into (a ZeRO-3 shard's slice, a row block of a
tensor-parallel piece, a whole parameter). The value at every element depends only on the element's
flat position, the seed and the tensor's key, never on which piece asked:

- a random op (``normal_``, ``uniform_``...) draws its values in blocks of ``BLOCK`` elements of the
  op's range, block ``b`` from a CPU generator seeded with a hash of (seed, tensor key, op index, b), and
  always at the block's full length (CPU ``normal_`` draws differently for different lengths);
- an elementwise op runs on the piece's elements, in the tensor's own dtype (so an fp32 master shard of
  a bf16 parameter holds the bf16 values the whole tensor would);
- a fallback call runs its module's init on full real CPU tensors (once per call, cached), and the piece
  is cut from the result.

``materialize`` is the single-device reference: every tensor replayed whole, through the same code.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from piper_compile.init.record import Call, Fallback, InitOp, InitPlan, Step, swapped

BLOCK = 1 << 16
Run = tuple[int, torch.Tensor]  # (flat start in the full tensor, 1-D destination)


def block_seed(seed: int, key: str, op: int, block: int) -> int:
    """The generator seed of one block of one random op (stable across processes and versions)."""
    digest = hashlib.blake2b(f"{seed}|{key}|{op}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Replayer:
    """Fills pieces of a model's meta tensors with their init values (``seed``: every rank the same)."""

    def __init__(self, plan: InitPlan, model: nn.Module, seed: int) -> None:
        self.plan, self.seed = plan, seed
        self._model = weakref.ref(model)  # the training state keeps this: it must not keep the model alive
        self._calls: dict[int, dict[str, torch.Tensor]] = {}  # fallback call -> full values it left
        self._indices: dict[int, torch.Tensor] = {}  # id(view) -> its flat indices

    def numel(self, key: str) -> int:
        return math.prod(self.plan.shapes[key][0])

    def clear(self) -> None:
        """Drop the cached fallback values and view indices (recomputed when asked for again): after the
        first call's initialization the training state keeps this replayer, and a fallback module's full
        values must not stay with it."""
        self._calls.clear()
        self._indices.clear()

    def fill(self, key: str, runs: list[Run]) -> None:
        """Write tensor ``key``'s init values into ``runs``."""
        self._apply(key, self.plan.programs[key], runs)

    def _apply(self, key: str, prog: list[Step], runs: list[Run]) -> None:
        last = max((i for i, s in enumerate(prog) if isinstance(s, Fallback)), default=-1)
        if last >= 0:
            full = self._after_call(key, prog[last]).reshape(-1)  # type: ignore[arg-type]
            for a, dest in runs:
                dest.copy_(full[a:a + dest.numel()])
        dtype = self.plan.shapes[key][1]
        for op in prog[last + 1:]:
            assert isinstance(op, InitOp)
            if op.random:
                self._random(key, op, runs, dtype)
            else:
                for a, dest in runs:
                    self._elementwise(op, a, dest, dtype)

    # -- one op ----------------------------------------------------------------------------------
    def _positions(self, op: InitOp, a: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a view op: (positions in the op's range, offsets in the run) of the run's elements it
        writes; None when the op covers the whole tensor (position = flat index)."""
        if op.view is None:
            return None
        idx = self._view_indices(op)
        j = ((idx >= a) & (idx < a + n)).nonzero().reshape(-1)
        return j, idx[j] - a

    def _view_indices(self, op: InitOp) -> torch.Tensor:
        assert op.view is not None
        idx = self._indices.get(id(op.view))
        if idx is None:
            idx = self._indices[id(op.view)] = op.view.flat_indices()
        return idx

    def _elementwise(self, op: InitOp, a: int, dest: torch.Tensor, dtype: torch.dtype) -> None:
        where = self._positions(op, a, dest.numel())
        sub = dest if where is None else dest[where[1]]
        work = sub if sub.dtype == dtype else sub.to(dtype)
        op.func(work, *op.args, **dict(op.kwargs))
        if where is None:
            if work is not dest:
                dest.copy_(work)
        else:
            dest[where[1]] = work.to(dest.dtype)

    def _random(self, key: str, op: InitOp, runs: list[Run], dtype: torch.dtype) -> None:
        if op.view is None:
            total = self.numel(key)
            for a, dest in runs:
                for start, buf in self._blocks(key, op, a, a + dest.numel(), total, dtype):
                    s, e = max(a, start), min(a + dest.numel(), start + buf.numel())
                    dest[s - a:e - a] = buf[s - start:e - start]  # straight into the piece: no run-sized copy
            return
        total = self._view_indices(op).numel()
        for a, dest in runs:
            where = self._positions(op, a, dest.numel())
            assert where is not None
            j, off = where
            if j.numel():
                values = self._draw(key, op, int(j.min()), int(j.max()) + 1, total, dtype)
                dest[off] = values[j - int(j.min())].to(dest.dtype)

    def _draw(self, key: str, op: InitOp, lo: int, hi: int, total: int, dtype: torch.dtype) -> torch.Tensor:
        """The op's values at positions ``[lo, hi)`` of its range of ``total`` elements."""
        out = torch.empty(hi - lo, dtype=dtype)
        for start, buf in self._blocks(key, op, lo, hi, total, dtype):
            s, e = max(lo, start), min(hi, start + buf.numel())
            out[s - lo:e - lo] = buf[s - start:e - start]
        return out

    def _blocks(self, key: str, op: InitOp, lo: int, hi: int, total: int,
                dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, values) of every block of the op's range that ``[lo, hi)`` touches, each drawn whole."""
        b = lo // BLOCK
        while b * BLOCK < hi:
            start = b * BLOCK
            buf = torch.empty(min(BLOCK, total - start), dtype=dtype)
            gen = torch.Generator().manual_seed(block_seed(self.seed, key, op.index, b))
            op.func(buf, *op.args, generator=gen, **dict(op.kwargs))
            yield start, buf
            b += 1

    # -- fallback calls ----------------------------------------------------------------------------
    def _after_call(self, key: str, step: Fallback) -> torch.Tensor:
        if step.call not in self._calls:
            self._calls[step.call] = self._run_call(self.plan.calls[step.call])
        return self._calls[step.call][key]

    def full_before(self, key: str, call: int) -> torch.Tensor:
        """Tensor ``key``'s full value (CPU) just before init call ``call``."""
        prog = self.plan.programs[key]
        upto = next((i for i, s in enumerate(prog) if isinstance(s, Fallback) and s.call == call), len(prog))
        shape, dtype = self.plan.shapes[key]
        out = torch.zeros(shape, dtype=dtype)
        if upto:
            self._apply(key, prog[:upto], [(0, out.view(-1))])
        return out

    def _run_call(self, call: Call) -> dict[str, torch.Tensor]:
        """Run a fallback call on full real CPU tensors of its module (each as the steps before it left
        it), with the global RNG seeded from the call; the full values it leaves, by key."""
        model = self._model()
        assert model is not None, "the model of a pending init was garbage collected"
        mod = model.get_submodule(call.module)
        seed = block_seed(self.seed, call.module, call.index, -1)
        with swapped(mod, lambda t: self._real(t, call.index)) as keyed, _seeded(seed), torch.no_grad():
            call.fn()
            return {key: t.detach().clone() for key, t in keyed().items()}

    def _real(self, t: torch.Tensor, call: int) -> tuple[str | None, torch.Tensor]:
        key = self.plan.ids.get(id(t))
        if key is not None:
            return key, self.full_before(key, call)
        return None, t.detach().to("cpu", copy=True)  # a real (or already materialized) tensor of the module


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def materialize(model: nn.Module, device: Any = "cpu", seed: int = 0, init_fn: Any = None) -> nn.Module:
    """Give every meta parameter and buffer of ``model`` real storage on ``device`` and its init value:
    exactly the values piper's ranks compute for their pieces with ``options["init"]`` (the same
    ``seed`` and ``init_fn``), so this is the single-device reference of a model built on the meta
    device. Parameters keep their identity (``torch.utils.swap_tensors``); returns ``model``."""
    from piper_compile.init.record import meta_tensors, record

    plan = record(model, init_fn)
    rep = Replayer(plan, model, seed)
    tensors = dict(meta_tensors(model))
    values = {}
    for key in plan.programs:
        shape, dtype = plan.shapes[key]
        out = torch.empty(shape, dtype=dtype)
        rep.fill(key, [(0, out.view(-1))])
        values[key] = out
    for key, t in tensors.items():
        real = values[key].to(device)
        swap_in(t, real)
    return model


def swap_in(t: torch.Tensor, data: torch.Tensor) -> None:
    """Make ``t`` (a parameter or buffer, kept as the same Python object) hold ``data``."""
    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    torch.utils.swap_tensors(t, new)
