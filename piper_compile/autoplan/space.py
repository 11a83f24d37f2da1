"""The strategies ``autoplan`` searches: a ``Candidate`` names one (pipeline degree and schedule,
micro-batches, data parallelism with its ZeRO level, expert parallelism, activation checkpointing) and
writes it as the directives a user would (``Candidate.directives``). ``candidates`` lists the valid
ones for a world, a model's block count and a global batch."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

import piper_compile.directives.builders as B
from piper_compile import schedules as S

# schedule name -> virtual stages per pipeline rank
SCHEDULES: dict[str, int] = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "interleaved": 2, "zbv": 2, "dualpipev": 2}
CHECKPOINT_POLICIES: tuple[str, ...] = ("none", "selective", "full")  # cheapest first: more memory, less recompute
STAGE_TAG, BLOCK_TAG = "PP", "AC"


@dataclass(frozen=True)
class Candidate:
    """One strategy for ``world = pp * dp`` ranks: pipeline rank r's stages run on device group
    ``[r, r + pp, r + 2 pp, ...]`` (its ``dp`` replicas)."""

    pp: int = 1
    dp: int = 1
    schedule: str = "none"  # one of SCHEDULES when pp > 1
    microbatches: int = 1
    zero: int = 0
    bucket_mb: float = 25.0
    checkpoint: str = "none"  # one of CHECKPOINT_POLICIES
    ep: bool = False  # expert parallelism over each stage's replicas
    tp: int = 1  # tensor-parallel degree (the layers of autoplan's ``tp_plan``)

    @property
    def stages(self) -> int:
        return self.pp * SCHEDULES.get(self.schedule, 1)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def replica(self, rank: int) -> int:
        """Which of the ``dp`` slices of the global batch ``rank`` trains on (a TP group shares one)."""
        if self.tp == 1:
            return rank // self.pp
        return (rank % (self.dp * self.tp)) // self.tp

    def label(self) -> str:
        parts = [f"PP{self.pp} {self.schedule}" if self.pp > 1 else "no PP", f"m={self.microbatches}"]
        if self.dp > 1:
            parts.append(f"DP{self.dp} ZeRO-{self.zero}")
        if self.ep:
            parts.append(f"EP{self.dp}")
        if self.tp > 1:
            parts.append(f"TP{self.tp}")
        if self.checkpoint != "none":
            parts.append(f"checkpoint {self.checkpoint}")
        return ", ".join(parts)

    def group(self, r: int) -> list[int]:
        """The ranks of pipeline rank ``r`` (its data-parallel replicas; with TP, ``dp`` groups of ``tp``
        consecutive ranks)."""
        if self.tp == 1:
            return [r + self.pp * i for i in range(self.dp)]
        return [r * self.dp * self.tp + k for k in range(self.dp * self.tp)]

    def tp_groups(self) -> list[list[int]]:
        return [g[j:j + self.tp] for r in range(self.pp) for g in [self.group(r)] for j in range(0, len(g), self.tp)]

    def directives(self, tp_plan: dict[str, str] | None = None, expert_load: float = 1.0) -> list[dict[str, Any]]:
        """The strategy as directives (blocks tagged ``PP`` = stage, and ``AC`` = block when checkpointing;
        ``tp_plan``: the ``shard_tensor`` layers, when ``tp`` > 1; ``expert_load``: ``shard``'s load)."""
        out: list[dict[str, Any]] = [*self._placement(), B.split(self.microbatches), *self._order()]
        if self.dp > 1:
            out.append(B.replicate({STAGE_TAG: "*"} if self.pp > 1 else {}, zero=self.zero, bucket_mb=self.bucket_mb))
        if self.ep:
            out.append(B.shard({"EP": "*"}, load=expert_load))
        if self.tp > 1:
            if not tp_plan:
                raise ValueError("piper: internal: a tensor-parallel candidate needs the tp_plan")
            out.append(B.shard_tensor(tp_plan, devices=self.tp_groups()))
        if self.checkpoint != "none":
            out.append(B.checkpoint({BLOCK_TAG: "*"}, self.checkpoint))
        return out

    def _placement(self) -> list[dict[str, Any]]:
        p = self.pp
        if p == 1:
            return []
        if self.schedule in ("zbv", "dualpipev"):
            return S.v_shape(p, STAGE_TAG, [self.group(r) for r in range(p)])
        return [B.place({STAGE_TAG: s}, self.group(s % p)) for s in range(self.stages)]

    def _order(self) -> list[dict[str, Any]]:
        p, m = self.pp, self.microbatches
        if p == 1:
            return []
        if self.schedule == "interleaved":
            return S.interleaved_1f1b(p, 2, m)
        if self.schedule in ("zbv", "dualpipev"):
            build = S.zbv if self.schedule == "zbv" else S.dualpipe_v
            return [d for d in build(p, m) if d["op"] == "order"]  # placement above, with the replicas
        return {"gpipe": S.gpipe, "1f1b": S.one_f_one_b, "zb_h1": S.zb_h1}[self.schedule](p, m)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world: int, blocks: int, batch: int, has_experts: bool, schedules: tuple[str, ...],
               zero_levels: tuple[int, ...], microbatch_factors: tuple[int, ...] = (1, 2, 4),
               tensor_parallel: bool = False) -> Iterator[Candidate]:
    """Every valid strategy without checkpointing (``search`` adds policies when memory needs them):
    ``pp * dp * tp == world``, the global ``batch`` divisible by ``dp``, the local batch by the micro-batch
    count, at most one stage per block, schedules' micro-batch rules."""
    for tp in (_divisors(world) if tensor_parallel else [1]):
        yield from _with_tp(world, tp, blocks, batch, has_experts and tp == 1, schedules, zero_levels,
                            microbatch_factors)


def _with_tp(world: int, tp: int, blocks: int, batch: int, has_experts: bool, schedules: tuple[str, ...],
             zero_levels: tuple[int, ...], microbatch_factors: tuple[int, ...]) -> Iterator[Candidate]:
    for pp in _divisors(world // tp):
        dp = world // tp // pp
        if batch % dp:
            continue
        local = batch // dp
        for schedule in (schedules if pp > 1 else ("none",)):
            if pp * SCHEDULES.get(schedule, 1) > blocks:
                continue
            base = pp if pp > 1 else 1
            for f in microbatch_factors:
                m = base * f
                if local % m or (schedule == "interleaved" and m % pp):
                    continue
                for zero in (zero_levels if dp > 1 else (0,)):
                    for ep in ((False, True) if has_experts and dp > 1 else (False,)):
                        yield Candidate(pp, dp, schedule, m, zero, ep=ep, tp=tp)


def with_checkpoint(c: Candidate, policy: str) -> Candidate:
    return replace(c, checkpoint=policy)
