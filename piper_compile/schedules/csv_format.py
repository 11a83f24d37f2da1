"""Per-rank action CSV of ``torch.distributed.pipelining`` <-> piper directives.

One row per rank, one action per cell: ``{stage}{type}{microbatch}`` with type ``F`` (forward),
``B`` (full backward), ``I`` (backward input = piper's BI), ``W`` (backward weight = BW), and
``({a};{b})OVERLAP_F_B`` for an overlap slot; empty or ``None`` cells are idle steps. Reading also
accepts the "compute_comms" form that ``_dump_csv`` writes: its communication and resharding actions
(``SEND_F``, ``RECV_B``, ``UNSHARD``, ``REDUCE_GRAD``, ...) are skipped, because piper derives its own
communication from the training DAG. Stage s goes to the rank whose row holds it.
"""
from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any, Iterable

from piper_compile.errors import PiperDirectiveError

_TO_PIPER = {"F": "F", "B": "B", "I": "BI", "W": "BW"}
_TO_TORCH = {v: k for k, v in _TO_PIPER.items()}
_COMPUTE = re.compile(r"^(\d+)([FBIW])(\d+)$")
_SKIPPED = re.compile(r"^\d+(UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD)\d*$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def _parse_cell(cell: str, rank: int, col: int) -> list[tuple[str, int, int]] | None:
    cell = cell.strip()
    if cell in ("", "None") or _SKIPPED.match(cell):
        return None
    m = _OVERLAP.match(cell)
    parts = m.group(1).split(";") if m else [cell]
    out = []
    for part in parts:
        a = _COMPUTE.match(part.strip())
        if a is None:
            raise PiperDirectiveError(None, {"csv_row": rank, "column": col, "action": cell},
                                      f"action {cell!r} is not a compute action like '2F0', '1I3' or '(0F1;1B0)OVERLAP_F_B'",
                                      "write the schedule in torch.distributed.pipelining's action format")
        out.append((_TO_PIPER[a.group(2)], int(a.group(1)), int(a.group(3))))
    return out


def read_rows(rows: Iterable[list[str]], tag: str = "PP", mb_tag: str = "MB") -> list[dict[str, Any]]:
    """Place + order directives from CSV rows (row r = rank r)."""
    owner: dict[int, int] = {}
    orders = []
    for rank, row in enumerate(rows):
        groups = []
        for col, cell in enumerate(row):
            steps = _parse_cell(cell, rank, col)
            if steps is None:
                continue
            for _, stage, _ in steps:
                if owner.setdefault(stage, rank) != rank:
                    raise PiperDirectiveError(None, {"csv_row": rank, "action": cell},
                                              f"stage {stage} appears on rank {owner[stage]} and on rank {rank}",
                                              "give every stage one rank (one row)")
            groups.append([{tag: s, mb_tag: m, "PASS": p} for p, s, m in steps])
        if groups:
            orders.append({"op": "order", "filters": groups})
    places = [{"op": "place", "filter": {tag: s}, "devices": [r]} for s, r in sorted(owner.items())]
    return [*places, *orders]


def read_csv(path: str | Path, tag: str = "PP", mb_tag: str = "MB") -> list[dict[str, Any]]:
    """Directives from a ``torch.distributed.pipelining`` schedule CSV (compute_only or compute_comms)."""
    with open(path, newline="") as f:
        return read_rows(csv.reader(f), tag, mb_tag)


def to_rows(directives: list[dict[str, Any]], tag: str = "PP", mb_tag: str = "MB") -> list[list[str]]:
    """Compute-only CSV rows (one per rank) from piper ``place`` + ``order`` directives."""
    owner = {d["filter"][tag]: d["devices"][0] for d in directives
             if d.get("op") == "place" and tag in d.get("filter", {})}
    rows: dict[int, list[str]] = {}
    for d in directives:
        if d.get("op") != "order":
            continue
        cells = []
        for group in d["filters"]:
            acts = [f"{f[tag]}{_TO_TORCH[f['PASS']]}{f[mb_tag]}" for f in group]
            cells.append(acts[0] if len(acts) == 1 else f"({';'.join(acts)})OVERLAP_F_B")
        stage = d["filters"][0][0][tag]
        rank = owner.get(stage, stage)
        if rank in rows:
            raise PiperDirectiveError(None, d, f"two order directives for rank {rank}", "give one order per rank")
        rows[rank] = cells
    return [rows.get(r, []) for r in range(max(rows) + 1)] if rows else []


def write_csv(directives: list[dict[str, Any]], path: str | Path, tag: str = "PP", mb_tag: str = "MB") -> None:
    """Write piper's schedule as a compute-only CSV that ``torch.distributed.pipelining`` loads."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(to_rows(directives, tag, mb_tag))
