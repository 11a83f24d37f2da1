"""Node kinds of the training DAG (each typed op in ``ir/ops`` says which kind it is)."""
from __future__ import annotations

from enum import Enum


class Kind(Enum):
    """COMPUTE runs on the rank's host/compute stream; the others move or reduce tensors asynchronously,
    except UPDATE (the optimizer step)."""

    COMPUTE = "COMPUTE"
    SEND = "SEND"
    RECV = "RECV"
    ALL_REDUCE = "ALL_REDUCE"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    ALL_GATHER = "ALL_GATHER"
    ALL_TO_ALL = "ALL_TO_ALL"
    UPDATE = "UPDATE"

    @property
    def is_comm(self) -> bool:
        return self in _COMM_KINDS

    @property
    def is_collective(self) -> bool:
        return self in _COLLECTIVE_KINDS


_COLLECTIVE_KINDS = frozenset({Kind.ALL_REDUCE, Kind.REDUCE_SCATTER, Kind.ALL_GATHER, Kind.ALL_TO_ALL})
_COMM_KINDS = _COLLECTIVE_KINDS | {Kind.SEND, Kind.RECV}
