"""Dimension expressions of the DAG's text form (``s0*s1``, ``;`` for ``,`` inside calls such as
``Max(1; s0)``), parsed once per distinct text: the passes ask which symbols an expression reads, the
simulator what it equals at given symbol values."""
from __future__ import annotations

import functools
from typing import Any

import sympy

__all__ = ["parse_dim"]


@functools.lru_cache(maxsize=1 << 16)
def parse_dim(text: str) -> Any:
    """``text`` as a sympy expression."""
    return sympy.sympify(text.replace(";", ","))
