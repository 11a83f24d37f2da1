"""A model no rank could hold whole: the bench GPT built on the meta device, on 4 gloo ranks.

Variants, each in freshly spawned processes (one per rank, ``OMP_NUM_THREADS=1``):

    piper-pp4      piper.compile(meta GPT), PP4 1F1B, init "module" (each rank initializes its stage)
    piper-zero3    piper.compile(meta GPT), DP4 ZeRO-3, init "module" (each rank initializes its shards)
    piper-load     DP4 ZeRO-3, init "checkpoint" + piper.load(step, <safetensors dir>), the directory
                   written by piper-pp4 with piper.save(step, dir, format="hf")
    fsdp2          torchtitan's recipe on the same meta GPT: fully_shard per block and the root on a CPU
                   mesh, model.to_empty(device="cpu"), every module's reset_parameters() (as model.apply)

All train with AdamW (fp32 state: weights + gradients + two moments = 16 bytes per parameter over the
world). Per rank the table shows the peak RSS (``ru_maxrss``), the RSS before the model was built, their
difference, and the share the plan gives the rank (piper: ``memory_report``'s predicted parameters,
gradients, optimizer state and peak activations; fsdp2: a quarter of the 16 bytes per parameter), and the
time of the first step (capture, planning, initialization or loading, one step) and of a second one.
The target: every rank's peak minus its baseline within its share + activations + 10%, where the full model
per rank (16 bytes x parameters on each of 4 ranks) would not fit this machine at all.

    python benchmarks/bench_big_model.py                                # dim 2048, 12 layers (~0.67B)
    python benchmarks/bench_big_model.py --dim 512 --layers 4 --vocab 4096   # a quick run
"""
from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_note, piper_revision  # noqa: E402

from piper_compile.testing.launch import run_local  # noqa: E402
from piper_compile.testing.models import GPT, GPTConfig  # noqa: E402

MiB = 2**20
WORLD = 4


def _rss_now() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def _peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _meta_gpt(cfg: dict[str, int]) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))


def _batch(model: GPT, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return model.make_batch(n, torch.Generator().manual_seed(100 + step))


def _piper_worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import piper_compile as piper

    base = _rss_now()
    model = _meta_gpt(job["model"])
    if job["variant"] == "piper-pp4":
        model.annotate_stages(world)
        directives = [*piper.pipeline(world), piper.split(4), *piper.schedules.one_f_one_b(world, 4)]
    else:
        directives = [piper.replicate(zero=3, bucket_mb=job["bucket_mb"]), piper.split(1)]
    load = job["variant"] == "piper-load"
    step = piper.compile(model, directives=directives, codegen="eager", init="checkpoint" if load else "module",
                         optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    times = []
    n = job["batch"]
    for s in range(2):
        x, y = _batch(model, s, n * (4 if job["variant"] == "piper-pp4" else world))  # PP4: 4 micro-batches
        if job["variant"] != "piper-pp4":
            x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        t0 = time.perf_counter()
        if load and s == 0:
            piper.load(step, job["hf_dir"])
        step(x, y).item()
        times.append(time.perf_counter() - t0)
    mem = piper.memory_report(step).predicted
    out = {"base": base, "peak": _peak_rss(), "times": times, "share": (mem.params + mem.grads + mem.optimizer) / MiB,
           "act": (mem.peak_activations + mem.peak_gathered_params + max(0, mem.peak_grad_buckets - mem.grads)) / MiB}
    out["steps_peak"] = _peak_rss()  # before the save's gathers
    if job["variant"] == "piper-pp4" and job.get("save_to"):
        t0 = time.perf_counter()
        piper.save(step, job["save_to"], format="hf", max_shard_mb=256)
        out["save_s"] = time.perf_counter() - t0
    return out


def _fsdp_worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    base = _rss_now()
    mesh = init_device_mesh("cpu", (world,))
    t0 = time.perf_counter()
    model = _meta_gpt(job["model"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    init_s = time.perf_counter() - t0
    times = []
    n = job["batch"]
    for s in range(2):
        x, y = _batch(model, s, n * world)
        t0 = time.perf_counter()
        loss = model(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0 + (init_s if s == 0 else 0.0))
    params = sum(p.numel() for p in model.parameters())
    return {"base": base, "peak": _peak_rss(), "times": times, "share": 16 * params / world / MiB, "act": None}


def _run(variant: str, job: dict[str, Any]) -> list[dict[str, Any]] | str:
    job = {**job, "variant": variant}
    worker = _fsdp_worker if variant == "fsdp2" else _piper_worker
    try:
        return run_local(worker, WORLD, job, timeout_s=job["timeout"])
    except Exception as e:  # noqa: BLE001 - print it and go on with the other variants
        return f"{type(e).__name__}: {str(e)[-600:]}"


def _report(variant: str, res: list[dict[str, Any]] | str) -> None:
    if isinstance(res, str):
        print(f"{variant:12} FAILED: {res}")
        return
    for rank, r in enumerate(res):
        used = r["peak"] - r["base"]
        if r["act"] is None:  # the peer: no activation estimate to hold it to
            verdict = f"share {r['share']:8.0f} (peer, no activation estimate)"
        else:
            plan = r["share"] + r["act"]
            verdict = (f"share {r['share']:8.0f} + act {r['act']:6.0f}  {'within' if used <= 1.1 * plan else 'OVER'} "
                       f"+10% ({used / max(plan, 1e-9):.2f}x)")
        print(f"{variant:12} rank {rank}  peak RSS {r['peak']:8.0f} MiB  base {r['base']:5.0f}  peak-base {used:8.0f}  "
              f"{verdict}  first step {r['times'][0]:6.1f} s  "
              f"second {r['times'][1]:5.1f} s" + (f"  hf save {r['save_s']:.1f} s (peak-base before it "
                                                   f"{r['steps_peak'] - r['base']:.0f})" if "save_s" in r else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank (PP4: per micro-batch)")
    p.add_argument("--bucket-mb", type=float, default=200.0, help="ZeRO-3 bucket size")
    p.add_argument("--variants", nargs="+", default=["piper-pp4", "piper-zero3", "piper-load", "fsdp2"])
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args()
    cfg = {"dim": a.dim, "layers": a.layers, "heads": a.heads, "seq": a.seq, "vocab": a.vocab}
    n_params = sum(t.numel() for t in _meta_gpt(cfg).parameters())
    full = 16 * n_params / 2**30
    print(f"bench_big_model: GPT {cfg}: {n_params / 1e9:.2f}B parameters ({4 * n_params / 2**30:.1f} GiB fp32); "
          f"AdamW state over the world {full:.1f} GiB; the full model on each of {WORLD} ranks would need "
          f"{WORLD * full:.1f} GiB; torch {torch.__version__}, piper {piper_revision()}, {load_note()}")
    tmp = tempfile.mkdtemp(prefix="piper-big-")
    hf_dir = os.path.join(tmp, "hf")
    job = {"model": cfg, "batch": a.batch, "bucket_mb": a.bucket_mb, "timeout": a.timeout, "hf_dir": hf_dir,
           "save_to": hf_dir if "piper-load" in a.variants else None}
    try:
        for variant in a.variants:
            res = _run(variant, job)
            _report(variant, res)
            sys.stdout.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"after: {load_note()}")


if __name__ == "__main__":
    main()
