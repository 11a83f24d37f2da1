"""``options={...}`` of ``torch.compile(model, backend="piper", options=...)``: parsed and checked once.

Each option's default comes from its ``PIPER_*`` knob where it has one (``knobs.py``), so a bad value is
named where it came from: the option, or the environment variable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from piper_compile.directives.spec import Directive, Replicate, parse_directives
from piper_compile.errors import PiperError
from piper_compile.knobs import KNOBS, knob
from piper_compile.init.deferred import InitChoice
from piper_compile.precision import Precision

OPTION_KEYS = frozenset({"directives", "optimizer", "codegen", "timeout", "clip_grad_norm", "remat",
                         "overlap_streams", "reorder_window", "mixed_precision", "loss_scaling", "log_stats",
                         "memory_budget_mb", "init", "init_seed", "init_fn", "cuda_graph", "local_batch_ops"})


@dataclass
class Options:
    """The backend's options, checked."""

    directives: list[Directive]
    optimizer: Callable[..., torch.optim.Optimizer] | None
    codegen: str
    timeout_s: float
    clip_grad_norm: float | None = None
    remat: bool = True  # recompute cheap activations in the backward instead of keeping them (capture/remat.py)
    overlap_streams: bool = True  # CUDA: an overlap slot's two compute steps on two streams (runtime/executor.py)
    reorder_window: int = 8  # gloo: compute steps ahead a waiting step may let run first (plan/reorder.py)
    precision: Precision = Precision()  # options["mixed_precision"] (precision.py)
    log_stats: int = 0  # log piper.stats's line at INFO every N training steps (metrics.py); 0: never
    memory_budget_mb: float | None = None  # reject a plan whose predicted per-rank peak exceeds it (memory.py)
    init: Any = None  # options["init"] / ["init_seed"] for models built on the meta device (init/deferred.py)
    cuda_graph: bool = False  # one GPU: replay the whole training step as one CUDA graph (runtime/graph.py)
    local_batch_ops: bool = False  # ops relating samples see each piece's own (capture/coupling.py)

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> "Options":
        """Check ``options`` (a ``piper:`` error naming the option, what it takes and how to fix it)."""
        options = dict(options or {})
        unknown = set(options) - OPTION_KEYS
        if unknown:
            raise PiperError(f"piper: unknown option(s) {sorted(unknown)}; the piper backend takes {sorted(OPTION_KEYS)}")
        opt = _optimizer(options.get("optimizer"))
        directives = parse_directives(options.get("directives"))
        for d in directives:
            if isinstance(d, Replicate) and d.zero > 0 and opt is None:
                raise d.error(f"zero={d.zero} shards optimizer state, so piper must run the optimizer",
                              "pass options['optimizer'], e.g. functools.partial(torch.optim.AdamW, lr=3e-4)")
        return cls(directives, opt, _codegen(options), _timeout(options), _clip(options.get("clip_grad_norm"), opt),
                   _flag(options, "remat", "recompute cheap activations such as GELU and layer-norm outputs in "
                         "the backward instead of keeping them"),
                   _flag(options, "overlap_streams", "on CUDA, run the two compute steps of an overlap slot on "
                         "two streams"),
                   _window(options), Precision.parse(options.get("mixed_precision"), opt is not None,
                                                    options.get("loss_scaling")), _every(options),
                   _budget(options.get("memory_budget_mb")), InitChoice.parse(options),
                   _flag(options, "cuda_graph", "on one GPU, record the whole training step once and replay it as "
                         "one CUDA graph"),
                   _flag(options, "local_batch_ops", "ops relating samples of the batch to each other, such as a "
                         "contrastive loss's in-batch negatives, see only each micro-batch's and replica's own samples"))


def _optimizer(opt: Any) -> Callable[..., torch.optim.Optimizer] | None:
    if opt is not None and not callable(opt):
        raise PiperError("piper: options['optimizer'] must be a callable params -> torch.optim.Optimizer, e.g. "
                         f"functools.partial(torch.optim.AdamW, lr=3e-4); got {type(opt).__name__}")
    return opt


def _codegen(options: dict[str, Any]) -> str:
    codegen = options["codegen"] if "codegen" in options else knob("PIPER_CODEGEN")
    if codegen not in ("inductor", "eager"):
        raise PiperError(f"piper: options['codegen'] must be 'inductor' or 'eager', got {codegen!r}")
    return codegen


def _timeout(options: dict[str, Any]) -> float:
    if "timeout" not in options:
        return float(knob("PIPER_TIMEOUT"))
    raw = options["timeout"]
    try:
        timeout = float(raw)
    except (TypeError, ValueError):
        raise PiperError(f"piper: options['timeout'] must be a number of seconds, got {raw!r}") from None
    if timeout <= 0:
        raise PiperError(f"piper: options['timeout'] must be > 0 seconds, got {timeout}")
    return timeout


def _clip(clip: Any, opt: Any) -> float | None:
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0:
        raise PiperError(f"piper: options['clip_grad_norm'] must be a positive number (the max global "
                         f"gradient norm), got {clip!r}")
    if opt is None:
        raise PiperError("piper: options['clip_grad_norm'] clips before piper's optimizer step, so it needs "
                         "options['optimizer']; without one, clip param.grad yourself after the call")
    return float(clip)


def _every(options: dict[str, Any]) -> int:
    value = options["log_stats"] if "log_stats" in options else knob("PIPER_LOG_STATS")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PiperError(f"piper: options['log_stats'] must be a whole number of steps >= 0 (log piper.stats "
                         f"every N training steps at INFO on the 'piper_compile.stats' logger; 0: never), got {value!r}")
    return value


def _budget(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PiperError(f"piper: options['memory_budget_mb'] must be a positive number of MiB per rank (plans whose "
                         f"predicted peak on some rank exceeds it are rejected before anything runs), got {value!r}")
    return float(value)


def _flag(options: dict[str, Any], key: str, meaning: str) -> bool:
    """A boolean option; its default is its knob ``PIPER_<KEY>``."""
    value = options[key] if key in options else knob(f"PIPER_{key.upper()}")
    if not isinstance(value, bool):
        raise PiperError(f"piper: options[{key!r}] must be True ({meaning}) or False, got {value!r}")
    return value


def _window(options: dict[str, Any]) -> int:
    if "reorder_window" not in options:
        return int(knob("PIPER_REORDER_WINDOW"))
    window = options["reorder_window"]
    if isinstance(window, str) and window.isdigit():
        window = int(window)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise PiperError(f"piper: options['reorder_window'] must be {KNOBS['PIPER_REORDER_WINDOW'].expected()} "
                         "(how many compute steps ahead the runtime may run while a step waits for its input; 0 "
                         f"keeps program order except for overlap slots), got {window!r}")
    return window
