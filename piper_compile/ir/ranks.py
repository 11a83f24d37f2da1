"""Rank lists written compactly: ``0,1,2,3,9`` is ``0-3,9`` and ``0,8,16,...,16376`` is ``0-16376:8``.

A plan for 16,384 ranks has groups of thousands of ranks; written out they would make every DAG line, node
name and queue label tens of KB. Runs of three or more equally spaced ascending ranks become ``a-b``
(step 1) or ``a-b:s``; everything else is written as is, so the order of a list (which pairs ranks of
two groups) is kept and ``expand(compact(x)) == x``."""
from __future__ import annotations

import functools

__all__ = ["compact", "expand", "pack", "unpack"]

PACK_AT = 16  # rank lists at least this long are written as ``{"ranks": compact}`` in an op's JSON fields


@functools.lru_cache(maxsize=1 << 12)
def compact(ranks: tuple[int, ...], sep: str = ",") -> str:
    """``ranks`` as text, runs of three or more equally spaced ascending ranks as ranges."""
    items: list[str] = []
    i, n = 0, len(ranks)
    while i < n:
        step = ranks[i + 1] - ranks[i] if i + 2 < n else 0
        if step > 0 and ranks[i + 2] - ranks[i + 1] == step:
            j = i + 2
            while j + 1 < n and ranks[j + 1] - ranks[j] == step:
                j += 1
            items.append(f"{ranks[i]}-{ranks[j]}" + (f":{step}" if step > 1 else ""))
            i = j + 1
        else:
            items.append(str(ranks[i]))
            i += 1
    return sep.join(items)


def expand(text: str, sep: str = ",") -> tuple[int, ...]:
    """Inverse of ``compact``."""
    out: list[int] = []
    for item in text.split(sep) if text else ():
        if "-" not in item:
            out.append(int(item))
            continue
        span, _, step = item.partition(":")
        a, b = span.split("-")
        out.extend(range(int(a), int(b) + 1, int(step or 1)))
    return tuple(out)


def pack(value: object) -> object:
    """An op field for its JSON text: a tuple of ``PACK_AT`` or more non-negative ints (a rank list) as
    ``{"ranks": "0-16376:8"}``, tuples of them element by element; anything else as is."""
    if isinstance(value, tuple) and value:
        if isinstance(value[0], tuple):
            return [pack(v) for v in value]
        if len(value) >= PACK_AT:
            return _packed(value)
    return value


@functools.lru_cache(maxsize=1 << 12)
def _packed(value: tuple) -> object:
    if all(type(v) is int and v >= 0 for v in value):
        return {"ranks": compact(value)}
    return value


def unpack(value: object) -> object:
    """Inverse of ``pack`` on parsed JSON (lists stay lists; the op's parser makes them tuples)."""
    if isinstance(value, dict) and set(value) == {"ranks"}:
        return list(expand(value["ranks"]))
    if isinstance(value, list):
        return [unpack(v) for v in value]
    return value
