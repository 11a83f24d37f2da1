"""``piper_compile.memory_report(step)``: per-rank bytes of parameters (in their own dtype: under mixed
precision the fp32 master weights), mixed precision's compute copies, gradients, optimizer state and
peak activations (in the dtype the step computes in), measured from the runtime's own buffers, beside the simulator's prediction for the
same programs."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch


# optimizer state tensors per parameter element (torch.optim defaults); others count as Adam-like
_STATE_PER_PARAM = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                    "RMSprop": 1, "Adadelta": 2, "Rprop": 2, "ASGD": 2}
MiB = 2**20


@dataclass
class MemoryFigures:
    """Bytes on one rank. ``params``/``grads``/``optimizer`` persist between steps (ZeRO shards count as
    shards); ``peak_*`` are the most bytes held at once during the last step."""

    params: int = 0
    compute_copies: int = 0  # mixed precision: the param_dtype copies kept between steps
    grads: int = 0
    optimizer: int = 0
    peak_activations: int = 0
    peak_gathered_params: int = 0  # ZeRO-3 all-gathered parameters
    peak_grad_buckets: int = 0  # gradient buffers during the step (ZeRO-2/3 full buckets are transient)

    @property
    def persistent(self) -> int:
        return self.params + self.compute_copies + self.grads + self.optimizer

    def line(self) -> str:
        return "  ".join(f"{f.name} {getattr(self, f.name) / MiB:.3f}" for f in fields(self))


@dataclass
class MemoryReport:
    """This rank's measured figures and the simulator's prediction for the same program."""

    rank: int
    measured: MemoryFigures
    predicted: MemoryFigures

    def format(self) -> str:
        return (f"rank {self.rank} memory (MiB)\n  measured   {self.measured.line()}\n"
                f"  predicted  {self.predicted.line()}")

    def __str__(self) -> str:
        return self.format()


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _measured(cs: Any) -> MemoryFigures:
    plan = cs.plans[False]
    ex = plan.executor
    st = cs.state
    # every parameter storage the process holds (other stages' weights too unless ZeRO released them)
    tensors = [cs.joint.params[f] for f in sorted(cs.joint.params)]
    zero = st.zero
    if zero is not None:
        tensors += [b.shard for b in zero.buckets.values() if b.shard is not None]
    tensors += list(st.local_params().values())  # expert / tensor-parallel pieces (the full weights hold none)
    grads = ex.grads.nbytes() if ex.grads is not None else 0
    if zero is not None:
        grads += zero.grad_shard_bytes()  # 0 between steps: shards are dropped after the update
    opt = st.optimizer
    opt_tensors = [t for s in (opt.state.values() if opt is not None else ()) for t in s.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
    s = ex.stats
    copies = sum(t.numel() * t.element_size() for t in st.compute_copies())
    return MemoryFigures(_storage_bytes(tensors), copies, grads, _storage_bytes(opt_tensors), s.peak_live_bytes,
                         s.peak_gathered_bytes, s.peak_grad_bytes)


def _predicted(cs: Any) -> MemoryFigures:
    from piper_compile.sim.cost import UniformCost
    from piper_compile.sim.simulate import copy_bytes, simulate, trained_bytes
    from piper_compile.sim.shapes import Sizes

    plan = cs.plans[False]
    res = simulate(plan.programs, UniformCost(), plan.dag)
    r = cs.rank
    opt = cs.state.optimizer
    factor = _STATE_PER_PARAM.get(type(opt).__name__, 2) if opt is not None else 0
    if opt is not None and type(opt).__name__ == "SGD" and not opt.param_groups[0].get("momentum"):
        factor = 0
    sizes = Sizes.from_dag(plan.dag)
    trained = trained_bytes(plan.programs[r], sizes)
    return MemoryFigures(res.param_bytes[r], copy_bytes(plan.programs[r], sizes), res.grad_bytes[r], factor * trained,
                         res.peak_activation_bytes[r], res.peak_gathered_bytes.get(r, 0), res.peak_grad_bytes.get(r, 0))


def memory_report(step: Any) -> MemoryReport:
    """Memory of this rank for ``step`` (after at least one training call): measured from the runtime's
    buffers (parameter storage actually held, gradient buffers, optimizer state tensors, and the last
    step's peaks) and predicted by the simulator from the same programs (optimizer state as the
    optimizer's state tensors per parameter, e.g. 2 for AdamW). Under expert parallelism expert weights
    count as this rank's shards (parameters, gradients and optimizer state of ``E/G`` experts)."""
    from piper_compile.api import trained_step

    cs = trained_step(step)
    return MemoryReport(cs.rank, _measured(cs), _predicted(cs))
