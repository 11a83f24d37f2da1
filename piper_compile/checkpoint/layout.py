"""What this rank holds and trains, as the checkpoint functions see it: the training programs of every
rank (whose UPDATE steps say who trains what), the ZeRO buckets this rank updates, its expert /
tensor-parallel pieces, and the module's names of the joint graph's parameters."""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from piper_compile.plan.residency import buffer_holders
from piper_compile.runtime.shards import LocalShard
from piper_compile.checkpoint.pieces import ShardPieces


@dataclass
class Ctx:
    st: Any  # TrainState
    cs: Any  # a CompiledStep of the model
    module: nn.Module | None
    programs: list[Any]  # every rank's training program

    @property
    def rank(self) -> int:
        return self.cs.rank

    @property
    def world(self) -> int:
        return self.cs.world

    @functools.cached_property
    def trained(self) -> list[str]:
        u = self.programs[self.rank].update_node()
        return list(u.op.params) if u is not None else []

    @functools.cached_property
    def update_shards(self) -> list[str]:
        """The ZeRO buckets this rank's update steps (by the training program)."""
        u = self.programs[self.rank].update_node()
        return sorted(u.op.shards) if u is not None else []

    @property
    def unsharded_yet(self) -> bool:
        """The training layout shards buckets that the state has not sharded yet (only forward-only calls
        so far under ZeRO-1/2, whose forward program has no shard layout)."""
        z = self.st.zero
        done = z is not None and z.sharded and set(self.update_shards) <= set(z.buckets)
        return bool(self.update_shards) and not done

    @property
    def shards(self) -> list[str]:
        return [] if self.unsharded_yet else self.update_shards

    @functools.cached_property
    def owners(self) -> dict[str, list[int]]:
        """fqn -> the ranks that update it."""
        out: dict[str, list[int]] = {}
        for p in self.programs:
            u = p.update_node()
            for f in (u.op.params if u is not None else ()):
                out.setdefault(f, []).append(p.rank)
        return out

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return self.cs.joint.params

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The joint graph's buffers by fqn (what the programs read as ``buffer:fqn``)."""
        return self.cs.joint.buffers

    @functools.cached_property
    def buffer_holders(self) -> dict[str, list[int]]:
        """Buffer fqn -> the ranks whose training program reads it (the others released it)."""
        return buffer_holders(self.programs, self.buffers)

    @property
    def sharded(self) -> set[str]:
        z = self.st.zero
        return {f for b in z.buckets.values() for f in b.fqns} if z is not None and z.sharded else set()

    @functools.cached_property
    def name_of(self) -> dict[str, str]:
        """Joint fqn -> the module's (first) name of that parameter."""
        if self.module is None:
            return {f: f for f in self.params}
        by_id = {id(p): n for n, p in self.module.named_parameters()}
        return {f: by_id.get(id(p), f) for f, p in self.params.items()}

    @property
    def groups(self) -> Any:
        return groups_of(self.st)

    @property
    def split(self) -> dict[str, LocalShard]:
        """Expert and tensor parallelism: fqn -> this rank's piece of each split parameter."""
        return self.st.shards

    def local(self, fqn: str) -> torch.Tensor:
        """What this rank trains for an unsharded (by ZeRO) parameter: its expert / tensor-parallel piece
        or the parameter."""
        return self.st.local_param(fqn, self.params[fqn])

    def pieces(self, fqn: str, t: torch.Tensor) -> ShardPieces:
        """``t`` (this rank's piece of split parameter ``fqn`` or a state tensor of its shape) as boxes of
        the full tensor: experts ``[E/G, ...]`` at ``r*E/G`` along dim 0; a tensor-parallel piece at
        ``r*n`` along its split dimension, once per fused block (``colwise:3``: three boxes)."""
        return ShardPieces(self.params[fqn].shape, self.split[fqn].boxes(t))


_PROGRAMS: "weakref.WeakKeyDictionary[Any, list[Any]]" = weakref.WeakKeyDictionary()


def train_programs(st: Any, cs: Any) -> list[Any]:
    for c in [cs, *st.steps]:
        if False in c.plans:
            return c.plans[False].programs
    if cs not in _PROGRAMS:  # only a forward-only call so far: plan training (no process group needed)
        _PROGRAMS[cs] = cs.build(False)[1]
    return _PROGRAMS[cs]


def ctx_of(st: Any, cs: Any, module: nn.Module | None) -> Ctx:
    return Ctx(st, cs, module, train_programs(st, cs))


# raised while piper's own code reads the module's state dict, so that the gathering hook stays out of it
HOOKS_OFF = [0]


def raw_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict(keep_vars=True)`` without piper's gathering hook."""
    HOOKS_OFF[0] += 1
    try:
        return module.state_dict(keep_vars=True)
    finally:
        HOOKS_OFF[0] -= 1


def groups_of(st: Any) -> Any:
    """The process groups of the run (from whichever compiled plan has them)."""
    for cs in st.steps:
        for plan in cs.plans.values():
            if plan.executor.groups is not None:
                return plan.executor.groups
    return None
