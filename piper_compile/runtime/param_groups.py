"""An optimizer with several parameter groups (no weight decay on biases and norms, a lower learning rate
for embeddings, ...) on a rank whose parameters are laid out by piper.

The user's factory builds the optimizer over the model's own parameters, so it can sort them by name,
shape or identity as it would in eager PyTorch. Each group's parameters are then replaced by what this
rank updates of them: the runs of its ZeRO shards that hold the group's parameters
(``ShardBucket.group_runs``, each a view of the shard), its tensor-parallel or expert pieces, or the
parameters themselves. Every update the optimizer makes is elementwise per run, so a parameter is updated
as the eager optimizer would update it, with its own group's hyperparameters.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from piper_compile.errors import PiperError

if TYPE_CHECKING:
    from piper_compile.runtime.state import TrainState


def group_of(opt: torch.optim.Optimizer, st: "TrainState") -> dict[str, int]:
    """fqn -> the index of the optimizer group holding the parameter (or this rank's piece of it)."""
    fqn_of = {id(p): f for f, p in st.named.items()}
    fqn_of.update({id(p): f for f, p in st.local_params().items()})
    out: dict[str, int] = {}
    for i, g in enumerate(opt.param_groups):
        for p in g["params"]:
            f = fqn_of.get(id(p))
            if f is None:
                raise PiperError(f"piper: parameter group {i} of options['optimizer'] holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a parameter of the compiled model; build the "
                                 "groups from the parameters the factory is given (or from model.named_parameters())")
            out[f] = i
    return out


def regroup(opt: torch.optim.Optimizer, st: "TrainState") -> None:
    """Give each of ``opt``'s groups what this rank updates of its parameters (see the module docstring).
    The grouping is read once, from the parameters the factory saw, and kept on ``st``."""
    if st.group_of is None:
        st.group_of = group_of(opt, st)
    groups = st.group_of
    new: list[list[nn.Parameter]] = [[] for _ in opt.param_groups]
    sharded: set[str] = set()
    if st.zero is not None and st.zero.sharded:
        for b in st.zero.buckets.values():
            b.group_runs(groups)
            sharded.update(b.fqns)
            for r in b.runs or ():
                new[r.group].append(r.param)
    for f, p in st.named.items():
        if f in groups and f not in sharded:
            new[groups[f]].append(st.local_param(f, p))  # type: ignore[arg-type]
    for g, params in zip(opt.param_groups, new):
        g["params"] = params
