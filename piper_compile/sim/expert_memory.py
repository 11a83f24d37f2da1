"""What an expert-parallel chain holds (``passes/expert.py``): the one rule the memory plan (``ir/ops/expert``,
``ir/ops/compute.ExpertStep``) and the runtime's accounting (``ExpertStep.compute``) both follow.

- **Rows.** The all-to-alls of one MoE layer move the ``N x k`` (token, choice) slots of a micro-batch:
  ``dispatch`` to the experts' ranks, ``combine`` back, and the same ways for their gradients. How many
  rows a rank receives is known only once the router has run; the plan expects routing balanced: a rank
  receives as many rows as it sends, ``N * k``, spread over its ``E / G`` experts (the busiest one at the
  expected maximum load of uniformly random routing). A model whose router sends one rank more rows than
  that holds more than the plan says (measured: a rank receiving ~1.5x its balanced rows), unless
  ``shard``'s ``load`` says by how much: the experts' side is then sized at ``load`` times balanced
  routing (the runtime measures the load and warns above 1.1x the planned one).
  The received rows of the forward stay until the backward reads them again (an activation per layer and
  micro-batch in flight); before this rule the plan counted none of these values.
- **The experts step while it runs** (``runtime/expert.compute``): the rows regrouped by local expert (a
  copy; the backward copies its gradients and its rows), the grouped output before it is put back in
  slot order, and one expert's SwiGLU intermediates at a time (its largest block): the expert's own graph
  (``codegen/experts.expert_forward`` / ``expert_backward``) walked by ``sim/segment_memory``'s rule, at
  that row count, fused as Inductor's code or stored as the eager reference.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import torch


def expected_counts(slots: int, local_experts: int) -> list[int]:
    """Rows per local expert as the plan expects them: a rank receives ``slots`` rows (as many as it sends),
    spread evenly, except that the busiest expert gets the expected maximum of ``local_experts`` loads of
    uniformly random routing (mean plus ``sqrt(2 mean ln L)``): its block's intermediates are what the
    step holds at its peak."""
    if local_experts <= 1:
        return [slots]
    mean = slots / local_experts
    busiest = min(slots, round(mean + math.sqrt(2 * mean * math.log(local_experts))))
    return [busiest] + [(slots - busiest) // (local_experts - 1)] * (local_experts - 1)


def slot_bytes(shape: Any, dtype: str, sizes: Any, load: float = 1.0) -> int:
    """Bytes of a micro-batch's ``N x k`` slots of ``D`` features (``shape``: ``[N, k, D]``), times ``load``
    (an experts' rank receiving more than balanced routing's rows: ``shard``'s load)."""
    return int(load * sizes.tensor_bytes(shape, dtype or "float32")) if shape else 0


def planned_transient(shape: Any, dtype: str, experts: int, group: int, wg: str, forward: bool,
                      sizes: Any, load: float = 1.0) -> int:
    """:func:`step_transient` as the plan sees it: balanced routing of the slots of ``shape`` (times
    ``load``) over the ``experts / group`` local experts, hidden size read from the local gate weights
    ``wg``'s elements."""
    from piper_compile.sim.shapes import concrete

    if not shape:
        return 0
    slots, d = sizes.tensor_bytes(shape[:-1], "uint8"), concrete(shape[-1], sizes.symbols)
    local = max(experts // max(group, 1), 1)
    h = sizes.params_numel.get(wg.removeprefix("param:"), 0) // max(local * d, 1)
    if not h:
        return 0
    dt = getattr(torch, (dtype or "float32").removeprefix("torch."))
    return step_transient(expected_counts(round(load * slots), local), d, h, dt, forward, sizes.fused_code)


@functools.lru_cache(maxsize=None)
def _expert_graph(d: int, h: int, dtype: torch.dtype, forward: bool, fused: bool) -> tuple[Any, str]:
    """One expert's forward or backward traced on fake rows of a symbolic count: (graph, the symbol). The
    code that runs: Inductor's functions (``codegen/experts``) or the eager reference's loop body."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from piper_compile.codegen import experts as compiled
    from piper_compile.nn import experts as reference

    rows, out = torch.empty(compiled.ROWS_HINT, d, dtype=dtype), torch.empty(compiled.ROWS_HINT, d, dtype=dtype)
    wg, wd = torch.empty(d, h, dtype=dtype), torch.empty(h, d, dtype=dtype)
    grads = [wg.clone(), wg.clone(), wd.clone()]
    if forward:
        example, fn = [rows, wg, wg.clone(), wd], compiled.expert_forward if fused else reference.block_forward
    elif fused:
        example, fn = [out, rows, wg, wg.clone(), wd, *grads, torch.zeros((), dtype=torch.bool)], compiled.expert_backward
    else:
        example = [out, rows, wg, wg.clone(), wd, *grads]
        fn = lambda ge, xe, g, u, d_, gg, gu, gd: reference.block_backward(ge, xe, g, u, d_, gg, gu, gd)  # noqa: E731
    rows_first = 1 if forward else 2  # the inputs with a row count: the rows (and the output gradients)
    fakes = compiled.symbolic_rows(example, [i < rows_first for i in range(len(example))])
    with torch.no_grad():
        gm = make_fx(fn, tracing_mode="fake")(*fakes)
    gm.graph.output_node().args = ((gm.graph.output_node().args[0],),)  # one output, as a tuple
    return gm, str(fakes[0].shape[0].node.expr)


@functools.lru_cache(maxsize=None)
def _bytes_per_row(d: int, h: int, dtype: torch.dtype, forward: bool, fused: bool) -> int:
    """What one expert block holds per row it computes: every intermediate of its graph is ``rows x H`` or
    ``rows x D`` (the weights' gradients are added in place), so the walk's peak is linear in the rows."""
    from piper_compile.sim.segment_memory import transient_bytes

    gm, sym = _expert_graph(d, h, dtype, forward, fused)
    return transient_bytes(gm, {sym: 1}, fused=fused) + d * dtype.itemsize  # and its result, written in


def _block_bytes(rows: int, d: int, h: int, dtype: torch.dtype, forward: bool, fused: bool) -> int:
    return rows * _bytes_per_row(d, h, dtype, forward, fused) if rows > 0 else 0


def step_transient(counts: Sequence[int], d: int, h: int, dtype: torch.dtype, forward: bool, fused: bool) -> int:
    """Bytes the experts step holds while it runs beyond its inputs and outputs, for ``counts`` rows per
    local expert of ``d`` features (hidden ``h``): the regrouped copies (forward: the rows; backward: the
    gradients and the rows) and the grouped result, with the largest expert block's intermediates; less
    the output, made only once the copies are gone (the grouped result stays beside it)."""
    rows = sum(counts)
    copies = 1 if forward else 2  # regrouped input(s) and the grouped result, less the output
    block = max((_block_bytes(c, d, h, dtype, forward, fused) for c in set(counts)), default=0)
    return copies * rows * d * dtype.itemsize + block
