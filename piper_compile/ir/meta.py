"""What a training DAG records beyond its nodes: the facts passes leave for later passes, the runtime and
the simulator (how the step is split, which order edges a directive drew, the ZeRO, expert and
tensor-parallel layouts, who holds the loss). Typed, and printed and parsed with the DAG (one ``META``
line of JSON), so a pass can run on a DAG read from text.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

Ranks = tuple[int, ...]


@dataclass
class ZeroGroup:
    """The ZeRO settings and shard buckets of one replicated device group."""

    devices: Ranks
    level: int
    gather_stream: str
    prefetch: int
    per_microbatch: bool = False  # reduce-scatter after every micro-batch (ZeRO-2/3)
    buckets: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (bucket name, fqns)
    whole: list[str] = field(default_factory=list)  # params of the group kept unsharded (tied)
    # tensor parallel: the data-parallel subgroups, each sharding its own copy of the buckets (whose split
    # layers are that position's pieces); None: the whole group shards them
    subgroups: tuple[Ranks, ...] | None = None

    def bucket_of(self) -> dict[str, str]:
        return {f: b for b, fqns in self.buckets for f in fqns}


@dataclass(frozen=True)
class ExpertShard:
    """An expert weight split over ``group`` (each rank holds ``experts / len(group)`` of them)."""

    group: Ranks
    experts: int
    stream: str


@dataclass(frozen=True)
class TensorParallelSpec:
    """The ``shard_tensor`` directive: its index, its tensor-parallel groups (None: each region's whole
    group) and its stream."""

    index: int
    groups: tuple[Ranks, ...] | None
    stream: str


@dataclass(frozen=True)
class PrecisionMeta:
    """``options["mixed_precision"]`` as the simulator needs it (dtype names): ``master`` is what the
    parameters, their gradient buffers and optimizer state are kept in; ``compute`` what the graph
    computes with (the compute copies, ZeRO-3 gathers); ``reduce`` what gradients are reduced in."""

    master: str
    compute: str
    reduce: str


@dataclass
class DagMeta:
    """A DAG's record of the step's layout (see the module docstring). ``None`` / empty: not decided yet
    (e.g. ``split`` before the split pass, ``zero`` before the ZeRO layout is first asked for)."""

    split: int | None = None  # micro-batches per step
    mb_tag: str = "MB"  # the tag that numbers micro-batches
    split_by: int | None = None  # index of the split directive (-1: the implicit split(1))
    order_by: dict[tuple[str, str], int] = field(default_factory=dict)  # order edge -> the order directive's index
    tp: TensorParallelSpec | None = None
    tp_size: int = 1  # ranks per tensor-parallel group (1: no tensor parallelism)
    ep_params: dict[str, ExpertShard] = field(default_factory=dict)  # expert weight fqn -> its shard
    loss_group: Ranks = ()  # the ranks whose compute produces the loss
    zero: dict[Ranks, ZeroGroup] | None = None  # ZeRO groups (computed once, on first use)
    precision: PrecisionMeta | None = None  # mixed precision (None: parameters compute in their own dtype)
    # how segments run (the memory plan counts what Inductor's code stores); not the layout, so not text
    codegen: str = field(default="inductor", metadata={"text": False})

    def copy(self) -> "DagMeta":
        """A copy whose dicts can change without changing this one's."""
        return dataclasses.replace(self, order_by=dict(self.order_by), ep_params=dict(self.ep_params),
                                   zero=None if self.zero is None else dict(self.zero))

    def to_text(self) -> str:
        """``META {...}``: the fields that differ from a fresh DAG's, as JSON."""
        d: dict[str, Any] = {}
        fresh = DagMeta()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != getattr(fresh, f.name) and f.metadata.get("text", True):
                d[f.name] = _ENCODE.get(f.name, _plain)(value)
        return "META " + json.dumps(d, separators=(",", ":"))


def parse_meta(line: str) -> DagMeta:
    """Inverse of ``DagMeta.to_text``."""
    assert line.startswith("META "), line
    d = json.loads(line[len("META "):])
    return DagMeta(**{k: _DECODE.get(k, tuplify)(v) for k, v in d.items()})


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def tuplify(x: Any) -> Any:
    """JSON lists back to the tuples the DAG keeps."""
    if isinstance(x, list):
        return tuple(tuplify(v) for v in x)
    return x


def _zero_group(d: dict[str, Any]) -> ZeroGroup:
    return ZeroGroup(**{**{k: tuplify(v) for k, v in d.items()},
                        "buckets": [(b, tuple(fqns)) for b, fqns in d["buckets"]], "whole": list(d["whole"])})


_ENCODE = {
    "order_by": lambda m: [[a, b, i] for (a, b), i in sorted(m.items())],
    "ep_params": lambda m: {f: _plain(s) for f, s in sorted(m.items())},
    "zero": lambda m: None if m is None else [_plain(z) for _, z in sorted(m.items())],
}
_DECODE = {
    "order_by": lambda v: {(a, b): i for a, b, i in v},
    "ep_params": lambda v: {f: ExpertShard(tuple(s["group"]), s["experts"], s["stream"]) for f, s in v.items()},
    "tp": lambda v: None if v is None else TensorParallelSpec(v["index"], tuplify(v["groups"]), v["stream"]),
    "zero": lambda v: None if v is None else {tuple(z["devices"]): _zero_group(z) for z in v},
    "precision": lambda v: None if v is None else PrecisionMeta(**v),
}
