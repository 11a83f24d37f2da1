"""Directive records, JSON parsing/validation and Python builders."""
from piper_compile.directives.builders import checkpoint, order, pipeline, place, replicate, shard, shard_tensor, split
from piper_compile.directives.spec import (
    ANY, Checkpoint, Directive, Order, Place, Replicate, Shard, ShardTensor, Split, filter_matches, parse_directive,
    parse_directives,
)

__all__ = ["ANY", "Checkpoint", "Directive", "Order", "Place", "Replicate", "Shard", "Split", "checkpoint",
           "filter_matches", "order", "parse_directive", "parse_directives", "pipeline", "place", "replicate", "shard",
           "shard_tensor", "split", "ShardTensor"]
