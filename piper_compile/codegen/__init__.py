"""Codegen: each compute segment becomes a callable (Inductor by default, eager GraphModule to debug)."""
from piper_compile.codegen.compile import CompiledSegment

__all__ = ["CompiledSegment"]
