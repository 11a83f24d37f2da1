"""Layers piper knows how to distribute: :class:`MoE` (expert parallel via the ``shard`` directive)."""
from piper_compile.nn.moe import MoE, moe_experts

__all__ = ["MoE", "moe_experts"]
