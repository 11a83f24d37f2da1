"""One trace format for simulated and real steps: Chrome/Perfetto JSON (``{"traceEvents": [...]}``).

pid = rank, tid = stream (``compute`` is tid 0, every communication queue -- the instruction's process
group, ``Instr.group_name`` -- gets its own tid, named by a ``thread_name`` metadata event), one
``"X"`` span per instruction (asynchronous ones from issue to completion), a ``"step"`` span per rank,
and a flow arrow (``"s"`` at the SEND, ``"f"`` at its RECV, same ``id``) for every point-to-point message.
Every span's ``args`` carry the fields of ``Span``, so a trace file reads back into spans
(``read_spans``) for ``MeasuredCost`` and ``draw_grid``. Times are seconds in ``Span`` and microseconds
in the JSON. Real runs write ``dir/rank{r}.json`` (``piper_compile.runtime.trace``); ``merge_traces``
joins them into one file.
"""
from __future__ import annotations

import dataclasses
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from piper_compile.ir.dag import Kind
from piper_compile.plan.program import Instr

COMPUTE_STREAM = "compute"
STEP_STREAM = "step"
STEP_KIND = "STEP"
_CAT = "piper"


@dataclass(frozen=True, slots=True)
class Span:
    """One instruction (or a whole step, ``kind == "STEP"``) on one rank, in seconds."""

    rank: int
    stream: str  # "compute", a communication queue ("pp_fwd:up", "dp") or "step"
    name: str  # DAG node name
    label: str  # short text form, e.g. "F1.mb3"
    kind: str  # Kind value, or "STEP"
    start: float  # host issue start (after the instruction's waits)
    end: float  # compute: end; async: completion
    pos: int = -1  # index in the rank's program
    pass_: str | None = None  # F | B | BI | BW for compute
    mb: int | None = None
    msg: str | None = None  # SEND/RECV message (matches the pair)
    peer: int | None = None
    segment: str | None = None
    issue_end: float | None = None  # async: when the host finished issuing it
    wait_s: float = 0.0  # host time spent in waits just before this instruction
    blocked_s: float = 0.0  # async: how long the host blocked waiting for it to complete

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def host_end(self) -> float:
        """When the host thread was free again after issuing/running this instruction."""
        return self.issue_end if self.issue_end is not None else self.end


_FIELDS = {f.name for f in dataclasses.fields(Span)}
_ARG_FIELDS = [f.name for f in dataclasses.fields(Span) if f.name not in ("start", "end")]


def span_of(ins: Instr, rank: int, pos: int, start: float, end: float, **extra: Any) -> Span:
    """A span for instruction ``ins`` of ``rank``'s program."""
    n = ins.node
    mb = n.tag("MB")
    return Span(rank=rank, stream=ins.group_name(rank) if ins.is_async else COMPUTE_STREAM, name=n.name,
                label=ins.short(), kind=n.kind.value, start=start, end=end, pos=pos,
                pass_=n.tag("PASS") if n.kind is Kind.COMPUTE else None, mb=mb if isinstance(mb, int) else None,
                msg=getattr(n.op, "msg", None), peer=ins.peer, segment=getattr(n.op, "segment", None), **extra)


def flow_id(msg: str) -> int:
    """Flow id of a message: the same in every process (the SEND and RECV may be in different files)."""
    return zlib.crc32(msg.encode())


def _tids(spans: list[Span]) -> dict[tuple[int, str], int]:
    tids: dict[tuple[int, str], int] = {}
    for rank in sorted({s.rank for s in spans}):
        streams = {s.stream for s in spans if s.rank == rank} - {COMPUTE_STREAM, STEP_STREAM}
        order = [COMPUTE_STREAM, *sorted(streams), STEP_STREAM]
        tids.update({(rank, name): i for i, name in enumerate(order)})
    return tids


def chrome_events(spans: Iterable[Span], counters: dict[int, list[tuple[float, int]]] | None = None,
                  origin: float = 0.0) -> list[dict[str, Any]]:
    """Chrome trace events for ``spans`` (and optional per-rank live-bytes counters), with times
    shifted by ``-origin`` seconds."""
    spans = list(spans)
    tids = _tids(spans)
    us = lambda t: round((t - origin) * 1e6, 3)  # noqa: E731
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
    for (rank, stream), tid in sorted(tids.items(), key=lambda kv: kv[1]):
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": stream}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    sends: dict[str, Span] = {}
    for s in spans:
        args = {k: v for k in _ARG_FIELDS if (v := getattr(s, k)) is not None}
        if s.issue_end is not None:
            args["issue_end"] = us(s.issue_end)
        events.append({"ph": "X", "cat": _CAT, "name": s.label, "pid": s.rank, "tid": tids[(s.rank, s.stream)],
                       "ts": us(s.start), "dur": round(max(s.end - s.start, 0.0) * 1e6, 3), "args": args})
        if s.kind == Kind.SEND.value and s.msg:
            sends[s.msg] = s
    for s in spans:
        snd = sends.get(s.msg or "") if s.kind == Kind.RECV.value else None
        if snd is None:
            continue
        fid = flow_id(s.msg or "")
        events.append({"ph": "s", "cat": "p2p", "name": "p2p", "id": fid, "pid": snd.rank,
                       "tid": tids[(snd.rank, snd.stream)], "ts": us(snd.start)})
        at = min(max(snd.start, s.start), s.end)  # inside the RECV span, not before the send
        events.append({"ph": "f", "bp": "e", "cat": "p2p", "name": "p2p", "id": fid, "pid": s.rank,
                       "tid": tids[(s.rank, s.stream)], "ts": us(at)})
    for rank, series in sorted((counters or {}).items()):
        for t, live in series:
            events.append({"ph": "C", "name": "activation bytes", "pid": rank, "ts": us(t), "args": {"live": live}})
    return events


def write_trace(source: Any, path: str | os.PathLike[str], other: dict[str, Any] | None = None) -> str:
    """Write ``source`` (a ``SimResult`` or a list of ``Span``) as Chrome/Perfetto JSON to ``path``;
    returns the path. Open it in https://ui.perfetto.dev or chrome://tracing."""
    spans = list(getattr(source, "spans", source))
    counters = getattr(source, "memory_timeline", None)
    origin = min((s.start for s in spans), default=0.0) if not hasattr(source, "spans") else 0.0
    obj: dict[str, Any] = {"traceEvents": chrome_events(spans, counters, origin), "displayTimeUnit": "ms"}
    obj["otherData"] = {"origin_s": origin, **(other or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, separators=(",", ":"))  # dumps: the C encoder (dump streams in Python)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def spans_from_events(events: list[dict[str, Any]], origin: float = 0.0) -> list[Span]:
    """Inverse of ``chrome_events`` for the instruction and step spans (absolute times restored with
    ``origin`` seconds)."""
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != _CAT:
            continue
        args = {k: v for k, v in e.get("args", {}).items() if k in _FIELDS}
        start = e["ts"] / 1e6 + origin
        if "issue_end" in args:
            args["issue_end"] = args["issue_end"] / 1e6 + origin
        out.append(Span(start=start, end=start + e["dur"] / 1e6, **args))
    return out


def _trace_files(source: str | os.PathLike[str]) -> list[Path]:
    p = Path(source)
    if p.is_dir():
        files = sorted(p.glob("rank*.json"), key=lambda f: f.name)
        files = [f for f in files if not f.name.endswith(".fwd.json")]
        if not files:
            raise FileNotFoundError(f"piper: no rank*.json trace files in {p}; run with PIPER_TRACE={p}")
        return files
    return [p]


def read_spans(source: str | os.PathLike[str]) -> list[Span]:
    """Spans of a trace: a per-rank file, a merged file, or a directory of ``rank*.json`` files."""
    spans: list[Span] = []
    for f in _trace_files(source):
        obj = json.loads(f.read_text())
        origin = float(obj.get("otherData", {}).get("origin_s", 0.0))
        spans += spans_from_events(obj["traceEvents"], origin)
    return spans


def merge_traces(directory: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> str:
    """Join ``directory/rank*.json`` (one file per rank, from ``PIPER_TRACE=directory``) into one trace,
    ``directory/trace.json`` unless ``out`` is given, with flows between ranks; returns its path."""
    spans = read_spans(directory)
    return write_trace(spans, out or Path(directory) / "trace.json", {"merged_from": str(directory)})
