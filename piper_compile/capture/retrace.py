"""Mixed precision at capture: Dynamo traces the module again with its parameters (and forward inputs) in
the compute dtype, so that every dtype the model reads from a tensor follows it.

Dynamo bakes dtypes into its graph: ``w.to(x.dtype)`` traced with fp32 tensors records ``to(float32)``.
Re-running that fp32 graph with bf16 inputs would keep such casts at fp32 (a router's weights, an
RMSNorm's output) and compute part of the step in another dtype than the eager model in bf16 does, or
fail on a matmul of mixed dtypes. Tracing the module itself with its parameters' data swapped for bf16
copies gives the graph eager bf16 would run; the parameters keep their identity (and get their fp32 data
back), so the rest of piper sees the same parameters with a graph that computes in bf16.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

from piper_compile.capture.dynamo import Traced, trace
from piper_compile.errors import PiperCaptureError
from piper_compile.precision import Precision
from piper_compile.runtime.zero import no_storage


@contextlib.contextmanager
def parameters_in(module: nn.Module, precision: Precision) -> Iterator[None]:
    """Every floating parameter of ``module`` holds a compute-dtype copy of its data while inside."""
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for p in module.parameters():
                if p.is_floating_point() and precision.compute(p) != p.dtype:
                    saved.append((p, p.data))
                    dtype = precision.compute(p)
                    empty = p.untyped_storage().nbytes() == 0  # released, or a meta model's stand-in
                    p.data = no_storage(tuple(p.shape), dtype, p.device) if empty else p.data.to(dtype)
        yield
    finally:
        for p, data in saved:
            p.data = data


def retrace(module: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], precision: Precision) -> Traced:
    """Dynamo's graph of ``module(*args, **kwargs)`` computing in ``precision``'s dtypes."""
    args, kwargs = tree_map(precision.cast_input, call)
    with parameters_in(module, precision):
        return trace(module, args, kwargs)


def arg_order(first: list[str], again: list[str]) -> list[int]:
    """For each placeholder of the re-traced graph, the position of the same input (by Dynamo source) in
    the graph the user's ``torch.compile`` traced: the step is called with that graph's arguments. The
    first graph may have more (a sliced batch's storage offset: the cast inputs are fresh tensors)."""
    where = {s: i for i, s in enumerate(first)}
    missing = [s for s in again if s not in where]
    if missing:
        raise PiperCaptureError(
            f"piper: options['mixed_precision']: tracing the model with bf16 parameters needs graph inputs the fp32 "
            f"trace does not have ({', '.join(missing[:3])}): the model branches on a dtype. Make the forward "
            "independent of the parameters' dtype, or drop mixed_precision")
    return [where[s] for s in again]
