"""ZeRO state of one rank: per shard bucket a flat buffer padded to a multiple of the group size, this
rank's shard of it (the parameter the optimizer updates, fp32 for low-precision models), the sharded
gradient (ZeRO-2/3) and, for ZeRO-1/2, the full flat parameter buffer that the model's parameters
are views of. Under ZeRO-3 the model's parameters keep their shapes but their storage is freed:
the runtime all-gathers a bucket into a temporary buffer for each compute step that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from piper_compile.runtime.released import unmarked
from piper_compile.errors import PiperError
from piper_compile.ir.ops import ParamGather
from piper_compile.plan.program import Program

Layout = dict[str, tuple[tuple[str, ...], tuple[int, ...], int, str]]  # bucket -> (fqns, devices, level, stream)
Fill = Callable[[str, int, torch.Tensor], None]  # (fqn, start in the flattened parameter, 1-D destination)

from piper_compile.runtime.comm import all_gather, all_gather_in_place


def layout_of(program: Program) -> Layout:
    """The shard buckets this rank takes part in, read from its program's parameter all-gathers (every
    ZeRO bucket has one: after the update for ZeRO-1/2, before each use for ZeRO-3)."""
    out: Layout = {}
    for ins in program.instrs:
        n = ins.node
        if isinstance(n.op, ParamGather) and n.op.level > 0:
            out[n.op.bucket] = (tuple(n.op.params), n.devices, n.op.level, n.stream)
    return out


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class Run:
    """A stretch of a shard whose parameters all belong to one optimizer parameter group: the optimizer
    updates it as one parameter (a view of the shard) with that group's hyperparameters."""

    group: int
    start: int  # in the shard
    length: int
    param: nn.Parameter


@dataclass
class ShardBucket:
    """One flat bucket of a ZeRO group as seen by one rank."""

    name: str
    fqns: tuple[str, ...]
    devices: tuple[int, ...]
    level: int
    stream: str  # the gather stream (its process group also serves state_dict / checkpoint gathers)
    index: int  # this rank's position in the group
    shapes: list[torch.Size]
    offsets: list[int]
    total: int
    dtype: torch.dtype
    device: torch.device
    shard: nn.Parameter | None = None
    grad_shard: torch.Tensor | None = None
    flat: torch.Tensor | None = None  # ZeRO-1/2: full flat parameters (the model's parameters are views)
    in_flight: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> reduce-scatter output
    done: dict[int, torch.Tensor] = field(default_factory=dict)  # finished, waiting for earlier micro-batches
    next_mb: int = 0  # the next micro-batch to fold into grad_shard (folds happen in micro-batch order)
    compute_dtype: torch.dtype | None = None  # mixed precision: ZeRO-3 gathers the parameters in this dtype
    runs: list[Run] | None = None  # several optimizer groups: what the optimizer updates of the shard

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def padded(self) -> int:
        return -(-self.total // self.world) * self.world

    @property
    def shard_len(self) -> int:
        return self.padded // self.world

    def shard_range(self) -> tuple[int, int]:
        return self.index * self.shard_len, (self.index + 1) * self.shard_len

    def views(self, flat: torch.Tensor, fqns: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        want = set(self.fqns if fqns is None else fqns)
        return {f: flat[o:o + s.numel()].view(s) for f, o, s in zip(self.fqns, self.offsets, self.shapes) if f in want}

    def local_pieces(self) -> list[tuple[str, int, int, int]]:
        """(fqn, start in the flattened parameter, start in the shard, length) of what this shard holds."""
        lo, hi = self.shard_range()
        out = []
        for f, o, s in zip(self.fqns, self.offsets, self.shapes):
            a, b = max(lo, o), min(hi, o + s.numel())
            if a < b:
                out.append((f, a - o, a - lo, b - a))
        return out

    def group_runs(self, group_of: dict[str, int]) -> None:
        """Cut the shard into runs of one optimizer group each (``group_of``: fqn -> group index). A
        parameter in no group is in no run, so it is not updated, as torch leaves a parameter its
        optimizer does not hold. A shard wholly in one group stays one run: the shard itself."""
        assert self.shard is not None
        pieces = self.local_pieces()
        spans: list[list[int]] = []  # [group, start, end] in the shard
        for f, _, s, n in pieces:
            g = group_of.get(f)
            if g is None:
                continue
            if spans and spans[-1][0] == g and spans[-1][2] == s:
                spans[-1][2] = s + n
            else:
                spans.append([g, s, s + n])
        if len(spans) == 1 and all(f in group_of for f, *_ in pieces):
            self.runs = [Run(spans[0][0], 0, self.shard_len, self.shard)]
            return
        flat = self.shard.detach()
        self.runs = [Run(g, a, b - a, nn.Parameter(flat[a:b], requires_grad=True)) for g, a, b in spans]

    def opt_runs(self) -> list[Run]:
        """What the optimizer updates of this shard: its runs, or (one group) the whole shard as one."""
        assert self.shard is not None
        return self.runs if self.runs is not None else [Run(0, 0, self.shard_len, self.shard)]

    def opt_params(self) -> list[nn.Parameter]:
        return [r.param for r in self.opt_runs()]

    def opt_grads(self, grad: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(optimizer parameter, its gradient) for ``grad``, this rank's gradient shard."""
        return [(r.param, grad if r.length == grad.numel() else grad[r.start:r.start + r.length])
                for r in self.opt_runs()]


@dataclass
class ZeroState:
    """Every shard bucket of this rank; built once per model, before its first step."""

    buckets: dict[str, ShardBucket] = field(default_factory=dict)
    sharded: bool = False

    @classmethod
    def build(cls, layout: Layout, params: dict[str, nn.Parameter], rank: int,
              compute_dtype: torch.dtype | None = None) -> "ZeroState":
        """This rank's buckets of ``layout``; ``compute_dtype`` (mixed precision): what ZeRO-3 gathers."""
        st = cls()
        for name, (fqns, devices, level, stream) in layout.items():
            ps = [params[f] for f in fqns]
            dtypes = {p.dtype for p in ps}
            if len(dtypes) > 1:
                raise PiperError(f"piper: ZeRO bucket {name} mixes parameter dtypes {sorted(map(str, dtypes))} "
                                 f"({', '.join(fqns[:4])}...); give every parameter of a replicated region one dtype")
            offsets, off = [], 0
            for p in ps:
                offsets.append(off)
                off += p.numel()
            st.buckets[name] = ShardBucket(name, tuple(fqns), tuple(devices), level, stream, devices.index(rank),
                                           [p.shape for p in ps], offsets, off, ps[0].dtype, ps[0].device,
                                           compute_dtype=compute_dtype if ps[0].is_floating_point() else None)
        return st

    def shard_(self, params: dict[str, nn.Parameter], fill: Fill | None = None) -> None:
        """Move the (already identical) parameters into the sharded layout; once. ``fill`` (a model built
        on the meta device, ``init/deferred.py``): ZeRO-3 shards are allocated alone and filled by it,
        never through a full bucket."""
        if self.sharded:
            return
        with torch.no_grad():
            for b in self.buckets.values():
                if fill is not None and b.level >= 3:
                    b.shard = nn.Parameter(self._filled_shard(b, fill), requires_grad=True)
                    continue
                flat = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
                for f, v in b.views(flat).items():
                    v.copy_(params[f].detach())
                lo, hi = b.shard_range()
                if b.level <= 2:
                    b.flat = flat
                    for f, v in b.views(flat).items():
                        params[f].data = v
                    shard = flat[lo:hi] if master_dtype(b.dtype) == b.dtype else flat[lo:hi].to(master_dtype(b.dtype))
                else:
                    shard = flat[lo:hi].to(master_dtype(b.dtype), copy=True)
                    for f in b.fqns:
                        free_storage(params[f])
                b.shard = nn.Parameter(shard, requires_grad=True)
        self.sharded = True

    @staticmethod
    def _filled_shard(b: ShardBucket, fill: Fill) -> torch.Tensor:
        """This rank's ZeRO-3 shard of bucket ``b`` (master dtype) with each piece written by ``fill``."""
        shard = torch.zeros(b.shard_len, dtype=master_dtype(b.dtype), device=b.device)
        for f, p_start, s_start, n in b.local_pieces():
            fill(f, p_start, shard[s_start:s_start + n])
        return shard

    # -- gathering -------------------------------------------------------------------------------
    def gather_input(self, b: ShardBucket, compute: bool = False) -> torch.Tensor:
        """This rank's shard as the gather sends it: in the parameters' dtype, or (``compute``, for the
        step's own gathers) in the mixed-precision compute dtype."""
        assert b.shard is not None
        return b.shard.detach().to(b.compute_dtype if compute and b.compute_dtype is not None else b.dtype)

    def post_update_gather(self, name: str, group: Any) -> Any:
        """ZeRO-1/2: the updated shard into every replica's full flat parameters."""
        b = self.buckets[name]
        assert b.flat is not None and b.shard is not None
        lo, hi = b.shard_range()
        if b.shard.data_ptr() != b.flat[lo:hi].data_ptr():
            b.flat[lo:hi].copy_(b.shard.detach())
        return all_gather_in_place(b.flat, group)

    def gather(self, name: str, group: Any) -> tuple[torch.Tensor, Any]:
        """ZeRO-3: a fresh full flat buffer of the bucket (async); the caller takes views of it. This rank's
        shard is copied into its slice and the others arrive in place (``all_gather_in_place``: on gloo
        no second full-size buffer, which its all-gather would allocate per call)."""
        b = self.buckets[name]
        inp = self.gather_input(b, compute=True)
        out = torch.empty(b.padded, dtype=inp.dtype, device=b.device)
        lo, hi = b.shard_range()
        out[lo:hi].copy_(inp)
        return out, all_gather_in_place(out, group)

    def full_flat(self, name: str, groups: Any) -> torch.Tensor:
        """The bucket's full flat parameters: ZeRO-1/2 hold them; ZeRO-3 all-gathers them (blocking, a
        collective over the bucket's group)."""
        b = self.buckets[name]
        if b.flat is not None:
            return b.flat
        if b.world == 1:
            return self.gather_input(b)
        flat = torch.empty(b.padded, dtype=b.dtype, device=b.device)
        all_gather(flat, self.gather_input(b), groups.get(b.stream, b.devices)).wait()
        return flat

    def gather_full(self, groups: Any) -> dict[str, torch.Tensor]:
        """Copies of every parameter of this rank's buckets as full tensors (collective over each group)."""
        return {f: v.clone() for name, b in self.buckets.items() for f, v in b.views(self.full_flat(name, groups)).items()}

    # -- gradients -------------------------------------------------------------------------------
    def shard_grad(self, name: str, full_grad: torch.Tensor | None) -> torch.Tensor:
        """This rank's gradient shard: the reduce-scattered one (ZeRO-2/3) or its slice of the
        all-reduced full gradient (ZeRO-1)."""
        b = self.buckets[name]
        if b.level >= 2:
            if b.grad_shard is None:  # the reduce-scatter's output; dropped after the update
                b.grad_shard = torch.empty(b.shard_len, dtype=b.dtype, device=b.device)
            return b.grad_shard
        assert full_grad is not None
        lo, hi = b.shard_range()
        return full_grad[lo:hi]

    def partial_shard(self, name: str, mb: int) -> torch.Tensor:
        """A fresh output for micro-batch ``mb``'s reduce-scatter of the bucket (see ``fold``)."""
        b = self.buckets[name]
        t = b.in_flight[mb] = torch.empty(b.shard_len, dtype=b.dtype, device=b.device)
        return t

    def fold(self, name: str, mb: int) -> None:
        """Micro-batch ``mb``'s reduce-scatter finished: add the finished ones into the gradient shard in
        micro-batch order (so the sum, and every number after it, does not depend on timing)."""
        b = self.buckets[name]
        b.done[mb] = b.in_flight.pop(mb)
        while b.next_mb in b.done:
            t = b.done.pop(b.next_mb)
            b.grad_shard = t if b.grad_shard is None else b.grad_shard.add_(t)
            b.next_mb += 1

    def release_grad_shards(self) -> None:
        """After the update: gradient shards are not kept between steps (as FSDP frees its gradients)."""
        for b in self.buckets.values():
            b.grad_shard, b.next_mb = None, 0

    def grad_shard_bytes(self) -> int:
        return sum(tensor_bytes(b.grad_shard) + sum(map(tensor_bytes, [*b.in_flight.values(), *b.done.values()]))
                   for b in self.buckets.values())



def tensor_bytes(t: Any) -> int:
    """Bytes of a tensor's elements (0 for anything else, e.g. None)."""
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def free_storage(p: torch.Tensor) -> None:
    """Release a parameter's memory while keeping its shape (ZeRO-3): the storage is resized to 0."""
    st = unmarked(p).untyped_storage()
    if st.nbytes() == 0:
        return  # has none (a stand-in of a model built on the meta device)
    if p.storage_offset() != 0 or st.nbytes() != p.numel() * p.element_size():
        p.data = p.data.clone()  # shares storage with something else: give it its own first
        st = p.untyped_storage()
    st.resize_(0)


def ensure_storage(p: torch.Tensor) -> bool:
    """Give a released parameter (ZeRO-3, or another stage's) storage again, contents undefined; True if
    it had none."""
    st = unmarked(p).untyped_storage()
    if st.nbytes():
        return False
    st.resize_(p.numel() * p.element_size())
    return True


def no_storage(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose storage holds nothing (as a released parameter's). On CPU
    the address range ``set_`` reserves is never touched, so no memory is used."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(shape[d + 1], 1)
    t = torch.empty(0, dtype=dtype, device=device)
    t.set_(torch.UntypedStorage(0, device=t.device), 0, shape, strides)
    t.untyped_storage().resize_(0)
    return t
