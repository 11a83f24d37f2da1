"""The two tensor-parallel markers piper inserts around sharded linear layers (Megatron's f and g).

Single-device they are identities. ``tp_allreduce`` is the boundary op capture cuts a segment around;
the ``shard_tensor`` lowering replaces it by an ALL_REDUCE over the tensor-parallel group:

* ``tp_allreduce(x)`` (g, after a row-parallel linear): all-reduce in forward, identity in backward;
* ``tp_copy(x)`` (f, before a column-parallel linear): identity in forward, all-reduce of the input
  gradient in backward (its backward formula is ``tp_allreduce``).

Sequence parallelism (``shard_tensor(..., sequence_parallel=True)``) moves activations between being
split along the sequence dimension ``dim`` over the ``size`` ranks of the group and being whole:

* ``tp_reduce_scatter`` (after a row-parallel linear): reduce-scatter; backward ``tp_all_gather``;
* ``tp_all_gather`` (before a column-parallel linear): all-gather; backward ``tp_reduce_scatter``;
* ``tp_scatter`` (a whole activation meets a split one, e.g. the residual stream): this rank's chunk;
  backward ``tp_gather``;
* ``tp_gather`` (a split activation reaches an op that needs the whole sequence, e.g. the LM head):
  all-gather; backward ``tp_scatter``.
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


def _whole_only(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if size != 1:
        raise RuntimeError("piper: sequence-parallel markers only run inside piper's lowered program (the "
                           "shard_tensor lowering replaces them by collectives); this graph ran them directly")
    return x.clone()


def _split_shape(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    n = x.shape[dim]
    torch._check(n % size == 0, lambda: f"piper: sequence parallel: dimension {dim} of size {n} does not split "
                                        f"into {size} tensor-parallel ranks")
    return x.new_empty((*x.shape[:dim], n // size, *x.shape[dim + 1:]))


def _whole_shape(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:dim], x.shape[dim] * size, *x.shape[dim + 1:]))


def _keep_split(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.dim, ctx.size = inputs[1], inputs[2]


_SEQUENCE_OPS = {"tp_all_gather": (_whole_shape, "tp_reduce_scatter"), "tp_reduce_scatter": (_split_shape, "tp_all_gather"),
                 "tp_gather": (_whole_shape, "tp_scatter"), "tp_scatter": (_split_shape, "tp_gather")}


def _backward_by(name: str) -> Any:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return getattr(torch.ops.piper, name)(grad, ctx.dim, ctx.size), None, None
    return backward


for _name, (_fake, _grad_op) in _SEQUENCE_OPS.items():  # a backward resolves its op when it runs
    torch.library.custom_op(f"piper::{_name}", _whole_only, mutates_args=()).register_fake(_fake)
    torch.library.register_autograd(f"piper::{_name}", _backward_by(_grad_op), setup_context=_keep_split)

ALLREDUCE_OP = torch.ops.piper.tp_allreduce.default
COPY_OP = torch.ops.piper.tp_copy.default
ALL_GATHER_OP = torch.ops.piper.tp_all_gather.default
REDUCE_SCATTER_OP = torch.ops.piper.tp_reduce_scatter.default
GATHER_OP = torch.ops.piper.tp_gather.default
SCATTER_OP = torch.ops.piper.tp_scatter.default
