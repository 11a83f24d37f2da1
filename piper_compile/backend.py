"""The ``piper`` torch.compile backend: Dynamo hands it an FX graph and it returns a ``CompiledStep``
(``compiled_step.py``) at once, which does the work at its first call. Here: what a (re)compile is told
(``recompiles.py``), and the step reused where Dynamo traced the same graph again.
"""
from __future__ import annotations

import weakref
from typing import Any

from torch import fx

from piper_compile.capture.frame_versions import release_with
from piper_compile.codegen import warmup
from piper_compile.compiled_step import CompiledStep
from piper_compile.errors import PiperError
from piper_compile.recompiles import compiling_version, graph_key, say_recompile


def piper_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                  **kwargs: Any) -> CompiledStep:
    """The ``torch_dynamo_backends`` entry point ``piper``."""
    if kwargs:
        raise PiperError(f"piper: unexpected backend arguments {sorted(kwargs)}; pass settings in options={{...}}")
    version, reason = compiling_version(options)
    key = graph_key(gm, example_inputs, options)
    prior = _SAME_GRAPH.get(key)
    if reason is not None and prior is not None and prior.joint is not None and prior.raw_options is options:
        say_recompile(reason, reused=True)
        prior.reused_recompiles += 1
        return prior  # the same graph again: its capture, plans, compiled segments and state
    if reason is not None:
        say_recompile(reason, reused=False)
    step = CompiledStep(gm, example_inputs, options)
    step.recompile_reason = reason
    step.frame_code = version and version.code
    if version is not None and version.owner is not None:
        release_with(version.owner, step)
    warmup.start_for(example_inputs, lambda: step.options.codegen)  # overlaps the first call's capture
    _SAME_GRAPH[key] = step
    return step


# (options dict, graph code, input types): the step made for it. A recompile whose new graph is the old one
# -- transformers sets config.problem_type inside the first call, so Dynamo's guard on it fails once and
# it traces the same ops again -- gets the existing step instead of a new capture, plan and compilation.
_SAME_GRAPH: "weakref.WeakValueDictionary[tuple[Any, ...], CompiledStep]" = weakref.WeakValueDictionary()


__all__ = ["piper_backend"]
