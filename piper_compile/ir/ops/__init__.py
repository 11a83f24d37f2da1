"""Typed DAG operations, one module per family, each class holding all of its rules (``base.py``).

``OPS`` registers every op by its text-form name: adding an op is a class in its family's module (or a
new module) plus one entry here."""
from __future__ import annotations

from typing import Any

from piper_compile.ir.ops.base import LOSS, GroupKey, Op, QueueKey
from piper_compile.ir.ops.compute import ExpertStep, Local, Segment, SequenceChunk
from piper_compile.ir.ops.expert import ExpertA2A, ExpertCounts
from piper_compile.ir.ops.grad import GradReduce, LossReduce, NormReduce, Update
from piper_compile.ir.ops.p2p import Recv, RecvPart, Send, p2p_channel
from piper_compile.ir.ops.params import ParamGather
from piper_compile.ir.ops.tensor_parallel import TpCollective

OPS: dict[str, type[Op]] = {cls.NAME: cls for cls in (
    Segment, ExpertStep, SequenceChunk, Send, Recv, RecvPart, GradReduce, LossReduce, NormReduce, Update, ParamGather,
    TpCollective, ExpertCounts, ExpertA2A)}


def op_from_fields(name: str, fields: dict[str, Any]) -> Op:
    """The op of text-form name ``name`` from its (JSON) fields; lists become tuples."""
    def tup(x: Any) -> Any:
        return tuple(tup(v) for v in x) if isinstance(x, list) else x

    return OPS[name](**{k: tup(v) for k, v in fields.items()})


__all__ = ["LOSS", "OPS", "ExpertA2A", "ExpertCounts", "ExpertStep", "GradReduce", "GroupKey", "Local", "LossReduce",
           "NormReduce", "Op", "ParamGather", "QueueKey", "Recv", "RecvPart", "Segment", "Send", "SequenceChunk", "TpCollective",
           "Update", "op_from_fields", "p2p_channel"]
