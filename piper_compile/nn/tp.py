"""The two tensor-parallel markers piper inserts around sharded linear layers (Megatron's f and g).

Single-device they are identities. ``tp_allreduce`` is the boundary op capture cuts a segment around;
the ``shard_tensor`` lowering replaces it by an ALL_REDUCE over the tensor-parallel group:

* ``tp_allreduce(x)`` (g, after a row-parallel linear): all-reduce in forward, identity in backward;
* ``tp_copy(x)`` (f, before a column-parallel linear): identity in forward, all-reduce of the input
  gradient in backward (its backward formula is ``tp_allreduce``).
"""
from __future__ import annotations

from typing import Any

import torch


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()  # a custom op may not return its input


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


for _name in ("tp_allreduce", "tp_copy"):
    torch.library.custom_op(f"piper::{_name}", _identity, mutates_args=()).register_fake(_like)


def _no_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    return None


def _identity_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return grad


def _reduce_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return torch.ops.piper.tp_allreduce(grad)


torch.library.register_autograd("piper::tp_allreduce", _identity_backward, setup_context=_no_setup)
torch.library.register_autograd("piper::tp_copy", _reduce_backward, setup_context=_no_setup)

ALLREDUCE_OP = torch.ops.piper.tp_allreduce.default
COPY_OP = torch.ops.piper.tp_copy.default
