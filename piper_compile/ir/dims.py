"""Dimension expressions of the DAG's text form (``s0*s1``, ``;`` for ``,`` inside calls such as
``Max(1; s0)``), parsed once per distinct text: the passes ask which symbols an expression reads, the
simulator what it equals at given symbol values."""
from __future__ import annotations

import functools
import inspect
from typing import Any

import sympy
import torch.utils._sympy.functions as _torch_sympy

__all__ = ["dim_value", "parse_dim"]

# The functions a shape environment prints (``32*CeilToInt(IntTrueDiv(s1, 32))``: CUDA's efficient
# attention rounds its log-sum-exp up to a multiple of 32), read back as themselves: unknown to sympify,
# they would stay unevaluated and an expression would never become a number.
_TORCH_FUNCTIONS = {name: obj for name, obj in vars(_torch_sympy).items()
                    if inspect.isclass(obj) and issubclass(obj, sympy.Function) and obj.__module__ == _torch_sympy.__name__}


@functools.lru_cache(maxsize=1 << 16)
def parse_dim(text: str) -> Any:
    """``text`` as a sympy expression."""
    return sympy.sympify(text.replace(";", ","), locals=_TORCH_FUNCTIONS)


def dim_value(expr: Any, symbols: dict[str, int]) -> int:
    """A dimension (int, sympy expression or its text, e.g. ``"s95*s75"``) at these symbol values; a
    ``ValueError`` naming the symbols without a value if it does not become a number."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        if expr.lstrip("-").isdigit():
            return int(expr)
        expr = parse_dim(expr)
    if not isinstance(expr, sympy.Basic):  # a number of another type (numpy's, a SymInt's constant)
        return int(expr)
    # by name: the shape environment's symbols carry assumptions (integer, positive) that Symbol(k) lacks
    value = expr.xreplace({s: symbols[s.name] for s in expr.free_symbols if s.name in symbols})
    if not getattr(value, "is_number", True):  # torch's functions may evaluate to a plain int
        missing = sorted(s.name for s in value.free_symbols) or [str(value)]
        raise ValueError(f"piper: dimension {expr} has no value at the known size symbols {sorted(symbols)}: "
                         f"{', '.join(missing)} unknown (a symbol the capture's shape environment did not record)")
    return int(value)
