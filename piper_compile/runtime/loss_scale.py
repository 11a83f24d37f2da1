"""Dynamic loss scaling for fp16 compute (``precision.LossScaling``), with ``torch.amp.GradScaler``'s
semantics.

Each micro-batch's backward is seeded with ``scale`` times its share of the loss, so the fp16 backward
keeps small gradients representable; the gradients accumulate in fp32 already multiplied by ``scale``.
Before the update every rank adds the squared norm of the gradients it counts (the clipping norm's
all-reduce, ``ir/ops/grad.NormReduce``, which lowering inserts whenever a scaler is on): the world sum is
not finite exactly when some gradient on *some* rank holds an inf or a NaN, and every rank reads the same
sum, so every rank skips the same steps and keeps the same scale. A good step unscales (one multiply by
``1 / scale``: exact, as the scale is a power of two under the default factors) before clipping and the
optimizer step.

The scaler's state lives in ``TrainState`` and is saved with the optimizer state in checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from piper_compile.precision import LossScaling


@dataclass
class LossScaler:
    """The running scale and the count of good steps since it last changed (GradScaler's growth tracker)."""

    config: LossScaling
    scale: float = 0.0
    growth_tracker: int = 0
    skipped: int = 0  # steps skipped so far (inf/NaN gradients)
    last_skipped: bool = False

    def __post_init__(self) -> None:
        if not self.scale:
            self.scale = float(self.config.init_scale)

    def seed(self, share: float) -> float:
        """A micro-batch's backward seed: its share of the loss times the scale."""
        return share * self.scale

    def unscale(self, grads: list[torch.Tensor], grad_sq: torch.Tensor) -> torch.Tensor | None:
        """After the world's squared-norm sum ``grad_sq`` (of the scaled gradients): None when it is not
        finite (skip the step; the scale backs off), else the gradients divided by the scale in place and
        the unscaled squared norm. The scale is updated for the next step either way."""
        finite = math.isfinite(float(grad_sq))
        used = self.scale
        self._update(finite)
        self.last_skipped = not finite
        if not finite:
            self.skipped += 1
            return None
        inv = 1.0 / used
        if grads:
            torch._foreach_mul_(grads, inv)  # one multi-tensor kernel, not one per gradient
        return grad_sq * (inv * inv)

    def _update(self, finite: bool) -> None:
        """GradScaler.update: back off after an overflow, grow after ``growth_interval`` good steps."""
        if not finite:
            self.scale *= self.config.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (GradScaler's key names)."""
        return {"scale": self.scale, "_growth_tracker": self.growth_tracker, "skipped": self.skipped}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self.growth_tracker = int(sd["_growth_tracker"])
        self.skipped = int(sd.get("skipped", 0))
