"""Training state shared by every compiled variant of one model (train step, forward-only step): its
parameters and their layout (ZeRO shards, expert / tensor-parallel pieces, released stages), the
optimizer and its update rule (clipping by the global norm), and the one-time broadcast of rank 0's
weights. Gradient storage is ``runtime/grads.py``; a parameter piece ``runtime/shards.py``."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from piper_compile.errors import PiperError, some
from piper_compile.ir.ops import Update
from piper_compile.ir.shard import ParamShard
from piper_compile.precision import Precision
from piper_compile.runtime import comm
from piper_compile.runtime.compute_copies import ComputeCopies
from piper_compile.runtime.loss_scale import LossScaler
from piper_compile.runtime.grads import GradBuffers
from piper_compile.runtime.optimizer import build_optimizer, step_checked
from piper_compile.runtime.optimizer_memory import Allocations
from piper_compile.runtime.param_groups import regroup

MEASURED_UPDATE = 1  # the update whose temporaries memory_report shows: the second (the first makes the state)
from piper_compile.runtime.shards import LocalShard
from piper_compile.runtime import released as released_marks
from piper_compile.runtime.zero import Layout, ZeroState, free_storage


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

# Called by ready() once per TrainState, at the first call that finds it sharded (ZeRO), with the state
# and the calling CompiledStep (piper_compile.checkpoint installs the module's state_dict hooks here).
ON_SHARDED: list[Callable[["TrainState", Any], None]] = []


class TrainState:
    """One per model (keyed by its parameters), shared by the grad and no-grad compiled programs."""

    def __init__(self, params: list[nn.Parameter], factory: OptimizerFactory | None) -> None:
        self.params = params
        self.factory = factory
        self.optimizer: torch.optim.Optimizer | None = None
        self.broadcast_done = False
        self.steps: list[Any] = []  # the CompiledSteps (grad / no-grad variants) of this model
        self.zero: ZeroState | None = None
        self.zero_layout: Layout = {}
        self.named: dict[str, nn.Parameter] = {}
        self.to_release: set[str] = set()
        self.released: set[str] = set()  # parameters whose storage this rank gave back (other stages)
        self.buffers_to_release: dict[str, torch.Tensor] = {}  # other stages' buffers, by fqn
        self.released_buffers: set[str] = set()  # buffers whose storage this rank gave back
        self.shards: dict[str, LocalShard] = {}  # expert / tensor-parallel pieces this rank holds, by fqn
        self.shards_filled = False
        self.hooks_installed = False
        self.marks_on = False  # piper.compile's calls mark released tensors between steps (runtime/released.py)
        self.marked: list[torch.Tensor] = []  # the tensors marked now
        self.hook_unmarked = False  # a state-dict pre-hook unmarked them (checkpoint/hooks.py)
        self.pending: list[Callable[[Any], None]] = []  # run by ready() (e.g. a checkpoint load before the first call)
        self.first_call_done = False
        self.on_sharded_done = False
        self.index = 0  # creation order in this process (runtime/registry.py): part of the call check
        self.from_module = False  # made by the API for a module before its first call
        self.calls = 0  # collective calls of this model's steps so far (the call check compares them)
        self.precision = Precision()  # options["mixed_precision"]: the compute copies' dtype
        self._copies = ComputeCopies()  # mixed precision: each parameter's copy in param_dtype
        self.updates = 0  # optimizer steps so far (a compute copy made before the last one is stale)
        self.optimizer_step_bytes = 0  # bytes of temporaries the MEASURED_UPDATE held at once
        self.scaler: LossScaler | None = None  # fp16: dynamic loss scaling (runtime/loss_scale.py)
        self.deferred: Any = None  # a model built on the meta device: its init (init/deferred.Deferred)
        self.load_bytes = 0  # bytes the last Hugging Face checkpoint load read on this rank (checkpoint/hf.py)
        self.kinds: dict[int, tuple[torch.dtype, str]] = {}  # parameters' dtype and device since the first call
        self.group_of: dict[str, int] | None = None  # several optimizer groups: fqn -> group (param_groups.py)
        self.trained: frozenset[str] | None = None  # parameters with gradients at the first training plan

    @property
    def device(self) -> torch.device:
        """Where the parameters live (read each time: a meta model's parameters move at its first call)."""
        return self.params[0].device if self.params else torch.device("cpu")

    def adopt_precision(self, precision: Precision) -> None:
        """The mixed-precision policy this model trains with (every compiled variant must agree)."""
        if self.steps and precision != self.precision:
            raise PiperError(f"piper: this model is compiled twice with different options['mixed_precision'] "
                             f"({self.precision} vs {precision}); compile it once, or with the same policy")
        self.precision = precision
        if precision.scaling is not None and self.scaler is None:
            self.scaler = LossScaler(precision.scaling)

    @property
    def is_plain(self) -> bool:
        """Every parameter is trained in place, whole (no ZeRO layout, no pieces, nothing released)."""
        return self.zero is None and not self.shards and not self.to_release and not self.released

    # -- ZeRO --------------------------------------------------------------------------------------
    def check_trained(self, trained: frozenset[str], directives: Iterable[Any]) -> None:
        """Under ZeRO the parameters that get gradients (``trained``) must stay those of the first training
        plan: its shards and optimizer state are laid out over them. Every rank captured the whole model
        and reads the same directives, so every rank refuses a change, before planning or communicating."""
        if self.trained is None:
            self.trained = trained
        zero = next((d for d in directives if getattr(d, "zero", 0) > 0), None)
        if zero is None or trained == self.trained:
            return
        lost, gained = sorted(self.trained - trained), sorted(trained - self.trained)
        what = [f"{some(lost)} get no gradient in this version of the step (requires_grad turned off, or the "
                "forward no longer uses them)"] if lost else []
        what += [f"{some(gained)} get gradients in this version of the step but not in the first (requires_grad "
                 "turned on, or the forward now uses them)"] if gained else []
        raise PiperError(
            f"piper: {'; '.join(what)}, after this model trained under replicate(zero={zero.zero}): ZeRO lays its "
            "shards and the optimizer state out over the parameters that get gradients at the first training "
            "step, and piper cannot move them to another layout. Fix: keep which parameters train fixed (set "
            "requires_grad before the first step, use every branch's weights from the first step on), or train "
            "without ZeRO (replicate(zero=0)), where it may change between steps; going back to the first "
            "version resumes training")

    def ensure_zero(self, layout: Layout, named: dict[str, nn.Parameter], rank: int) -> None:
        """Adopt this rank's shard layout (the first plan sets it; every later plan must agree)."""
        self.named = named
        if not layout:
            return
        if self.zero is None:
            self.zero_layout = layout
            self._build_zero(rank)
            return
        have = {k: (b.fqns, b.devices, b.level, b.stream) for k, b in self.zero.buckets.items()}
        if have != layout:
            raise PiperError("piper: internal: the training and forward-only programs disagree on the ZeRO "
                             f"shard layout ({sorted(have)} vs {sorted(layout)})")

    def ensure_shards(self, specs: dict[str, tuple[ParamShard, tuple[int, ...], str, str]],
                      named: dict[str, nn.Parameter], rank: int) -> None:
        """Expert / tensor parallelism: for every ``fqn -> (spec, group, stream, kind)`` whose group holds
        this rank, keep only this rank's piece as a local parameter the optimizer owns (filled from the
        full weight at ``shard()``, after rank 0's weights were broadcast; the full weight's memory is then
        released). Every compiled program of the model must split a parameter the same way."""
        for fqn, (spec, group, stream, kind) in specs.items():
            if rank not in group:
                continue
            have = self.shards.get(fqn)
            if have is not None:
                if have.spec != spec or have.group != group:
                    raise PiperError(f"piper: {fqn} is split differently by two compiled programs ({have.spec} on "
                                     f"{list(have.group)} vs {spec} on {list(group)}); use the same directives")
                continue
            full = named[fqn]
            local = nn.Parameter(torch.empty(spec.local_shape(tuple(full.shape)), dtype=full.dtype,
                                             device=full.device))
            self.shards[fqn] = LocalShard(local, spec, sorted(group).index(rank), group, stream, kind)
            self.shards_filled = False
        if self.zero is not None and not self.zero.sharded:
            self._build_zero(rank)

    def _build_zero(self, rank: int) -> None:
        """The ZeRO state from the layout, laid out over what this rank trains: its pieces of tensor-parallel
        layers (ZeRO-1 with shard_tensor), else the parameters. Rebuilt while not sharded yet, as pieces
        appear (the ZeRO layout is adopted first)."""
        self.zero = ZeroState.build(self.zero_layout, {**self.named, **self.local_params()}, rank,
                                    self.precision.param_dtype)

    @property
    def experts(self) -> dict[str, tuple[nn.Parameter, slice]]:
        """Expert shards: fqn -> (local parameter, the experts it holds)."""
        return {f: (s.param, s.rows) for f, s in self.shards.items() if s.kind == "ep"}  # type: ignore[misc]

    def local_param(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """What this rank computes with for parameter ``fqn``: its expert or tensor-parallel shard, or the
        parameter itself."""
        s = self.shards.get(fqn)
        return full if s is None else s.param

    def compute_param(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """What a compute step reads for parameter ``fqn``: ``local_param``, or under mixed precision its
        compute copy, cast once after each change of the master weight (the optimizer's in-place update,
        a ZeRO gather into it or a checkpoint load bump its version) and kept until the next one."""
        t = self.local_param(fqn, full)
        if not self.precision.active or not t.is_floating_point():
            return t
        return self._copies.get(fqn, t, self.precision.compute(t), self.updates)

    def refresh_compute_copies(self) -> None:
        """Mixed precision: cast every master weight changed since its compute copy was made into that
        copy now (the executor calls it at the end of a step that updated), not at the next read."""
        if self.precision.active:
            self._copies.refresh(self.updates)

    def compute_copies(self) -> list[torch.Tensor]:
        """Mixed precision: the compute copies held now (``compute_param``)."""
        return self._copies.held()

    def local_params(self) -> dict[str, nn.Parameter]:
        """Every local shard (expert and tensor parallel) by FQN."""
        return {f: s.param for f, s in self.shards.items()}

    def mark_released(self) -> None:
        """Between steps (once ``marks_on``): mark the parameters and buffers without storage, so that
        reading one is a clear error (``runtime/released.py``)."""
        zero3 = self.zero is not None and any(b.level >= 3 for b in self.zero.buckets.values())
        if self.marks_on and (self.released or self.released_buffers or zero3):  # else none is storage-less
            self.marked += released_marks.mark({**self.named, **self.buffers_to_release})

    def unmark_released(self) -> bool:
        """Before piper touches them again (a call, the state dict hooks, the public API): their plain
        classes back; whether any was marked."""
        if not self.marked:
            return False
        released_marks.unmark(self.marked)
        self.marked = []
        return True

    def release_unused(self, fqns: Iterable[str], buffers: dict[str, torch.Tensor] | None = None) -> None:
        """Pipeline stages (with or without ZeRO, data / tensor / expert parallel inside them): parameters
        this rank's training program never reads (other stages' weights), and ``buffers`` (fqn -> tensor)
        that other ranks' programs read and this one's does not, give their memory back at ``shard()``;
        ``piper.full_state_dict`` / ``model.state_dict()`` fetch them from the ranks that hold them (a
        collective over the world), and ``model.load_state_dict`` gives them storage for the copy only."""
        self.to_release.update(fqns)
        self.buffers_to_release.update(buffers or {})

    def shard(self) -> None:
        """Move parameters into the shard layout (after rank 0's weights were broadcast); once. Release
        the parameters this rank never reads."""
        for f in sorted(self.to_release - self.released):
            free_storage(self.named[f])
            self.released.add(f)
        for f in sorted(set(self.buffers_to_release) - self.released_buffers):
            free_storage(self.buffers_to_release[f])
            self.released_buffers.add(f)
        if self.shards and not self.shards_filled:
            with torch.no_grad():
                for f, sh in self.shards.items():
                    if f not in self.released:
                        sh.param.copy_(sh.spec.take(self.named[f], sh.rank))
                        free_storage(self.named[f])
                        self.released.add(f)
            self.shards_filled = True
            if self.optimizer is not None:
                self._rewire_optimizer(self.optimizer)
        if self.zero is None or self.zero.sharded:
            return
        fill = None
        if self.deferred is not None:
            from piper_compile.init.deferred import zero_fill

            fill = zero_fill(self, self.deferred)
        self.zero.shard_({**self.named, **self.local_params()}, fill)  # tensor-parallel pieces become views too
        if self.optimizer is not None:
            self._rewire_optimizer(self.optimizer)

    def ready(self, step: Any) -> None:
        """Every call, right after shard() and before the step computes: the ON_SHARDED hooks once, then
        what was registered to wait for this point (``step`` is the calling CompiledStep)."""
        if not self.first_call_done:
            self.kinds = {id(p): (p.dtype, p.device.type) for p in self.params}
        self.first_call_done = True
        if not self.on_sharded_done and ((self.zero is not None and self.zero.sharded) or self.released
                                         or self.released_buffers):
            self.on_sharded_done = True
            for hook in ON_SHARDED:
                hook(self, step)
        pending, self.pending = self.pending, []
        for fn in pending:  # what one re-registers waits for the next call
            fn(step)

    def _optimizer_params(self) -> list[nn.Parameter]:
        if self.zero is None or not self.zero.sharded:
            return self._unsharded_params()
        sharded = {f for b in self.zero.buckets.values() for f in b.fqns}
        shards = [p for b in self.zero.buckets.values() if b.shard is not None for p in b.opt_params()]
        return shards + [self.local_param(f, p) for f, p in self.named.items()  # type: ignore[misc]
                         if f not in sharded]

    def _unsharded_params(self) -> list[nn.Parameter]:
        """The model's parameters, or this rank's tensor-parallel / expert pieces of them."""
        if not self.shards:
            return list(self.params)
        fqn_of = {id(p): f for f, p in self.named.items()}
        return [self.local_param(fqn_of.get(id(p), ""), p) for p in self.params]  # type: ignore[misc]

    def _rewire_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer made before the parameters took their layout (piper.optimizer(step) before the
        first call) now updates what this rank holds of them: shards, runs of shards or pieces."""
        if any(opt.state.values()):
            raise PiperError("piper: the optimizer already has state from steps on the full parameters; create it "
                             "through options['optimizer'] and let piper step it")
        if len(opt.param_groups) == 1:
            opt.param_groups[0]["params"] = self._optimizer_params()
        else:
            regroup(opt, self)
        opt.state.clear()

    def get_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer, built at first need. Under ZeRO with several parameter groups the factory is
        given the model's parameters (so it can sort them) and the groups are rewired onto the shards."""
        if self.optimizer is None and self.factory is not None:
            sharded = self.zero is not None and self.zero.sharded
            opt = self._build(self._unsharded_params() if sharded else self._optimizer_params())
            if sharded and len(opt.param_groups) == 1:
                opt = self._build(self._optimizer_params())  # one group: the factory sees the flat shards
            elif sharded:
                regroup(opt, self)
            self.optimizer = opt
        return self.optimizer

    def _build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        opt = build_optimizer(self.factory, params)  # type: ignore[arg-type]
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"piper: options['optimizer'] must return a torch.optim.Optimizer, got "
                            f"{type(opt).__name__}; pass e.g. functools.partial(torch.optim.AdamW, lr=1e-3)")
        return opt

    def broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Make every replica start from rank 0's weights (once per model)."""
        if self.broadcast_done:
            return
        if dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                comm.broadcast_coalesced([t.detach() for t in tensors], 0)
        self.broadcast_done = True

    # -- the update ------------------------------------------------------------------------------
    def _shard_grads(self, upd: Update, grads: GradBuffers) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(shard, its gradient) for every ZeRO bucket the update ``upd`` steps."""
        out = []
        for b in upd.shards:
            bk = self.zero.buckets[b]  # type: ignore[union-attr]
            full = grads.bucket(b) if bk.level == 1 else None  # ZeRO-1: a slice of the all-reduced bucket
            out += bk.opt_grads(self.zero.shard_grad(b, full))  # type: ignore[union-attr]
        return out

    def _whole(self, upd: Update, fqns: Iterable[str]) -> list[str]:
        """Those of ``fqns`` that ``upd`` updates whole (not through a ZeRO shard)."""
        sharded = {f for b in upd.shards for f in self.zero.buckets[b].fqns}  # type: ignore[union-attr]
        return [f for f in fqns if f not in sharded]

    def local_grad_sq(self, node: Any, grads: GradBuffers, rank: int) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: every gradient element counted once in
        the world. ZeRO shards by their owner (under tensor parallelism see ``_shard_grad_sq``); expert
        shards by every rank (each holds other experts); tensor-parallel pieces by the ranks of one
        tensor-parallel group, the one holding the group's first rank (every rank of it holds another
        piece; the other data-parallel replicas hold copies); every other whole gradient by the first rank
        of the group that wrote it (data-parallel replicas, parameters replicated inside a tensor-parallel
        group and sequence-parallel partial gradients all hold the same value once synchronised)."""
        upd: Update = node.op
        experts = set(upd.ep_params)
        first = node.devices[0]
        counted = []
        for f in self._whole(upd, sorted(upd.norm_params)):
            sh = self.shards.get(f)
            counts = first in sh.group if sh is not None and sh.kind == "tp" else rank == first
            if counts or f in experts:
                counted.append(grads.view(f))
        total = sum_of_squares(counted, self.device)
        for b in upd.shards:
            total += self._shard_grad_sq(b, grads, first)
        return total

    def _shard_grad_sq(self, name: str, grads: GradBuffers, first: int) -> torch.Tensor:
        """The squared norm of what this rank's gradient shard of ZeRO bucket ``name`` counts: all of it,
        unless under tensor parallelism (where each data-parallel subgroup shards its own copy of the
        bucket) its subgroup is not the one holding the group's ``first`` rank: then only its pieces of
        the split layers (the replicated parameters' elements are counted by that subgroup)."""
        bk = self.zero.buckets[name]  # type: ignore[union-attr]
        g = self.zero.shard_grad(name, grads.bucket(name) if bk.level == 1 else None)  # type: ignore[union-attr]
        if first in bk.devices:
            return sum_of_squares([g], self.device)
        return sum_of_squares([g[start:start + n] for f, _, start, n in bk.local_pieces()
                               if f in self.shards and self.shards[f].kind == "tp"], self.device)

    def apply_update(self, upd: Update, grads: GradBuffers, params: dict[str, nn.Parameter],
                     grad_sq: torch.Tensor | None = None, max_norm: float = 0.0) -> None:
        """The optimizer step ``upd`` for this rank's parameters (or shards) -- or the gradients into
        ``param.grad`` without a piper optimizer. ``params``: the model's parameters by FQN; ``grad_sq``:
        the global squared gradient norm when clipping to ``max_norm``."""
        opt = self.get_optimizer()
        pairs = [(self.local_param(f, params[f]), grads.view(f)) for f in self._whole(upd, upd.params)]
        pairs += self._shard_grads(upd, grads)
        if opt is None:
            for p, g in pairs:  # as torch would leave them: accumulate into .grad
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.add_(g)
            return
        if self.scaler is not None:  # fp16: skip on inf/NaN anywhere in the world, else unscale
            assert grad_sq is not None, "lowering inserts the norm all-reduce under loss scaling"
            grad_sq = self.scaler.unscale([g for _, g in pairs], grad_sq)
            if grad_sq is None:
                return
        if grad_sq is not None and max_norm:
            scale_all([g for _, g in pairs], (max_norm / (grad_sq.sqrt() + 1e-6)).clamp(max=1.0))
        for p, g in pairs:
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        seen = Allocations() if self.updates == MEASURED_UPDATE else None
        step_checked(opt, [p for p, _ in pairs], seen)  # raises if the first update with a nonzero gradient moved nothing
        if seen is not None:
            self.optimizer_step_bytes = seen.peak
        self.updates += 1
        for p, _ in pairs:
            p.grad = None


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The fp32 sum of the squares of every element of ``tensors``: one multi-tensor norm kernel per
    dtype (``torch._foreach_norm``, as ``clip_grad_norm_`` computes it, accumulating in fp32 without fp32
    copies of bf16/fp16 tensors) instead of three kernels per tensor (~900 launches a step on a 24-layer
    GPT)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in _by_dtype(tensors).values():
        total += torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).pow(2).sum()
    return total


def scale_all(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every tensor in place by the scalar tensor ``coef`` (cast to its dtype): one multi-tensor
    kernel per dtype."""
    for dtype, group in _by_dtype(tensors).items():
        torch._foreach_mul_(group, coef.to(dtype))


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out
