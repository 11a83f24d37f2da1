"""Training state shared by every compiled variant of one model (train step, forward-only step):
the optimizer, gradient storage (flat per bucket; each parameter's gradient is a view of it) and
the one-time broadcast of rank 0's weights."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from piper_compile.capture.joint import JointGraph
from piper_compile.ir.dag import Kind
from piper_compile.plan.program import Program

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class GradBuffers:
    """Per-rank gradient storage: one flat tensor per all-reduce bucket, one tensor per other gradient."""

    def __init__(self, params: dict[str, nn.Parameter], buckets: dict[str, list[str]], others: list[str]) -> None:
        self.flat: dict[str, torch.Tensor] = {}
        self.views: dict[str, torch.Tensor] = {}
        for name, fqns in buckets.items():
            p0 = params[fqns[0]]
            flat = torch.zeros(sum(params[f].numel() for f in fqns), dtype=p0.dtype, device=p0.device)
            off = 0
            for f in fqns:
                n = params[f].numel()
                self.views[f] = flat[off : off + n].view(params[f].shape)
                off += n
            self.flat[name] = flat
        for f in others:
            if f not in self.views:
                self.views[f] = torch.zeros_like(params[f], memory_format=torch.contiguous_format)
                self.flat[f"grad:{f}"] = self.views[f]

    @classmethod
    def for_program(cls, program: Program, joint: JointGraph) -> "GradBuffers":
        buckets: dict[str, list[str]] = {}
        others: list[str] = []
        for ins in program.instrs:
            n = ins.node
            if n.kind is Kind.ALL_REDUCE and n.attr("purpose") == "grad":
                buckets[n.name] = list(n.attr("params"))
            elif n.kind is Kind.COMPUTE:
                others += [fqn for _, fqn in n.attr("grads") or ()]
            elif n.kind in (Kind.SEND, Kind.RECV) and n.attr("state"):
                others.append(n.attr("state"))
            elif n.kind is Kind.UPDATE:
                others += list(n.attr("params"))
        return cls(joint.params, buckets, others)

    def zero_(self) -> None:
        for t in self.flat.values():
            t.zero_()

    def accumulate(self, fqn: str, grad: torch.Tensor) -> None:
        self.views[fqn].add_(grad)

    def view(self, fqn: str) -> torch.Tensor:
        return self.views[fqn]

    def bucket(self, name: str) -> torch.Tensor:
        return self.flat[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())


class TrainState:
    """One per model (keyed by its parameters), shared by the grad and no-grad compiled programs."""

    def __init__(self, params: list[nn.Parameter], factory: OptimizerFactory | None) -> None:
        self.params = params
        self.factory = factory
        self.optimizer: torch.optim.Optimizer | None = None
        self.broadcast_done = False
        self.steps: list[Any] = []  # the CompiledSteps (grad / no-grad variants) of this model
        self.device = params[0].device if params else torch.device("cpu")

    def get_optimizer(self) -> torch.optim.Optimizer | None:
        if self.optimizer is None and self.factory is not None:
            self.optimizer = self.factory(self.params)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TypeError(f"piper: options['optimizer'] must return a torch.optim.Optimizer, got "
                                f"{type(self.optimizer).__name__}; pass e.g. functools.partial(torch.optim.AdamW, lr=1e-3)")
        return self.optimizer

    def broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Make every replica start from rank 0's weights (once per model)."""
        if self.broadcast_done:
            return
        if dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                for t in tensors:
                    dist.broadcast(t.detach(), src=0)
        self.broadcast_done = True

    def apply_update(self, fqns: Iterable[str], grads: GradBuffers, args: list[Any], joint: JointGraph) -> None:
        """The optimizer step for this rank's parameters, or the gradients into ``param.grad``."""
        opt = self.get_optimizer()
        params = [(joint.params[f], grads.view(f)) for f in fqns]
        if opt is None:
            for p, g in params:  # as torch would leave them: accumulate into .grad
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.add_(g)
            return
        for p, g in params:
            p.grad = g
        opt.step()
        for p, _ in params:
            p.grad = None
