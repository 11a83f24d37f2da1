"""Directive records and their JSON vocabulary (the prototype's: ``{"op": "place", "filter": {...}}``).

``parse_directives`` accepts a list of dicts, a path to a JSON file, or builder objects, validates
every field and returns typed records. Each error is a ``PiperDirectiveError`` that names the
directive's index and JSON, what is wrong and how to fix it.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from piper_compile.errors import PiperDirectiveError

ANY = "*"
PASSES = ("F", "B", "BI", "BW")
Filter = dict[str, Any]


@dataclass(frozen=True)
class Directive:
    """Base of all directive records; ``index``/``raw`` locate it in the user's list for errors."""

    index: int = field(default=-1, compare=False)
    raw: Any = field(default=None, compare=False, repr=False)

    def error(self, problem: str, fix: str) -> PiperDirectiveError:
        return PiperDirectiveError(self.index, self.raw if self.raw is not None else self.to_json(), problem, fix)

    def to_json(self) -> dict[str, Any]:  # pragma: no cover - overridden
        raise NotImplementedError


@dataclass(frozen=True)
class Place(Directive):
    filter: Filter = field(default_factory=dict)
    devices: tuple[int, ...] = ()
    stream: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": "place", "filter": dict(self.filter), "devices": list(self.devices)}
        if self.stream is not None:
            d["stream"] = self.stream
        return d


@dataclass(frozen=True)
class Split(Directive):
    filter: Filter = field(default_factory=dict)
    num_microbatches: int = 1
    dim_name: str = "MB"
    dim: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"op": "split", "filter": dict(self.filter), "dim_name": self.dim_name,
                "num_microbatches": self.num_microbatches, "dim": self.dim}


@dataclass(frozen=True)
class Replicate(Directive):
    filter: Filter = field(default_factory=dict)
    devices: tuple[int, ...] | None = None
    reduce_stream: str = "dp"
    gather_stream: str = "dp_gather"
    bucket_size: float = 25.0  # MB
    zero: int = 0
    prefetch: int = 1  # ZeRO-3: how many compute steps ahead a parameter all-gather is issued
    reduce_per_microbatch: bool = False  # ZeRO-2/3: reduce-scatter after every micro-batch's backward

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": "replicate", "filter": dict(self.filter), "reduce_stream": self.reduce_stream,
                             "gather_stream": self.gather_stream, "bucket_size": self.bucket_size,
                             "zero": self.zero, "prefetch": self.prefetch,
                             "reduce_per_microbatch": self.reduce_per_microbatch}
        if self.devices is not None:
            d["devices"] = list(self.devices)
        return d


@dataclass(frozen=True)
class Order(Directive):
    filters: tuple[tuple[Filter, ...], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"op": "order", "filters": [[dict(f) for f in g] for g in self.filters]}


@dataclass(frozen=True)
class Shard(Directive):
    """Expert parallelism: the experts of the matched regions' MoE ops are split across ``devices`` (each
    rank holds ``E / len(devices)`` of them) and tokens are routed to their expert's rank by all-to-all."""

    filter: Filter = field(default_factory=dict)
    devices: tuple[int, ...] | None = None  # default: the device group the regions run on
    stream: str = "ep"
    load: float = 1.0  # rows the busiest rank receives, relative to balanced routing (the plan's sizes)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": "shard", "filter": dict(self.filter), "stream": self.stream}
        if self.devices is not None:
            d["devices"] = list(self.devices)
        if self.load != 1.0:
            d["load"] = self.load
        return d


SHARDINGS = ("colwise", "rowwise")


@dataclass(frozen=True)
class ShardTensor(Directive):
    """Tensor parallelism (Megatron): linear layers whose module name matches a key of ``params`` are
    split column-wise (output features; ``colwise:N`` for N fused equal blocks such as qkv) or row-wise
    (input features, followed by an all-reduce) over each tensor-parallel group in ``devices``.
    ``sequence_parallel``: between the sharded layers, activations are split along ``seq_dim`` (the
    all-reduce becomes a reduce-scatter, the input of a column-parallel layer an all-gather)."""

    filter: Filter = field(default_factory=dict)
    devices: tuple[tuple[int, ...], ...] | None = None  # TP groups; default: the regions' device group
    params: tuple[tuple[str, str], ...] = ()  # (module-name glob, colwise | colwise:N | rowwise)
    stream: str = "tp"
    sequence_parallel: bool = False
    seq_dim: int = 1

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": "shard_tensor", "filter": dict(self.filter), "params": dict(self.params),
                             "stream": self.stream}
        if self.sequence_parallel:
            d.update(sequence_parallel=True, seq_dim=self.seq_dim)
        if self.devices is not None:
            d["devices"] = [list(g) for g in self.devices]
        return d


CHECKPOINT_POLICIES = ("full", "selective")


@dataclass(frozen=True)
class Checkpoint(Directive):
    """Activation checkpointing: the forward values of the matched regions are recomputed in their backward
    instead of kept. ``policy``: ``full`` keeps only each region's inputs; ``selective`` also keeps matmul
    and attention outputs; ``save`` keeps the outputs of the named aten ops; ``budget_mb`` keeps, per
    region and micro-batch, the values that are dearest to recompute per byte within that many MB."""

    filter: Filter = field(default_factory=dict)
    policy: str = "full"  # full | selective | save | budget
    save: tuple[str, ...] = ()
    budget_mb: float | None = None

    def to_json(self) -> dict[str, Any]:
        policy: Any = self.policy
        if self.policy == "save":
            policy = {"save": list(self.save)}
        elif self.policy == "budget":
            policy = {"budget_mb": self.budget_mb}
        return {"op": "checkpoint", "filter": dict(self.filter), "policy": policy}


_KNOWN = {"place": Place, "split": Split, "replicate": Replicate, "order": Order, "shard": Shard,
          "shard_tensor": ShardTensor, "checkpoint": Checkpoint}
_FUTURE = {"stream"}


def _check_type(i: int, raw: dict, key: str, types: tuple[type, ...], what: str) -> Any:
    value = raw[key]
    if isinstance(value, bool) and bool not in types:
        raise PiperDirectiveError(i, raw, f"field {key!r} must be {what}, got {value!r} ({type(value).__name__})",
                                  f"write {key!r} as {what}")
    if not isinstance(value, types):
        raise PiperDirectiveError(i, raw, f"field {key!r} must be {what}, got {value!r} ({type(value).__name__})",
                                  f"write {key!r} as {what}")
    return value


def _filter(i: int, raw: dict, value: Any, where: str = "filter") -> Filter:
    if not isinstance(value, dict):
        raise PiperDirectiveError(i, raw, f"{where} must be a JSON object of tag -> index, got {value!r}",
                                  'write it like {"PP": 0} or {"PP": "*"}')
    out: Filter = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise PiperDirectiveError(i, raw, f"{where} key {k!r} is not a string", "use tag names as keys")
        if k == "PASS":
            if v not in PASSES and v != ANY:
                raise PiperDirectiveError(i, raw, f"{where} has PASS={v!r}", f"use one of {list(PASSES)} or '*'")
        elif isinstance(v, bool) or not isinstance(v, (int, str)):
            raise PiperDirectiveError(i, raw, f"{where} value for tag {k!r} must be an int or '*', got {v!r}",
                                      f'write {{"{k}": 0}} or {{"{k}": "*"}}')
        elif isinstance(v, str) and v != ANY:
            v = int(v) if v.lstrip("-").isdigit() else v
        out[k] = v
    return out


def _devices(i: int, raw: dict, key: str = "devices") -> tuple[int, ...]:
    devs = raw[key]
    if not isinstance(devs, list) or not devs or not all(isinstance(d, int) and not isinstance(d, bool) for d in devs):
        raise PiperDirectiveError(i, raw, f"field {key!r} must be a non-empty list of rank numbers, got {devs!r}",
                                  f'write e.g. "{key}": [0, 1]')
    if len(set(devs)) != len(devs):
        raise PiperDirectiveError(i, raw, f"field {key!r} lists a rank twice: {devs}", "list each rank once")
    if min(devs) < 0:
        raise PiperDirectiveError(i, raw, f"field {key!r} has a negative rank: {devs}", "ranks start at 0")
    return tuple(devs)


def _allowed(i: int, raw: dict, keys: set[str]) -> None:
    extra = set(raw) - keys - {"op"}
    if extra:
        raise PiperDirectiveError(i, raw, f"unknown field(s) {sorted(extra)} for op {raw['op']!r}",
                                  f"use only {sorted(keys)}")


def _parse_place(i: int, raw: dict) -> Place:
    _allowed(i, raw, {"filter", "devices", "device", "stream"})
    if "devices" not in raw and "device" in raw:
        raw = {**raw, "devices": raw["device"] if isinstance(raw["device"], list) else [raw["device"]]}
    if "devices" not in raw:
        raise PiperDirectiveError(i, raw, "place needs 'devices'", 'add "devices": [rank, ...]')
    stream = _check_type(i, raw, "stream", (str,), "a string") if raw.get("stream") is not None else None
    return Place(index=i, raw=raw, filter=_filter(i, raw, raw.get("filter", {})), devices=_devices(i, raw),
                 stream=stream)


def _parse_split(i: int, raw: dict) -> Split:
    _allowed(i, raw, {"filter", "num_microbatches", "dim_name", "dim"})
    if "num_microbatches" not in raw:
        raise PiperDirectiveError(i, raw, "split needs 'num_microbatches'", 'add "num_microbatches": 4')
    m = _check_type(i, raw, "num_microbatches", (int,), "a positive int")
    if m < 1:
        raise PiperDirectiveError(i, raw, f"num_microbatches must be >= 1, got {m}", "use a positive count")
    dim = _check_type(i, raw, "dim", (int,), "an int") if "dim" in raw else 0
    if dim != 0:
        raise PiperDirectiveError(i, raw, f"split along dim {dim} is not supported", "split the batch along dim 0")
    name = _check_type(i, raw, "dim_name", (str,), "a string") if "dim_name" in raw else "MB"
    return Split(index=i, raw=raw, filter=_filter(i, raw, raw.get("filter", {})), num_microbatches=m,
                 dim_name=name, dim=dim)


def _parse_replicate(i: int, raw: dict) -> Replicate:
    _allowed(i, raw, {"filter", "devices", "reduce_stream", "gather_stream", "bucket_size", "bucket_mb", "zero",
                      "shard_grads", "shard_params", "prefetch",
                      "reduce_per_microbatch"})
    zero = _check_type(i, raw, "zero", (int,), "0, 1, 2 or 3") if "zero" in raw else 0
    if raw.get("shard_params"):
        zero = max(zero, 3)
    elif raw.get("shard_grads"):
        zero = max(zero, 2)
    if zero not in (0, 1, 2, 3):
        raise PiperDirectiveError(i, raw, f"zero must be 0, 1, 2 or 3, got {zero}", "pick a ZeRO stage 0-3")
    prefetch = _check_type(i, raw, "prefetch", (int,), "a number of compute steps") if "prefetch" in raw else 1
    if prefetch < 0:
        raise PiperDirectiveError(i, raw, f"prefetch must be >= 0, got {prefetch}",
                                  "use 0 (gather just before use) or 1-2 (overlap the gather with compute)")
    per_mb = _check_type(i, raw, "reduce_per_microbatch", (bool,), "true or false") \
        if "reduce_per_microbatch" in raw else False
    if per_mb and zero < 2:
        raise PiperDirectiveError(i, raw, f"reduce_per_microbatch reduce-scatters into gradient shards, which needs "
                                  f"zero >= 2 (got zero={zero})", "use zero=2 or zero=3, or drop reduce_per_microbatch")
    bkey = "bucket_size" if "bucket_size" in raw else "bucket_mb"
    bucket = float(_check_type(i, raw, bkey, (int, float), "a size in MB")) if bkey in raw else 25.0
    if bucket <= 0:
        raise PiperDirectiveError(i, raw, f"{bkey} must be > 0 MB, got {bucket}", "use e.g. 25")
    devices = _devices(i, raw) if raw.get("devices") is not None else None
    streams = {k: _check_type(i, raw, k, (str,), "a string") for k in ("reduce_stream", "gather_stream") if k in raw}
    return Replicate(index=i, raw=raw, filter=_filter(i, raw, raw.get("filter", {})), devices=devices,
                     bucket_size=bucket, zero=zero, prefetch=prefetch, reduce_per_microbatch=per_mb, **streams)


def _parse_order(i: int, raw: dict) -> Order:
    _allowed(i, raw, {"filters"})
    groups = raw.get("filters")
    if not isinstance(groups, list) or len(groups) < 1:
        raise PiperDirectiveError(i, raw, "order needs 'filters': a list of groups of filters",
                                  'write "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [...]]')
    out: list[tuple[Filter, ...]] = []
    for gi, group in enumerate(groups):
        if isinstance(group, dict):
            group = [group]
        if not isinstance(group, list) or not group:
            raise PiperDirectiveError(i, raw, f"filters[{gi}] must be a non-empty list of filters, got {group!r}",
                                      "wrap each step in a list: [[{...}], [{...}]]")
        out.append(tuple(_filter(i, raw, f, where=f"filters[{gi}]") for f in group))
    return Order(index=i, raw=raw, filters=tuple(out))


def _parse_shard(i: int, raw: dict) -> Shard:
    _allowed(i, raw, {"filter", "devices", "stream", "load"})
    devices = _devices(i, raw) if raw.get("devices") is not None else None
    stream = _check_type(i, raw, "stream", (str,), "a string") if raw.get("stream") is not None else "ep"
    load = float(_check_type(i, raw, "load", (int, float), "a number >= 1")) if raw.get("load") is not None else 1.0
    if not (math.isfinite(load) and load >= 1.0):
        raise PiperDirectiveError(i, raw, f"field 'load' is the rows the busiest rank receives relative to balanced "
                                  f"routing, so at least 1; got {raw['load']!r}",
                                  "leave it out for balanced routing, or give the measured skew "
                                  "(piper.stats(step).expert_load), e.g. 1.5")
    return Shard(index=i, raw=raw, filter=_filter(i, raw, raw.get("filter", {})), devices=devices, stream=stream,
                 load=load)


def _parse_shard_tensor(i: int, raw: dict) -> ShardTensor:
    _allowed(i, raw, {"filter", "devices", "params", "stream", "sequence_parallel", "seq_dim"})
    params = raw.get("params")
    if not isinstance(params, dict) or not params:
        raise PiperDirectiveError(i, raw, "shard_tensor needs 'params': module name -> colwise | rowwise",
                                  'write e.g. "params": {"blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}')
    for name, kind in params.items():
        base, _, n = str(kind).partition(":")
        if not isinstance(kind, str) or base not in SHARDINGS or (n and (not n.isdigit() or int(n) < 1)) \
                or (n and base != "colwise"):
            raise PiperDirectiveError(i, raw, f"params[{name!r}] is {kind!r}",
                                      "use 'colwise', 'rowwise', or 'colwise:N' for N fused blocks (e.g. qkv: 3)")
    devices = None
    raw_devs = raw.get("devices")
    if raw_devs is not None:
        groups = raw_devs if raw_devs and all(isinstance(g, list) for g in raw_devs) else [raw_devs]
        devices = tuple(_devices(i, {**raw, "devices": g}) for g in groups)
        flat = [r for g in devices for r in g]
        if len(set(flat)) != len(flat) or len({len(g) for g in devices}) != 1:
            raise PiperDirectiveError(i, raw, f"devices {raw_devs} must be disjoint tensor-parallel groups of one size",
                                      'write e.g. "devices": [[0, 1], [2, 3]]')
    stream = _check_type(i, raw, "stream", (str,), "a string") if raw.get("stream") is not None else "tp"
    sp = _check_type(i, raw, "sequence_parallel", (bool,), "true or false") if "sequence_parallel" in raw else False
    seq_dim = _check_type(i, raw, "seq_dim", (int,), "an int") if "seq_dim" in raw else 1
    if seq_dim < 0:
        raise PiperDirectiveError(i, raw, f"seq_dim must be >= 0 (counted from the front of the activations' "
                                  f"shape), got {seq_dim}", 'write e.g. "seq_dim": 1 for [batch, seq, hidden]')
    return ShardTensor(index=i, raw=raw, filter=_filter(i, raw, raw.get("filter", {})), devices=devices,
                       params=tuple(sorted(params.items())), stream=stream, sequence_parallel=sp, seq_dim=seq_dim)


def _parse_checkpoint(i: int, raw: dict) -> Checkpoint:
    _allowed(i, raw, {"filter", "policy"})
    flt = _filter(i, raw, raw.get("filter", {}))
    if "PASS" in flt:
        raise PiperDirectiveError(i, raw, "a checkpoint filter names regions, not passes (it has 'PASS')",
                                  "drop 'PASS': the matched regions' forward values are recomputed in their backward")
    policy = raw.get("policy", "full")
    fix = ('use "full", "selective", {"save": ["mm", "addmm", ...]} (aten op names) or {"budget_mb": N}')
    if isinstance(policy, str):
        if policy not in CHECKPOINT_POLICIES:
            raise PiperDirectiveError(i, raw, f"unknown checkpoint policy {policy!r}", fix)
        return Checkpoint(index=i, raw=raw, filter=flt, policy=policy)
    if not isinstance(policy, dict) or len(policy) != 1 or next(iter(policy)) not in ("save", "budget_mb"):
        raise PiperDirectiveError(i, raw, f"checkpoint policy must be a string or an object with one key 'save' or "
                                  f"'budget_mb', got {policy!r}", fix)
    if "save" in policy:
        names = policy["save"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise PiperDirectiveError(i, raw, f"policy 'save' must be a non-empty list of aten op names, got {names!r}",
                                      'write e.g. {"save": ["mm", "addmm", "_scaled_dot_product_flash_attention"]}')
        return Checkpoint(index=i, raw=raw, filter=flt, policy="save", save=tuple(dict.fromkeys(names)))
    budget = policy["budget_mb"]
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise PiperDirectiveError(i, raw, f"policy 'budget_mb' must be a positive number of MB, got {budget!r}",
                                  'write e.g. {"budget_mb": 512}')
    return Checkpoint(index=i, raw=raw, filter=flt, policy="budget", budget_mb=float(budget))


_PARSERS = {"checkpoint": _parse_checkpoint, "place": _parse_place, "split": _parse_split, "replicate": _parse_replicate, "order": _parse_order,
            "shard": _parse_shard, "shard_tensor": _parse_shard_tensor}


def parse_directive(i: int, raw: Any) -> Directive:
    """Validate one directive (dict or record) and return its typed record."""
    if isinstance(raw, Directive):
        raw = raw.to_json()
    if hasattr(raw, "to_json") and not isinstance(raw, dict):
        raw = raw.to_json()
    if not isinstance(raw, dict):
        raise PiperDirectiveError(i, raw, f"a directive must be a JSON object, got {type(raw).__name__}",
                                  'write {"op": "place", ...}')
    op = raw.get("op")
    if not isinstance(op, str):
        raise PiperDirectiveError(i, raw, f"'op' must be a string, got {op!r} ({type(op).__name__})",
                                  f"use one of {sorted(_KNOWN)}")
    if op in _FUTURE:
        raise PiperDirectiveError(i, raw, f"op {op!r} is not built yet", f"use one of {sorted(_KNOWN)}")
    if op not in _PARSERS:
        raise PiperDirectiveError(i, raw, f"unknown op {op!r}", f"use one of {sorted(_KNOWN)}")
    return _PARSERS[op](i, dict(raw))


def load_directives(source: Any) -> list[Any]:
    """Accept a list (of dicts or builders), a JSON string/path, or None."""
    if source is None:
        return []
    if isinstance(source, (str, os.PathLike)):
        text = str(source)
        if os.path.exists(text):
            with open(text) as f:
                try:
                    source = json.load(f)
                except json.JSONDecodeError as e:
                    raise PiperDirectiveError(None, text, f"the file is not valid JSON ({e})",
                                              "fix the JSON syntax") from None
        else:
            try:
                source = json.loads(text)
            except json.JSONDecodeError:
                raise PiperDirectiveError(None, text, "is neither an existing JSON file nor JSON text",
                                          "pass a list of directives or the path of a JSON file") from None
    if isinstance(source, dict) and "directives" in source:
        source = source["directives"]
    if not isinstance(source, (list, tuple)):
        raise PiperDirectiveError(None, source, f"directives must be a list, got {type(source).__name__}",
                                  "pass a list of directive dicts")
    flat: list[Any] = []
    for item in source:
        if isinstance(item, (list, tuple)):
            flat.extend(item)
        else:
            flat.append(item)
    return flat


def parse_directives(source: Any) -> list[Directive]:
    return [parse_directive(i, raw) for i, raw in enumerate(load_directives(source))]


def filter_matches(flt: Filter, tags: dict[str, Any]) -> bool:
    """A filter matches when every key is present with an equal value ("*" = any value).
    ``PASS: "B"`` also matches the two halves of a split backward (BI and BW)."""
    for k, v in flt.items():
        if k not in tags:
            return False
        if v == ANY or tags[k] == v:
            continue
        if k == "PASS" and v == "B" and tags[k] in ("BI", "BW"):
            continue
        return False
    return True


def split_backward_filters(directives: Iterable[Directive]) -> list[Filter]:
    """Filters (without PASS and the micro-batch tag) of every order step that names BI or BW: the
    regions they match get their backward split into BI and BW at capture."""
    mb_tags = {d.dim_name for d in directives if isinstance(d, Split)} | {"MB"}
    out: list[Filter] = []
    for d in directives:
        if isinstance(d, Order):
            for group in d.filters:
                for f in group:
                    if f.get("PASS") in ("BI", "BW"):
                        base = {k: v for k, v in f.items() if k != "PASS" and k not in mb_tags}
                        if base not in out:
                            out.append(base)
    return out


def checkpoint_of(directives: list[Checkpoint]) -> Callable[[Any], Checkpoint | None] | None:
    """A region's checkpoint directive (None when none matches it; None overall without any). Two
    directives with different policies matching one region conflict: a ``piper:`` error."""
    if not directives:
        return None

    def of(region: Any) -> Checkpoint | None:
        found = [d for d in directives if filter_matches(d.filter, dict(region))]
        policies = {json.dumps(d.to_json()["policy"], sort_keys=True) for d in found}
        if len(policies) > 1:
            raise found[1].error(f"region {dict(region)} is also matched by checkpoint directive #{found[0].index} "
                                 f"with another policy ({sorted(policies)})",
                                 "make the filters disjoint, or give both the same policy")
        return found[0] if found else None
    return of


def microbatch_count(directives: Iterable[Directive]) -> int:
    """The step's micro-batch count (1 without a split directive)."""
    return max((d.num_microbatches for d in directives if isinstance(d, Split)), default=1)


@dataclass(frozen=True)
class ActivationWindow:
    """What a region's activations live through, from the directives: the step's micro-batch count, how
    many micro-batches' activations of the region are alive at once (forwards run minus backwards run,
    at most, along its rank's ``order``; every micro-batch without an order) and the device group it is
    placed on (regions of one stage share it). The ``budget_mb`` checkpoint policy budgets per stage."""

    microbatches: int = 1
    orders: tuple[Order, ...] = ()
    places: tuple[Place, ...] = ()
    mb_tags: frozenset[str] = frozenset({"MB"})

    def inflight(self, region: dict[str, Any]) -> int:
        peak = 0
        for d in self.orders:
            alive = top = 0
            for group in d.filters:
                for f in sorted(group, key=lambda f: f.get("PASS") != "F"):  # an overlap slot: F first (worst)
                    if not filter_matches({k: v for k, v in f.items() if k != "PASS" and k not in self.mb_tags},
                                          region):
                        continue
                    alive += 1 if f.get("PASS") == "F" else -1 if f.get("PASS") in ("B", "BI") else 0
                    top = max(top, alive)
            peak = max(peak, top)
        return min(peak, self.microbatches) if peak else self.microbatches

    def stage(self, region: dict[str, Any]) -> tuple[int, ...] | None:
        return next((d.devices for d in self.places if filter_matches(d.filter, region)), None)


def activation_window(directives: Iterable[Directive]) -> ActivationWindow:
    directives = list(directives)
    return ActivationWindow(microbatch_count(directives), tuple(d for d in directives if isinstance(d, Order)),
                            tuple(d for d in directives if isinstance(d, Place)),
                            frozenset({"MB"} | {d.dim_name for d in directives if isinstance(d, Split)}))
