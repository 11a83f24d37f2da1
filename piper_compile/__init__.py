"""piper_compile: a programmable distributed-training compiler, as the torch.compile backend ``"piper"``.

    step = torch.compile(model, backend="piper", dynamic=True,
                         options={"directives": [...], "optimizer": functools.partial(torch.optim.AdamW, lr=3e-4)})
    loss = step(x, y)   # one whole training step
"""
import torch.fx.experimental._config as _fx_config

# Duck shaping gives equal input sizes one symbol: a batch of 16 with a sequence or feature size of 16
# would make micro-batch slicing change both. piper needs the batch to be its own symbol. (Loaded via
# the torch_dynamo_backends entry point when torch.compile(..., backend="piper") is called, i.e.
# before Dynamo traces.)
if hasattr(_fx_config, "use_duck_shape"):
    _fx_config.use_duck_shape = False


class _WithOnceLoggers(set):
    """Dynamo's ``ignore_logging_functions`` plus transformers' lru-cached ``warning_once`` / ``info_once``,
    looked up on ``logging.Logger`` each time Dynamo asks (transformers may be imported after piper, and
    ``torch._dynamo.reset()`` keeps config). transformers calls them inside ``forward`` (GPT-2 with
    ``labels=``: "`loss_type=None` was set in the config but it is unrecognized"), and Dynamo cannot trace a
    logging call: ``fullgraph=True`` failed with ``Unsupported: logging.Logger method not supported``.
    Skipped, a message meant to print once is not printed while compiled."""

    @staticmethod
    def _once() -> set:
        import logging

        return {fn for fn in map(logging.Logger.__dict__.get, ("warning_once", "info_once")) if fn is not None}

    def __contains__(self, fn: object) -> bool:
        return set.__contains__(self, fn) or (getattr(fn, "__hash__", None) is not None and fn in self._once())

    def __iter__(self):  # noqa: ANN204 - Dynamo's variable builder iterates the set
        return iter(set(set.__iter__(self)) | self._once())

    def __deepcopy__(self, memo: dict) -> set:
        """A copy of the config (its hash, torch 2.11's compile-metrics record) holds the plain entries: 2.11
        sorts every set of the config for its record, and two functions do not sort -- each compile after
        transformers' import failed that record with a traceback and kept the compiled model alive."""
        return set(set.__iter__(self))


import torch._dynamo.config as _dynamo_config  # noqa: E402

if hasattr(_dynamo_config, "ignore_logging_functions") and not isinstance(
        _dynamo_config.ignore_logging_functions, _WithOnceLoggers):
    _dynamo_config.ignore_logging_functions = _WithOnceLoggers(_dynamo_config.ignore_logging_functions)

from piper_compile import schedules  # noqa: E402
from piper_compile.api import (  # noqa: E402
    StaticPlan, compile, compiled_steps, explain, last_stats, loss_scaler, memory_report, optimizer, plan, stats,
    trained_parameters,
)
from piper_compile.backend import piper_backend  # noqa: E402


def _register_backend() -> None:
    """``backend="piper"`` also where the package is not pip-installed (its entry point then is missing:
    e.g. the repository on ``PYTHONPATH`` on a GPU machine that cannot install anything)."""
    if "piper" not in _dynamo.list_backends(exclude_tags=()):
        _dynamo.register_backend(piper_backend, name="piper")


import torch._dynamo as _dynamo  # noqa: E402

_register_backend()
from piper_compile.capture import region_guards  # noqa: E402

# a nested compile region guards every block it is stamped out for, also the user's own under
# torch.compile(backend="piper") (Dynamo's reuse check runs while tracing, before any backend sees the graph)
region_guards.install()
from piper_compile.capture.annotate import annotate  # noqa: E402
from piper_compile.checkpoint import (  # noqa: E402
    CheckpointIncomplete, LoadResult, full_state_dict, load, load_full_state_dict, materialize_optimizer_state, save, sharded_state_dict,
)
from piper_compile.directives import checkpoint, order, pipeline, place, replicate, shard, shard_tensor, split  # noqa: E402
from piper_compile.init.replay import materialize  # noqa: E402
from piper_compile.autoplan import autoplan, profile  # noqa: E402
from piper_compile.metrics import StepMetrics  # noqa: E402
from piper_compile.runtime.consistency import local  # noqa: E402
from piper_compile.errors import PiperCaptureError, PiperDirectiveError, PiperError, PiperPlanError, PiperRuntimeError  # noqa: E402

__all__ = ["autoplan", "materialize", "profile", "checkpoint", "StaticPlan", "StepMetrics", "stats", "compile", "plan", "trained_parameters", "memory_report", "PiperCaptureError", "PiperDirectiveError", "PiperError", "PiperPlanError", "PiperRuntimeError", "annotate",
           "compiled_steps", "explain", "last_stats", "local", "loss_scaler", "optimizer", "order", "piper_backend", "pipeline", "place",
           "replicate", "schedules", "shard", "shard_tensor", "split", "full_state_dict", "load", "load_full_state_dict",
           "materialize_optimizer_state", "save", "sharded_state_dict", "CheckpointIncomplete", "LoadResult"]
