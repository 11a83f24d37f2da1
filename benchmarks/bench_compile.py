"""Time to the first step: piper's capture + plan + compile against ``torch.compile`` of the same model.

For the bench GPT (``piper_compile.testing.models.GPT``) at each ``--layers``, every variant runs in fresh
processes twice: *cold* with an empty Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``), then *warm*
with the directory the cold run filled. Per run the table shows the first step's wall time (the slowest
rank: Dynamo trace, capture, planning, compilation and one training step) and the CPU seconds of all ranks
during it (compilation is CPU work; on 2 shared cores ranks compiling at once slow each other down).

    torch.compile     torch.compile(model) in one process: forward, backward, AdamW step
    DDP2              DDP(model) then torch.compile, 2 ranks
    piper DP2         replicate(), 2 ranks
    piper PP2 1F1B    pipeline(2), 4 micro-batches, 2 ranks
    piper PP2xDP2 Z3  pipeline(2) x replicate(zero=3), 4 ranks
    piper DualPipeV   dualpipe_v(2, 4), 2 ranks

Each piper variant compiles repeated blocks once (regional compilation, ``codegen/regional.py``); with
``--whole`` it also runs with ``PIPER_REGIONAL=0`` (each segment one graph). ``piper.compile`` traces
repeated blocks once (nested compile regions, ``capture/blocks.py``); ``--flat`` also runs each piper
variant with ``PIPER_NESTED_REGIONS=off`` (every block traced and exported). ``piper.compile`` keeps its
trace of the forward on disk, so a warm run runs no Dynamo trace (``capture/forward_cache.py``); ``--dynamo``
also runs each piper variant with ``PIPER_FORWARD_CACHE=off`` (Dynamo traces every run). ``step ms`` is the mean of
the next 5 steps of the warm run (the slowest rank): what regional compilation costs at run time.
``cold RSS MiB`` is the largest peak RSS of a rank process in the cold run (Inductor's compile workers are
processes of their own): run once with ``PIPER_PRECOMPILE=0`` to see what precompiling costs in memory.

Targets (issue 19): cold first step <= 1.5x single-process torch.compile; warm <= 20% of cold; 32 layers
<= 1.5x 8 layers (repeated blocks compile once).

    python benchmarks/bench_compile.py --layers 8 32
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

VARIANTS = ("torch.compile", "DDP2", "piper DP2", "piper PP2 1F1B", "piper PP2xDP2 Z3", "piper DualPipeV")
WHOLE = " (whole)"  # the same piper variant with PIPER_REGIONAL=0: every segment compiled as one graph
FLAT = " (flat)"  # the same piper variant with PIPER_NESTED_REGIONS=off: every block traced and exported
DYNAMO = " (dynamo)"  # the same piper variant with PIPER_FORWARD_CACHE=off: Dynamo traces the forward every run


def _base_variant(variant: str) -> str:
    return variant.replace(WHOLE, "").replace(FLAT, "").replace(DYNAMO, "")
STEADY = 5  # steps timed after the first (the steady step time, from the warm run)
WORLD = {"torch.compile": 1, "DDP2": 2, "piper DP2": 2, "piper PP2 1F1B": 2, "piper PP2xDP2 Z3": 4,
         "piper DualPipeV": 2}


def _cpu() -> float:
    """CPU seconds of this process and its waited-for children (the compilers it ran itself); Inductor's
    pool of compile workers, alive until exit, is not in it."""
    ru, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime + ch.ru_utime + ch.ru_stime


def _directives(variant: str) -> tuple[list[Any], int]:
    """(directives, pipeline stages to tag) of a piper variant."""
    import piper_compile as piper

    S = piper.schedules
    if variant == "piper DP2":
        return [piper.replicate(), piper.split(1)], 1
    if variant == "piper PP2 1F1B":
        return [*piper.pipeline(2), piper.split(4), *S.one_f_one_b(2, 4)], 2
    if variant == "piper PP2xDP2 Z3":
        return [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(4), *S.one_f_one_b(2, 4),
                piper.replicate({"PP": "*"}, zero=3)], 2
    return [piper.split(4), *S.dualpipe_v(2, 4)], 4


def _worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, float]:
    variant = _base_variant(job["variant"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(**job["model"]))
    x, y = model.make_batch(job["batch"], torch.Generator().manual_seed(0))
    t0, c0 = time.perf_counter(), _cpu()
    if variant in ("torch.compile", "DDP2"):
        net: Any = model
        if variant == "DDP2":
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(model)
        compiled = torch.compile(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            compiled(x, y).backward()
            opt.step()
            opt.zero_grad()

        step(x, y)
    else:
        import piper_compile as piper

        directives, stages = _directives(variant)
        if stages > 1:
            model.annotate_stages(stages)
        step = piper.compile(model, directives=directives, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
        step(x, y)
    first, cpu = time.perf_counter() - t0, _cpu() - c0
    t1 = time.perf_counter()
    for _ in range(STEADY):
        step(x, y)
    return {"wall": first, "cpu": cpu, "step": (time.perf_counter() - t1) / STEADY,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run(variant: str, job: dict[str, Any], cache: str) -> tuple[float, float, float, float] | str:
    """(first step wall s of the slowest rank, CPU s of all ranks, steady step s, the largest peak RSS of
    a rank in MiB) or why it failed."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # run_local hands the environment to the ranks
    os.environ["PIPER_REGIONAL"] = "0" if WHOLE in variant else "1"
    os.environ["PIPER_NESTED_REGIONS"] = "off" if FLAT in variant else "auto"
    os.environ["PIPER_FORWARD_CACHE"] = "off" if DYNAMO in variant else "auto"
    try:
        res = run_local(_worker, WORLD[_base_variant(variant)], {**job, "variant": variant},
                        timeout_s=job["timeout"])
    except Exception as e:  # noqa: BLE001 - report and go on
        return f"{type(e).__name__}: {str(e)[-300:]}"
    return (max(r["wall"] for r in res), sum(r["cpu"] for r in res), max(r["step"] for r in res),
            max(r["rss"] for r in res))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--whole", action="store_true", help="also run each piper variant without regional compilation")
    p.add_argument("--flat", action="store_true", help="also run each piper variant without nested compile regions")
    p.add_argument("--dynamo", action="store_true", help="also run each piper variant with Dynamo tracing every run")
    a = p.parse_args()
    for flag, suffix in ((a.whole, WHOLE), (a.flat, FLAT), (a.dynamo, DYNAMO)):
        if flag:
            a.variants = [v for var in a.variants for v in ([var, var + suffix] if var.startswith("piper") else [var])]
    print(f"bench_compile: GPT dim={a.dim} heads={a.heads} seq={a.seq} vocab={a.vocab}, batch {a.batch}/rank, AdamW; "
          f"torch {torch.__version__}, piper {piper_revision()}, {load_note()}")
    print(f"{'variant':26} {'layers':>6} {'cold s':>8} {'cpu s':>8} {'warm s':>8} {'cpu s':>8} {'warm/cold':>9} "
          f"{'cold / torch.compile':>21} {'step ms':>8} {'cold RSS MiB':>12}")
    base: dict[int, float] = {}
    cold_by: dict[tuple[str, int], float] = {}
    for layers in a.layers:
        job = {"model": {"dim": a.dim, "layers": layers, "heads": a.heads, "seq": a.seq, "vocab": a.vocab},
               "batch": a.batch, "timeout": a.timeout}
        for variant in a.variants:
            cache = tempfile.mkdtemp(prefix="piper-bench-inductor-")
            try:
                cold, warm = _run(variant, job, cache), _run(variant, job, cache)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            if isinstance(cold, str) or isinstance(warm, str):
                print(f"{variant:26} {layers:6} FAILED: {cold if isinstance(cold, str) else warm}")
                continue
            if variant == "torch.compile":
                base[layers] = cold[0]
            cold_by[(variant, layers)] = cold[0]
            ratio = f"{cold[0] / base[layers]:.2f}x" if layers in base else "-"
            print(f"{variant:26} {layers:6} {cold[0]:8.1f} {cold[1]:8.1f} {warm[0]:8.1f} {warm[1]:8.1f} "
                  f"{warm[0] / cold[0]:9.2f} {ratio:>21} {warm[2] * 1e3:8.1f} {cold[3]:12.0f}")
            sys.stdout.flush()
    if len(a.layers) > 1:
        lo, hi = min(a.layers), max(a.layers)
        for variant in a.variants:
            if (variant, lo) in cold_by and (variant, hi) in cold_by:
                print(f"{variant:26} cold {hi} layers / {lo} layers: {cold_by[(variant, hi)] / cold_by[(variant, lo)]:.2f}x")
    print(f"after: {load_note()}")


if __name__ == "__main__":
    main()
