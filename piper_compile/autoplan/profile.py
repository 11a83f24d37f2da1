"""``piper.profile``: calibrate autoplan's compute rate by a short run of the model on the real device;
``measure_link``: its network, by a ping-pong between two local ranks over the link they use.

A few eager forward + backward steps of the model on one micro-batch-sized slice of the example batch,
timed after a warm-up (``torch.cuda.synchronize`` on GPU), their FLOPs counted by
``torch.utils.flop_counter.FlopCounterMode``: the achieved FLOP/s of *this* model on *this* device
(small layers and memory-bound ops included), which autoplan's FLOP cost model then uses instead of a
nominal peak. Gradients are computed with ``torch.autograd.grad``: the model's ``.grad`` is untouched."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from piper_compile.errors import PiperError
from piper_compile.runtime.registry import plain_tensors


@dataclass(frozen=True)
class Profile:
    """What a short run measured: FLOPs of one step on the batch, its median time, and their ratio."""

    flops: int
    step_s: float
    steps: int
    device: str

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.step_s if self.step_s > 0 else 0.0

    def __str__(self) -> str:
        return (f"profile on {self.device}: {self.flops / 1e9:.3f} GFLOP per step in {self.step_s * 1e3:.2f} ms "
                f"(median of {self.steps}): {self.flops_per_s / 1e9:.2f} GFLOP/s achieved")


def _step(model: nn.Module, batch: tuple[Any, ...], params: list[torch.Tensor]) -> None:
    loss = model(*batch)
    torch.autograd.grad(loss, params, allow_unused=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@plain_tensors
def profile(model: nn.Module, *example_batch: Any, steps: int = 5, warmup: int = 2) -> Profile:
    """Time ``steps`` eager training steps (forward + backward, no update) of ``model`` on ``example_batch``
    after ``warmup`` ones; pass ``flops_per_s=profile(...).flops_per_s`` to ``piper.autoplan``."""
    if steps < 1 or warmup < 0:
        raise PiperError(f"piper: profile: steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise PiperError(f"piper: profile: {type(model).__name__} has no trainable parameters to time a step of")
    device = params[0].device
    counter = FlopCounterMode(display=False)
    with counter:
        _step(model, example_batch, params)
    for _ in range(warmup):
        _step(model, example_batch, params)
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        _step(model, example_batch, params)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return Profile(counter.get_total_flops(), sorted(times)[len(times) // 2], steps, str(device))


def _ping(rank: int, world: int, sizes: tuple[int, ...], reps: int) -> dict[int, float]:
    """Rank 0 <-> 1 round trips of each size (bytes); one-way seconds, the median of ``reps``."""
    import statistics

    import torch.distributed as dist

    out = {}
    for n in sizes:
        buf = torch.zeros(n // 4)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        out[n] = statistics.median(times)
    return out


def measure_link(ranks: int = 2, reps: int = 20) -> tuple[float, float]:
    """(bytes/s, one-way latency s) of the link between two local gloo ranks (``ranks`` processes started
    on this machine: loopback, or the emulated link of ``benchmarks/emulated_link.py``), from the median
    ping-pong times of a 4 KiB and a 4 MiB message. ``autoplan(network="measured")`` uses it for every
    traffic class."""
    from piper_compile.testing.launch import run_local

    small, big = 4096, 4 << 20
    t = run_local(_ping, max(2, ranks), (small, big), reps)[0]
    return (big - small) / max(t[big] - t[small], 1e-9), t[small]
