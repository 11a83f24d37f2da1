"""What passes know about the captured model and the launch (world size, batch, parameter sizes)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from piper_compile.capture.segments import Segment
from piper_compile.ir.dims import parse_dim


@dataclass
class PassContext:
    world_size: int
    segments: dict[str, Segment]
    batched_values: set[str]  # external values that are sliced per micro-batch
    batch_symbols: set[str]  # names of the batch-size symbols ("s77"); empty if the batch is static
    batch_size: int  # batch size seen at capture
    forward_only: bool = False
    static_batch_op: str | None = None  # the op that hard-codes the batch size, if found
    specialized_input: str | None = None  # an input a guard fixed at the batch size (joint.specialized_input)
    timings: dict[str, float] = field(default_factory=dict)
    clip_grad_norm: float | None = None  # options["clip_grad_norm"]: clip by the global gradient norm
    loss_scaling: bool = False  # fp16 loss scaling: the norm all-reduce checks every rank's gradients
    tp_partial: frozenset[str] = frozenset()  # sequence parallel: params each TP rank holds a partial gradient of
    directives: list[Any] = field(default_factory=list)  # the user's directives (set by the driver), for errors

    def directive(self, index: int) -> Any:
        """The user's directive at ``index`` (its JSON names it in errors about two directives)."""
        return next((d for d in self.directives if d.index == index), None)

    def is_batched(self, value: str) -> bool:
        if value in self.batched_values:
            return True
        if value.startswith("symexpr:") and self.batch_symbols:
            return not _free_symbols(value[len("symexpr:"):]).isdisjoint(self.batch_symbols)
        return False

    @property
    def world(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    def tag_keys(self, dag: Any) -> set[str]:
        return {k for n in dag for k, _ in n.tags}


@functools.lru_cache(maxsize=1 << 14)
def _free_symbols(text: str) -> frozenset[str]:
    """Names of the symbols of a dimension expression (``s0*s1``)."""
    return frozenset(str(s) for s in parse_dim(text).free_symbols)
