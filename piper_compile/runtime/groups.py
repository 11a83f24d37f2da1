"""Process groups, one per (stream name, device group), created in the same order on every rank from
the global DAG -- so streams do not serialise one another (on CPU: separate gloo contexts; on CUDA:
separate NCCL communicators, each with its own CUDA stream)."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from piper_compile.ir.dag import TrainingDAG


def world_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def group_keys(dag: TrainingDAG, world_size: int) -> list[tuple[str, tuple[int, ...]]]:
    keys: set[tuple[str, tuple[int, ...]]] = set()
    for n in dag:
        if n.kind.is_collective:
            for g in n.attr("subgroups") or (n.devices,):  # tensor parallel: each rank's own subgroup
                keys.add((n.stream, tuple(sorted(g))))
        elif n.kind.is_comm:  # point-to-point: one group per direction (see Instr.group_name)
            keys.add((f"{n.stream}:up", tuple(range(world_size))))
            keys.add((f"{n.stream}:down", tuple(range(world_size))))
    return sorted(keys)


_GROUPS: dict[tuple[str, tuple[int, ...], str], Any] = {}
_OWNER: list[Any] = [None]  # the default process group the cached groups belong to


class GroupRegistry:
    """Lazily shared process groups keyed by (stream, ranks). Creation is collective: every rank calls
    ``ensure`` with the same keys in the same order (the keys come from the global DAG)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = timedelta(seconds=timeout_s)

    def ensure(self, keys: list[tuple[str, tuple[int, ...]]]) -> None:
        if _OWNER[0] is not dist.group.WORLD:  # a new world (re-initialised in this process)
            _GROUPS.clear()
            _OWNER[0] = dist.group.WORLD
        backend = dist.get_backend()
        for stream, ranks in keys:
            key = (stream, ranks, backend)
            if key not in _GROUPS:
                _GROUPS[key] = dist.new_group(list(ranks), timeout=self.timeout, backend=backend,
                                              group_desc=f"piper:{stream}:{'_'.join(map(str, ranks))}")

    def get(self, stream: str, ranks: tuple[int, ...]) -> Any:
        return _GROUPS[(stream, tuple(sorted(ranks)), dist.get_backend())]
