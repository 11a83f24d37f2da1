"""The ``torch.distributed.pipelining`` peer of ``bench_ep_pipeline.py``: PP2 x EP2 on 4 ranks, by hand.

Layout (the same as piper's ``dualpipe_v(2, m, groups=GROUPS)`` + ``replicate`` + ``shard({"EP": "*"})``):
``GROUPS[p]`` is pipeline rank ``p``'s device group; the rank at position ``j`` of its group is data/expert
replica ``j``. So with ``GROUPS = [[0, 1], [2, 3]]``:

* pipelines (one ``PipelineStage`` chain each, P2P on its own ``dist.new_group``): ``[0, 2]`` and ``[1, 3]``;
  replica ``j`` feeds its pipeline with sequences ``[j*b, (j+1)*b)`` of the global batch, as piper's worker
  slices them;
* EP/DP groups (``all_to_all_single`` of the tokens, all-reduce of dense gradients): ``[0, 1]`` and ``[2, 3]``;
* V stages: pipeline rank ``p`` holds stages ``p`` and ``2P-1-p`` (group 0: stages 0 and 3; group 1: 1 and 2),
  the placement ``ScheduleDualPipeV``/``ScheduleZBVZeroBubble`` compute themselves (``style="v"``).

Stage ``s`` holds the blocks ``GPT.annotate_stages`` gives it (``bench_pp.StageModule``), embeddings on stage 0,
``ln_f`` + head on stage 3. The head stays tied to the embedding: both stages live on the same rank, so the two
stage modules share one ``Parameter`` and its gradient sums both uses, as in the single model.

Experts: every ``MoE`` is swapped for ``bench_ep.EPMoE`` (router replicated, ``E/2`` experts per rank,
variable-size ``all_to_all_single`` in an autograd Function, local experts through ``grouped_swiglu``).

Gradients (``sync_grads``): the schedules run with ``scale_grads=False``, since their own scaling divides a tied
parameter once per stage that holds it; after ``step`` every gradient is divided by ``2 * m`` (replicas x
micro-batches, each micro-batch loss being a mean) and the dense ones are first summed over the EP/DP pair with
one flat ``all_reduce`` (DDP's arithmetic; not overlapped with the backward). Expert gradients need no
reduction: the inverse all-to-all already brought every token's contribution to the expert's owner. The result
is the gradient of the global-batch mean loss, which is what piper computes.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from bench_ep import EXPERT_WEIGHTS, EPMoE
from bench_pp import StageModule, _ce
from common import RankResult, Spec, global_batches, peer_adamw, timed_loop

from piper_compile.testing.models import MoEGPT, build_model

# the peer schedules that accept 2 V-placed stages per pipeline rank
SCHEDULES = {"dualpipe_v": "ScheduleDualPipeV", "zbv": "ScheduleZBVZeroBubble"}


def position(rank: int, groups: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(pipeline rank, replica index) of ``rank``: which group holds it and where in that group."""
    for p, g in enumerate(groups):
        if rank in g:
            return p, list(g).index(rank)
    raise ValueError(f"ep_pipelining: rank {rank} is in none of the groups {groups}")


def pipelines(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """The ranks of each pipeline, ordered by pipeline rank: replica ``j`` of every group."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"ep_pipelining: groups of different sizes {groups}")
    return [[g[j] for g in groups] for j in range(sizes.pop())]


def v_stages(pp_rank: int, pp_size: int) -> list[int]:
    """The two stages pipeline rank ``pp_rank`` holds on the V: ``pp_rank`` and ``2*pp_size-1-pp_rank``."""
    return [pp_rank, 2 * pp_size - 1 - pp_rank]


def new_groups(groups: Sequence[Sequence[int]], rank: int) -> tuple[Any, Any]:
    """(this rank's pipeline group, this rank's EP/DP group). Every rank creates every group, in one order."""
    pp = [dist.new_group(r) for r in pipelines(groups)]
    ep = [dist.new_group(list(g)) for g in groups]
    p, j = position(rank, groups)
    return pp[j], ep[p]


def to_expert_parallel(model: MoEGPT, replica: int, ep: int, group: Any) -> set[str]:
    """Swap every MoE for an :class:`EPMoE` holding replica ``replica``'s ``E/ep`` experts; returns the expert
    parameters' names (no gradient hook: ``sync_grads`` scales them)."""
    names: set[str] = set()
    for i, block in enumerate(model.blocks):
        block.moe = EPMoE(block.moe, replica, ep, group)
        names |= {f"blocks.{i}.moe.{w}" for w in EXPERT_WEIGHTS}
    return names


def unique_params(model: nn.Module, modules: Sequence[nn.Module], experts: set[str]
                  ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) parameters of ``modules``, each once (the tied embedding/head appears in two stages),
    in the model's order so every rank of an EP/DP group lists the same dense parameters."""
    held = {id(p) for m in modules for p in m.parameters()}
    dense, expert = [], []
    for name, p in model.named_parameters():  # named_parameters yields a shared parameter once
        if id(p) in held:
            (expert if name in experts else dense).append(p)
    return dense, expert


def sync_grads(dense: list[nn.Parameter], expert: list[nn.Parameter], scale: float, group: Any) -> None:
    """Dense gradients: summed over the EP/DP group (one flat all-reduce); then every gradient times ``scale``."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    offset = 0
    for p, g in zip(dense, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p)
        offset += n
    for p in expert:
        if p.grad is not None:
            p.grad.mul_(scale)


def stage_io(spec: Spec, stage: int, stages: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example (input, output) of one micro-batch at ``stage``: tokens in at stage 0, logits out of the last.
    Activations require grad: torch 2.13 takes ``requires_grad`` of the received buffers from these examples."""
    seq, dim, vocab = spec.model["seq"], spec.model["dim"], spec.model["vocab"]
    x = torch.zeros(mb, seq, dtype=torch.long) if stage == 0 else torch.empty(mb, seq, dim, requires_grad=True)
    y = torch.empty(mb, seq, vocab if stage == stages - 1 else dim, requires_grad=True)
    return x, y


def build(rank: int, spec: Spec, groups: Sequence[Sequence[int]], kind: str, microbatches: int, experts: int
          ) -> tuple[Any, list[nn.Parameter], list[nn.Parameter], Any, list[int], MoEGPT]:
    """(schedule, dense params, expert params, EP/DP group, local stage ids, model) on this rank.
    Explicit stage shapes: pipelining's shape inference runs the stage on meta tensors, which the
    all-to-all's ``.tolist()`` of token counts cannot do."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    pp_group, ep_group = new_groups(groups, rank)
    p, j = position(rank, groups)
    model = build_model("moegpt", spec.seed, experts=experts, **spec.model)
    names = to_expert_parallel(model, j, len(groups[p]), ep_group)  # type: ignore[arg-type]
    n = 2 * len(groups)
    ids = v_stages(p, len(groups))
    if spec.batch % microbatches:
        raise ValueError(f"ep_pipelining: local batch {spec.batch} does not split into {microbatches} micro-batches")
    mb = spec.batch // microbatches
    modules = [StageModule(model, s, n) for s in ids]  # type: ignore[arg-type]
    stages = []
    for m, s in zip(modules, ids):
        x, y = stage_io(spec, s, n, mb)
        stages.append(PipelineStage(m, s, n, torch.device("cpu"), input_args=x, output_args=y, group=pp_group))
    sched = getattr(ts, SCHEDULES[kind])(stages, n_microbatches=microbatches, loss_fn=_ce, scale_grads=False)
    dense, expert = unique_params(model, modules, names)
    return sched, dense, expert, ep_group, ids, model  # type: ignore[return-value]


def worker(rank: int, world: int, spec: Spec, groups: list[list[int]], kind: str, microbatches: int,
           experts: int) -> RankResult:
    """Time ``torch.distributed.pipelining``'s ``kind`` schedule on this layout; the losses are the global mean
    per step on the group holding the last stage, nan elsewhere."""
    sched, dense, expert, ep_group, ids, model = build(rank, spec, groups, kind, microbatches, experts)
    opt = peer_adamw([*dense, *expert], spec.lr)
    batches = global_batches(model, spec, len(groups[0]) * spec.batch)
    _, j = position(rank, groups)
    first, last = 0 in ids, 2 * len(groups) - 1 in ids
    replicas = len(groups[0])

    def step(i: int) -> torch.Tensor | None:
        x, y = batches[i]
        x, y = x[j * spec.batch:(j + 1) * spec.batch], y[j * spec.batch:(j + 1) * spec.batch]
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": y, "losses": losses, "return_outputs": False} if last else \
            {"return_outputs": False}
        sched.step(x, **kwargs) if first else sched.step(**kwargs)
        sync_grads(dense, expert, 1.0 / (replicas * microbatches), ep_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not last:
            return None
        loss = torch.stack([t.detach() for t in losses]).mean()
        dist.all_reduce(loss, group=ep_group)
        return loss / replicas

    return timed_loop(step, spec)
