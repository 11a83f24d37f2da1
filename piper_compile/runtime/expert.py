"""Expert-parallel runtime: the all-to-alls and local steps of the chains ``passes/expert.py`` builds.

A rank at position ``r`` of an expert-parallel group of ``G`` ranks holds experts ``r*L .. r*L+L-1``
(``L = E / G``). Dispatch sorts the (token, choice) slots by expert, exchanges the per-expert counts
(a fixed-size all-to-all, so every rank learns how many rows it will receive), then sends the rows with
a variable-size ``all_to_all_single``. The received rows come grouped by source rank, then by local
expert; the expert step regroups them by expert, runs the local experts and restores the order, so the
combining all-to-all (the inverse split sizes) returns every row to its slot.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from piper_compile.runtime import comm
from piper_compile.codegen.experts import grouped_backward, grouped_forward
from piper_compile.nn.experts import route as sort_slots


@dataclass
class Route:
    """One micro-batch's routing through one MoE layer, shared by its forward and backward chains."""

    order: torch.Tensor  # slot order sorting the N*k slots by expert
    order_inv: torch.Tensor  # its inverse: where each slot sits in expert order
    tokens: int  # N
    top_k: int  # k
    send_splits: list[int]  # rows sent to each rank of the group
    recv_splits: list[int]  # rows received from each rank
    local_perm: torch.Tensor  # received rows, regrouped by local expert
    local_inv: torch.Tensor  # its inverse: back to the received order
    local_counts: list[int]  # received rows per local expert


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Any:
    return comm.all_to_all(out, inp, out_splits, in_splits, group)


@dataclass
class Counts:
    """A forward COUNTS step's result: the slot order by expert, this rank's per-expert counts and (once
    the all-to-all completes) how many rows each rank sends to each of this rank's experts."""

    order: torch.Tensor
    counts: torch.Tensor
    recv_counts: torch.Tensor


def exchange_counts(idx: torch.Tensor, experts: int, group: Any) -> tuple[Any, Counts]:
    """Sort the slots by expert and issue the exchange of the per-expert counts (equal splits: ``L``
    experts per rank). The DISPATCH after it waits for the work and then knows its split sizes."""
    order, counts = sort_slots(idx, experts)
    recv_counts = torch.empty_like(counts)
    work = comm.all_to_all(recv_counts, counts, None, None, group)
    return work, Counts(order, counts, recv_counts)


def dispatch_route(x: torch.Tensor, idx: torch.Tensor, c: Counts, experts: int, size: int) -> tuple[Route, torch.Tensor]:
    """The route from the exchanged counts ``c`` (complete), and the rows to send."""
    n, k = idx.shape
    order, counts, local = c.order, c.counts, experts // size
    per_rank = c.recv_counts.view(size, local)  # [source rank, local expert]
    expert_of_row = torch.arange(local, device=idx.device).repeat(size).repeat_interleave(per_rank.reshape(-1))
    local_perm = torch.sort(expert_of_row, stable=True).indices
    route = Route(order=order, order_inv=torch.argsort(order), tokens=n, top_k=k,
                  send_splits=counts.view(size, local).sum(1).tolist(), recv_splits=per_rank.sum(1).tolist(),
                  local_perm=local_perm, local_inv=torch.argsort(local_perm), local_counts=per_rank.sum(0).tolist())
    return route, _rows(x, order // k)


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` along dim 0. Every permutation here is a gather (``index_select``, several times
    faster on CPU than advanced indexing or an ``index_put_`` scatter): scatters use the inverse."""
    return t.index_select(0, index)


def all_to_all(op: Any, inputs: list[Any], group: Any, size: int) -> tuple[Any, list[Any], torch.Tensor]:
    """Issue the all-to-all of a counts, dispatch or combine step (``ir/ops/expert``'s ``ExpertCounts`` or
    ``ExpertA2A``): (work, outputs, the tensor the work sends)."""
    role = getattr(op, "role", "counts")
    if role == "counts":
        work, c = exchange_counts(inputs[0], op.experts, group)
        return work, [c], c.counts
    if role == "dispatch" and op.forward:
        x, idx, c = inputs
        route, send = dispatch_route(x, idx, c, op.experts, size)
        recv = send.new_empty(sum(route.recv_splits), send.shape[-1])
        return _a2a(recv, send, route.recv_splits, route.send_splits, group), [recv, route], send
    t, route = inputs
    if role == "dispatch":  # backward: output gradients travel the forward's way
        send = _rows(t.reshape(route.tokens * route.top_k, -1), route.order)
        out = send.new_empty(sum(route.recv_splits), send.shape[-1])
        return _a2a(out, send, route.recv_splits, route.send_splits, group), [out], send
    assert role == "combine", role
    out = t.new_empty(sum(route.send_splits), t.shape[-1])
    return _a2a(out, t, route.send_splits, route.recv_splits, group), [out], t


_OVER_PLAN = 1.1  # a step's load this far over the plan's is logged: the memory plan's 10% line
_warned: set[str] = set()


def check_load(route: Route, planned: float, label: str) -> float:
    """The rows this rank's experts received over balanced routing's (as many as the rank sent, ``N * k``).
    The first time a layer ``label`` exceeds the ``planned`` load (``shard``'s load) by more than 10%, a
    warning says so: the memory plan (and a budget check) counted fewer rows than this rank holds."""
    slots = route.tokens * route.top_k
    load = sum(route.recv_splits) / slots if slots else 0.0
    if load > _OVER_PLAN * planned and label not in _warned:
        _warned.add(label)
        logging.getLogger("piper_compile").warning(
            "piper: expert-parallel layer %s received %d rows on this rank, %.2fx balanced routing's %d, where "
            "the memory plan counts %.2fx: it under-counts what this rank holds; pass the measured skew as "
            "shard(..., load=%.2f) (piper.stats(step).expert_load gives it each step)",
            label, sum(route.recv_splits), load, slots, planned, load)
    return load


def step_transient(inputs: list[Any], forward: bool, codegen: str) -> int:
    """Bytes an experts step (its ``inputs``) holds while it runs: ``sim/expert_memory``'s rule at the rows
    it received per local expert."""
    from piper_compile.sim.expert_memory import step_transient as rule

    route, wg = (inputs[1], inputs[2]) if forward else (inputs[1], inputs[3])
    return rule(route.local_counts, wg.shape[-2], wg.shape[-1], wg.dtype, forward, codegen != "eager")


def swiglu_flops(inputs: list[Any], forward: bool) -> int:
    """FLOPs of an experts step on its received rows: forward the gate, up and down matmuls (6 R D H);
    backward recomputes gate and up, then the hidden, input and three weight gradients (16 R D H)."""
    recv, wg = (inputs[0], inputs[2]) if forward else (inputs[2], inputs[3])
    rows, d, h = recv.shape[0], wg.shape[-2], wg.shape[-1]
    return (6 if forward else 16) * rows * d * h


def compute(role: str, forward: bool, inputs: list[Any], accumulate: tuple[torch.Tensor, ...] | None = None,
            overwrite: bool = False, codegen: str = "inductor") -> list[Any]:
    """The local steps of a chain: the experts (forward or backward: ``codegen/experts.py`` computes them,
    the rows regrouped by local expert around it) and the final unpermute. Backward with ``accumulate``
    (the weight-gradient buffers): the weight gradients are added into them in place (``overwrite``:
    written over their old contents) and returned as ``None``."""
    if role == "experts" and forward:
        recv, route, wg, wu, wd = inputs
        ys = grouped_forward(_rows(recv, route.local_perm), route.local_counts, wg, wu, wd, codegen)
        return [_rows(ys, route.local_inv)]
    if role == "experts":
        grecv, route, recv, wg, wu, wd = inputs
        perm = route.local_perm
        gxs, gg, gu, gd = grouped_backward(_rows(grecv, perm), _rows(recv, perm), route.local_counts,
                                           wg, wu, wd, accumulate, overwrite, codegen)  # type: ignore[arg-type]
        gx = _rows(gxs, route.local_inv)
        return [gx, None, None, None] if accumulate is not None else [gx, gg, gu, gd]
    assert role == "unpermute", role
    back, route = inputs
    if forward:
        return [_rows(back, route.order_inv).view(route.tokens, route.top_k, -1)]
    gx = back.new_zeros(route.tokens, back.shape[-1])
    gx.index_add_(0, route.order // route.top_k, back)
    return [gx]
