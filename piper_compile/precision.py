"""``options["mixed_precision"]``: which dtypes a step computes, reduces and returns in.

The vocabulary is FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy`` (``param_dtype``,
``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``); a dict with the same keys, dtypes
written as ``torch.bfloat16`` or ``"bf16"`` / ``"fp16"`` / ``"fp32"``, is accepted too.

What each field means in piper (one place: the capture, the runtime and the tests read it here):

- ``param_dtype``: the dtype of the *compute copy* of every floating parameter. The model's parameters
  (the master weights), their gradients accumulated across micro-batches and the optimizer state stay
  in the parameters' own dtype (fp32); the step is captured with the parameters in ``param_dtype``, so
  activations, stage-to-stage traffic and ZeRO-3 gathers move ``param_dtype`` bytes.
- ``reduce_dtype``: the dtype gradients are reduced in across data-parallel replicas. Unlike FSDP2
  (whose default is ``param_dtype``), piper's default is the gradient's own dtype (fp32): a lossy
  reduction is something to ask for, e.g. ``reduce_dtype="bf16"`` halves the bytes.
- ``output_dtype``: the dtype of the returned loss (default fp32, whatever the compute dtype).
- ``cast_forward_inputs``: floating tensors passed to the forward (not 0-d ones) are cast to
  ``param_dtype`` (default True).

``param_dtype=fp16`` turns on dynamic loss scaling (fp16 keeps 5 exponent bits: small gradients flush
to zero and large ones overflow), with ``torch.amp.GradScaler``'s semantics and defaults: each
micro-batch's backward is seeded with the loss scale; the fp32 gradients are checked for inf/NaN on
every rank (one world all-reduce, so a step found bad on *any* rank is skipped on *every* rank),
unscaled before clipping and the optimizer step; the scale backs off after a skipped step and grows
after ``growth_interval`` good ones. ``options["loss_scaling"]`` takes a ``torch.amp.GradScaler`` or a
dict of its arguments (``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
``enabled``); the scale is saved in checkpoints (``runtime/loss_scale.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from piper_compile.errors import PiperError

_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
_SCALER_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
_HOW = ("pass options['mixed_precision'] = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) "
        "or {'param_dtype': 'bf16', 'reduce_dtype': 'fp32'}")


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling, in ``torch.amp.GradScaler``'s words and with its defaults."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    @classmethod
    def parse(cls, raw: Any, param_dtype: torch.dtype | None) -> "LossScaling | None":
        """``options["loss_scaling"]`` (None, a ``GradScaler`` or a dict) for this compute dtype: on for
        fp16 unless ``enabled=False``; asking for it with another dtype is an error (bf16 has fp32's range)."""
        fields = _scaler_fields(raw)
        if not fields.get("enabled", True):
            return None
        if param_dtype != torch.float16:
            if raw is None:
                return None
            raise PiperError(
                f"piper: options['loss_scaling'] scales fp16 gradients, but mixed_precision's param_dtype is "
                f"{param_dtype}; drop options['loss_scaling'] (bf16 and fp32 do not overflow) or use param_dtype='fp16'")
        kw = {k: v for k, v in fields.items() if k != "enabled"}
        out = cls(**kw)
        ok = (out.init_scale > 0 and out.growth_factor > 1 and 0 < out.backoff_factor < 1
              and isinstance(out.growth_interval, int) and out.growth_interval >= 1)
        if not ok:
            raise PiperError(f"piper: options['loss_scaling'] = {fields!r} is not a valid scaler: it needs "
                             "init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and a whole growth_interval >= 1")
        return out


def _scaler_fields(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if isinstance(raw, torch.amp.GradScaler):
        return {"init_scale": raw.get_scale() if raw.is_enabled() else 1.0, "growth_factor": raw.get_growth_factor(),
                "backoff_factor": raw.get_backoff_factor(), "growth_interval": raw.get_growth_interval(),
                "enabled": raw.is_enabled()}
    return _checked_dict(raw, "loss_scaling", _SCALER_FIELDS,
                         f"a torch.amp.GradScaler or a dict of its arguments {list(_SCALER_FIELDS)}")


@dataclass(frozen=True)
class Precision:
    """A checked mixed-precision policy; ``Precision()`` is full precision (nothing is cast)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    scaling: LossScaling | None = None  # fp16: dynamic loss scaling

    @property
    def active(self) -> bool:
        """Whether parameters get a compute copy in another dtype."""
        return self.param_dtype is not None

    def compute(self, t: torch.Tensor) -> torch.dtype:
        """The dtype ``t`` (a floating parameter, or an input) is computed in."""
        return self.param_dtype if self.param_dtype is not None and t.is_floating_point() else t.dtype

    def cast_input(self, t: Any) -> Any:
        """A floating tensor argument of the forward in the compute dtype (under ``cast_forward_inputs``;
        0-d tensors are left alone: Dynamo passes Python floats as such, and they are not activations)."""
        if not (self.cast_forward_inputs and isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim()):
            return t
        return t.to(self.compute(t))

    def loss_dtype(self, computed: torch.dtype) -> torch.dtype:
        """The dtype the step sums and returns its loss in."""
        if self.output_dtype is not None:
            return self.output_dtype
        return torch.float32 if self.active else computed

    def reduce(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``grad_dtype`` are reduced in."""
        return self.reduce_dtype if self.reduce_dtype is not None else grad_dtype

    @classmethod
    def parse(cls, raw: Any, has_optimizer: bool, scaling: Any = None) -> "Precision":
        """``options["mixed_precision"]`` (None, a ``MixedPrecisionPolicy`` or a dict) and
        ``options["loss_scaling"]``, checked."""
        if raw is None:
            LossScaling.parse(scaling, None)  # a scaler without fp16 is an error
            return cls()
        fields = _fields_of(raw)
        dtypes = {k: _dtype(k, fields.get(k)) for k in _FIELDS[:3]}
        cast = fields.get("cast_forward_inputs", True)
        if not isinstance(cast, bool):
            raise PiperError(f"piper: options['mixed_precision']['cast_forward_inputs'] must be True or False, "
                             f"got {cast!r}")
        if dtypes["param_dtype"] is not None and not has_optimizer:
            raise PiperError(
                "piper: options['mixed_precision'] keeps fp32 master weights that piper's optimizer steps after "
                "each call, so it needs options['optimizer'], e.g. functools.partial(torch.optim.AdamW, lr=3e-4)")
        return cls(dtypes["param_dtype"], dtypes["reduce_dtype"], dtypes["output_dtype"], cast,
                   LossScaling.parse(scaling, dtypes["param_dtype"]))


def _fields_of(raw: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(raw, MixedPrecisionPolicy):
        return {k: getattr(raw, k) for k in _FIELDS}
    return _checked_dict(raw, "mixed_precision", _FIELDS, f"a MixedPrecisionPolicy or a dict ({_HOW})")


def _checked_dict(raw: Any, option: str, fields: tuple[str, ...], takes: str) -> dict[str, Any]:
    """``options[option]`` given as a dict: a copy, or a piper: error for another type or an unknown key."""
    if not isinstance(raw, dict):
        raise PiperError(f"piper: options[{option!r}] must be {takes}, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise PiperError(f"piper: options[{option!r}] has unknown key(s) {unknown}; it takes {list(fields)}")
    return dict(raw)


def _dtype(key: str, value: Any) -> torch.dtype | None:
    if value is None:
        return None
    dtype = _NAMES.get(value.lower()) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype):
        raise PiperError(f"piper: options['mixed_precision'][{key!r}] = {value!r} is not a dtype; write "
                         f"torch.bfloat16 or one of {sorted(_NAMES)}")
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise PiperError(f"piper: options['mixed_precision'][{key!r}] = {dtype} is not a training dtype; use "
                         "torch.bfloat16, torch.float16 or torch.float32")
    return dtype
