"""piper_compile: a programmable distributed-training compiler, as the torch.compile backend ``"piper"``.

    step = torch.compile(model, backend="piper", dynamic=True,
                         options={"directives": [...], "optimizer": functools.partial(torch.optim.AdamW, lr=3e-4)})
    loss = step(x, y)   # one whole training step
"""
from piper_compile import schedules
from piper_compile.api import StaticPlan, compiled_steps, explain, last_stats, optimizer, plan
from piper_compile.backend import piper_backend
from piper_compile.capture.annotate import annotate
from piper_compile.directives import order, pipeline, place, replicate, split
from piper_compile.errors import PiperCaptureError, PiperDirectiveError, PiperError, PiperPlanError, PiperRuntimeError

__all__ = ["StaticPlan", "plan", "PiperCaptureError", "PiperDirectiveError", "PiperError", "PiperPlanError", "PiperRuntimeError", "annotate",
           "compiled_steps", "explain", "last_stats", "optimizer", "order", "piper_backend", "pipeline", "place",
           "replicate", "schedules", "split"]
