"""Standalone check that the PyTorch peers of ``bench_zero.py`` / ``bench_pp_zero.py`` work on CPU over gloo.

1. FSDP2 ``fully_shard`` (per block, then root) on 2 ranks with a 1-D CPU mesh, ``reshard_after_forward``
   False and True: per-step global mean loss equals single-process training on the global batch.
2. ``torch.distributed.pipelining`` Schedule1F1B on PP2 x DP2 (4 ranks, 2-D mesh ("dp", "pp")) with every
   stage ``fully_shard``-ed over its "dp" group: replica-mean loss equals single-process training.
3. DDP + ``ZeroRedundancyOptimizer(AdamW)`` on 2 ranks: same check.

Small GPT (dim 32), 3 AdamW steps, fp32. Prints one line per check and exits non-zero on a mismatch.
Result on torch 2.13.0+cpu: all three pass (no workaround needed).

    OMP_NUM_THREADS=1 python benchmarks/check_fsdp_cpu.py
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pp import StageModule, _ce  # noqa: E402

from piper_compile.testing.launch import run_local  # noqa: E402
from piper_compile.testing.models import GPT, GPTConfig  # noqa: E402

CFG = dict(dim=32, layers=4, heads=4, seq=16, vocab=96)
STEPS, GLOBAL = 3, 16


def _gpt(untie: bool) -> GPT:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**CFG))
    if untie:
        gpt.head.weight = nn.Parameter(gpt.wte.weight.detach().clone())
    return gpt


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _gpt(False).make_batch(GLOBAL, torch.Generator().manual_seed(100 + i))


def reference(untie: bool) -> list[float]:
    gpt = _gpt(untie)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    out = []
    for i in range(STEPS):
        loss = gpt(*_batch(i))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _global_mean(losses: list[float], dp: int) -> list[float]:
    t = torch.tensor(losses)
    dist.all_reduce(t)
    return (t / dp).tolist()


def fsdp_worker(rank: int, world: int, reshard_after_forward: bool) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    gpt = _gpt(False)
    for block in gpt.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(gpt, mesh=mesh, reshard_after_forward=reshard_after_forward)
    assert type(gpt.blocks[0].qkv.weight).__name__ == "DTensor"
    return _train(gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-3), rank, world)


def zero_optimizer_worker(rank: int, world: int) -> list[float]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_gpt(False), gradient_as_bucket_view=True)
    return _train(ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3),
                  rank, world)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    """STEPS data-parallel steps on this rank's slice of each global batch; the global-mean losses."""
    n = GLOBAL // world
    out = []
    for i in range(STEPS):
        x, y = _batch(i)
        loss = model(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return _global_mean(out, world)


def pp_fsdp_worker(rank: int, world: int, reshard_after_forward: bool) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    stage_idx, rep = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    assert (stage_idx, rep) == (rank % 2, rank // 2)
    module = StageModule(_gpt(True), stage_idx, 2)
    for block in module.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    stage = PipelineStage(module, stage_idx, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=_ce)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    n = GLOBAL // 2
    out = []
    for i in range(STEPS):
        x, y = _batch(i)
        x, y = x[rep * n:(rep + 1) * n], y[rep * n:(rep + 1) * n]
        losses: list[torch.Tensor] = []
        if stage_idx == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad()
        out.append(torch.stack(losses).mean().item() if losses else 0.0)
    return _global_mean(out, 2)


def main() -> int:
    ok = True

    def check(label: str, got: list[float], ref: list[float]) -> None:
        nonlocal ok
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        good = worst <= 1e-5
        ok &= good
        print(f"{label:<58} losses {' '.join(f'{v:.6f}' for v in got)}  max rel diff {worst:.1e}  "
              f"{'OK' if good else 'MISMATCH'}", flush=True)

    tied, untied = reference(False), reference(True)
    print(f"torch {torch.__version__}; single-process reference (tied) {' '.join(f'{v:.6f}' for v in tied)}")
    for raf in (False, True):
        check(f"FSDP2 fully_shard 2 ranks reshard_after_forward={raf}", run_local(fsdp_worker, 2, raf)[0], tied)
    check("DDP + ZeroRedundancyOptimizer(AdamW) 2 ranks", run_local(zero_optimizer_worker, 2)[0], tied)
    for raf in (True, False):
        check(f"pipelining 1F1B PP2xDP2 + fully_shard(dp) raf={raf}", run_local(pp_fsdp_worker, 4, raf)[0], untied)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
