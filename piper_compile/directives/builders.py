"""Python builders for directives. Each returns the plain JSON dict (or a list of them), so a strategy
written in Python and one loaded from JSON are the same thing."""
from __future__ import annotations

from typing import Any, Sequence

from piper_compile.errors import PiperDirectiveError

Filter = dict[str, Any]


def place(filter: Filter, devices: Sequence[int], stream: str | None = None) -> dict[str, Any]:
    """Put the regions matched by ``filter`` on the device group ``devices``."""
    d: dict[str, Any] = {"op": "place", "filter": dict(filter), "devices": list(devices)}
    if stream is not None:
        d["stream"] = stream
    return d


def split(microbatches: int, filter: Filter | None = None, dim_name: str = "MB") -> dict[str, Any]:
    """Split the local batch (dim 0) into ``microbatches`` micro-batches tagged ``dim_name``."""
    return {"op": "split", "filter": dict(filter or {}), "dim_name": dim_name, "num_microbatches": microbatches}


def replicate(filter: Filter | None = None, devices: Sequence[int] | None = None, *, zero: int = 0,
              bucket_mb: float = 25.0, reduce_stream: str = "dp", gather_stream: str = "dp_gather",
              prefetch: int = 1, reduce_per_microbatch: bool = False) -> dict[str, Any]:
    """Data-parallel replicas of the matched regions over their device group.

    ``zero``: 0 all-reduces gradients; 1 shards the optimizer (each rank updates its shard of a flat
    fp32 buffer per bucket, then parameters are all-gathered); 2 also reduce-scatters gradients; 3 also
    keeps parameters only as shards, all-gathered before each use (``prefetch`` compute steps ahead) and
    freed after it. ``reduce_per_microbatch`` (ZeRO-2/3) reduce-scatters every micro-batch's gradients
    instead of once per step: more communication, but no full gradient bucket lives across micro-batches."""
    d: dict[str, Any] = {"op": "replicate", "filter": dict(filter or {}), "zero": zero, "bucket_size": bucket_mb,
                         "reduce_stream": reduce_stream, "gather_stream": gather_stream, "prefetch": prefetch}
    if reduce_per_microbatch:
        d["reduce_per_microbatch"] = True
    if devices is not None:
        d["devices"] = list(devices)
    return d


def shard(filter: Filter | None = None, devices: Sequence[int] | None = None, stream: str = "ep",
          load: float = 1.0) -> dict[str, Any]:
    """Expert parallelism over ``devices`` (default: the ranks the matched regions run on) for the MoE
    layers (:class:`piper_compile.nn.MoE` / ``moe_experts``) in the matched regions: each rank keeps
    ``E / len(devices)`` experts; tokens travel to their experts and back by all-to-all on ``stream``.
    ``load``: how many rows the busiest rank receives relative to balanced routing (1.0; at most the
    group's size): the memory plan and the simulator size the rows an experts' rank receives, holds and
    computes on by it. The runtime measures it (``piper.stats(step).expert_load``) and logs a warning
    when a step exceeds it by more than 10%."""
    d: dict[str, Any] = {"op": "shard", "filter": dict(filter or {}), "stream": stream}
    if devices is not None:
        d["devices"] = list(devices)
    if load != 1.0:
        d["load"] = load
    return d


def shard_tensor(params: dict[str, str], filter: Filter | None = None,
                 devices: Sequence[int] | Sequence[Sequence[int]] | None = None, stream: str = "tp",
                 sequence_parallel: bool = False, seq_dim: int = 1) -> dict[str, Any]:
    """Tensor parallelism: ``params`` maps module-name globs of ``nn.Linear`` layers to ``colwise`` (output
    features split; ``colwise:N`` for N fused blocks like qkv), or ``rowwise`` (input features split, the
    partial outputs all-reduced). ``devices``: the tensor-parallel groups (default: the regions' group);
    ranks of one group receive the same batch. Reshapes after a colwise layer must infer the head count
    (``view(b, t, -1, head_dim)``). ``sequence_parallel``: activations outside the sharded layers
    (norms, residual adds) are split along ``seq_dim`` across the group (Megatron sequence parallelism:
    reduce-scatter after row-parallel layers, all-gather before column-parallel ones)."""
    d: dict[str, Any] = {"op": "shard_tensor", "filter": dict(filter or {}), "params": dict(params), "stream": stream}
    if sequence_parallel:
        d.update(sequence_parallel=True, seq_dim=seq_dim)
    if devices is not None:
        d["devices"] = [list(g) for g in devices] if devices and not isinstance(devices[0], int) else list(devices)
    return d


def checkpoint(filter: Filter | None = None, policy: str | dict[str, Any] = "full") -> dict[str, Any]:
    """Activation checkpointing of the matched regions: their forward values are recomputed in the backward
    instead of kept from the forward. ``policy``: ``"full"`` keeps only each region's inputs;
    ``"selective"`` also keeps matmul and attention outputs (recomputes norms, activations, residuals);
    ``{"save": [aten op names]}`` keeps those ops' outputs; ``{"budget_mb": N}`` keeps the values that are dearest to
    recompute per byte while the matched regions of one stage keep at most N MB (per micro-batch times the
    micro-batches in flight on that stage). Random ops are never run
    again: dropout's backward replays the mask the forward drew."""
    return {"op": "checkpoint", "filter": dict(filter or {}), "policy": policy}


def order(*groups: Filter | Sequence[Filter]) -> dict[str, Any]:
    """Order edges between consecutive groups; a group of several filters is an overlap slot."""
    return {"op": "order", "filters": [[dict(g)] if isinstance(g, dict) else [dict(f) for f in g] for g in groups]}


def pipeline(stages: int, ranks: Sequence[int | Sequence[int]] | None = None, tag: str = "PP",
             stream: str | None = None) -> list[dict[str, Any]]:
    """Place ``tag``=s on ``ranks[s]`` for every stage s (default: stage s on rank s)."""
    if stages < 1:
        raise PiperDirectiveError(None, {"pipeline": stages}, f"stages must be >= 1, got {stages}", "use stages>=1")
    ranks = list(range(stages)) if ranks is None else list(ranks)
    if len(ranks) != stages:
        raise PiperDirectiveError(None, {"pipeline": stages, "ranks": ranks},
                                  f"{len(ranks)} rank groups given for {stages} stages", "give one group per stage")
    return [place({tag: s}, [r] if isinstance(r, int) else list(r), stream) for s, r in enumerate(ranks)]
