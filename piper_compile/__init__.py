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

from piper_compile import schedules  # noqa: E402
from piper_compile.api import (  # noqa: E402
    StaticPlan, compiled_steps, explain, last_stats, optimizer, plan, trained_parameters,
)
from piper_compile.backend import piper_backend  # noqa: E402
from piper_compile.capture.annotate import annotate  # noqa: E402
from piper_compile.checkpoint import (  # noqa: E402
    full_state_dict, load, load_full_state_dict, materialize_optimizer_state, save, sharded_state_dict,
)
from piper_compile.directives import order, pipeline, place, replicate, shard, shard_tensor, split  # noqa: E402
from piper_compile.memory import memory_report  # noqa: E402
from piper_compile.errors import PiperCaptureError, PiperDirectiveError, PiperError, PiperPlanError, PiperRuntimeError  # noqa: E402

__all__ = ["StaticPlan", "plan", "trained_parameters", "memory_report", "PiperCaptureError", "PiperDirectiveError", "PiperError", "PiperPlanError", "PiperRuntimeError", "annotate",
           "compiled_steps", "explain", "last_stats", "optimizer", "order", "piper_backend", "pipeline", "place",
           "replicate", "schedules", "shard", "shard_tensor", "split", "full_state_dict", "load", "load_full_state_dict",
           "materialize_optimizer_state", "save", "sharded_state_dict"]
