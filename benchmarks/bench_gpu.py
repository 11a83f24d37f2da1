"""Single-device throughput: piper (one rank, micro-batched, Inductor) vs ``torch.compile`` of the same
GPT with the same optimizer, in bf16 with fp32 master weights.

    piper  piper.compile(model, directives=[split(M)], mixed_precision={"param_dtype": "bf16"},
           optimizer=AdamW): a bf16 compute copy, M micro-batches, gradients accumulated in fp32
    peer   torch.compile(model) under torch.autocast(bf16) on the whole batch, fp32 parameters,
           loss.backward(); AdamW.step() (the usual AMP recipe)
    accum  the same torch.compile peer accumulating gradients over the same M micro-batches (each loss
           scaled by 1/M): the cost of micro-batching itself (M times the host's kernel launches for
           the same work), which piper's ratio against ``peer`` includes

Both use the AdamW piper builds (``runtime/optimizer.build_optimizer``: fused where that updates like the
default). Per variant: median step time of ``--steps`` timed steps after ``--warmup`` (the device is
synchronised around each step), tokens/s, MFU (the FLOPs of piper's captured graph, the same work for
both, over the device peak of ``metrics.peak_tflops``) and the allocator's peak memory (CUDA; on CPU the
process's peak RSS), and how long the host took to return from the step (near the step time: bound by
the host issuing kernels). ``--out DIR`` also writes the Perfetto trace of one piper step
(``DIR/trace/``), ``DIR/bench_gpu.json`` and, per variant, the profiled step's table of host ops
(``DIR/profile_*.txt``). ``--variants`` times piper again with one micro-batch, without regional
compilation, on twice the batch (against the peer on that batch), or with the whole step replayed as one
CUDA graph (``options["cuda_graph"]``; CUDA only). The default model is ~350M parameters (``--preset 350m``); ``--preset
tiny`` runs in seconds (the CPU smoke run of ``scripts/gpu_check.sh``), where the ratio means little.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
from collections import Counter
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import piper_compile as piper  # noqa: E402
from piper_compile.metrics import peak_tflops  # noqa: E402
from piper_compile.runtime.optimizer import build_optimizer  # noqa: E402
from piper_compile.testing.models import GPT, GPTConfig  # noqa: E402

PRESETS = {"350m": GPTConfig(vocab=50304, seq=1024, dim=1024, heads=16, layers=24),
           "125m": GPTConfig(vocab=50304, seq=1024, dim=768, heads=12, layers=12),
           "tiny": GPTConfig(vocab=256, seq=64, dim=64, heads=4, layers=2)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _time(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> tuple[float, float, float]:
    """(first step's seconds, median seconds of the timed steps, median seconds until the step returned
    on the host: near the step time, the step is bound by the host issuing its kernels)."""
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    times, host = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), statistics.median(host)


def _device_busy(step: Callable[[], Any], device: torch.device, table: Path | None = None) -> dict:
    """One more step under ``torch.profiler``: its wall time, and on CUDA how long the device was busy
    (the union of its kernels' and copies' intervals), how many it ran, how long the host took to its
    first one, and the host ops that took most of its own time (each with its most frequent callers).
    A step whose device is busy for a small part of its time is bound by the host issuing its kernels.
    ``table``: where to write the profiler's table of host ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    _sync(device)
    try:  # a measurement beside the benchmark's: a profiler failure must not cost its figures
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            t0 = time.perf_counter()
            step()
            _sync(device)
            wall = time.perf_counter() - t0
        events = list(prof.events())
        if table is not None:
            table.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40,
                                                       max_name_column_width=90))
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        return {"profiled_s": None, "device_busy_s": None, "device_ops": 0, "profile_error": f"{type(e).__name__}: {e}"[:300]}
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy, end = busy + hi - max(lo, end), hi
    busy_s = busy / 1e6 if cuda else None
    host = [e for e in events if e.device_type == DeviceType.CPU]
    first = (spans[0][0] - min(e.time_range.start for e in host)) / 1e6 if spans and host else None
    return {"profiled_s": wall, "device_busy_s": busy_s, "device_busy_share": busy_s / wall if cuda else None,
            "device_ops": len(spans), "first_device_op_s": first, "top_host_ops": _top_host(host)}


def _top_host(host: list[Any], n: int = 12) -> list[dict]:
    """The ``n`` host ops with the most self time in a profiled step: name, calls, self milliseconds and
    the most frequent chain of their three nearest callers (where an op is called from)."""
    by: dict[str, dict] = {}
    for e in host:
        r = by.setdefault(e.name, {"name": e.name, "calls": 0, "self_ms": 0.0, "callers": Counter()})
        r["calls"] += 1
        r["self_ms"] += e.self_cpu_time_total / 1e3
        chain, q = [], e.cpu_parent
        while q is not None and len(chain) < 3:
            chain.append(q.name[:60])
            q = q.cpu_parent
        r["callers"][" <- ".join(chain)] += 1
    top = sorted(by.values(), key=lambda r: -r["self_ms"])[:n]
    return [{**r, "self_ms": round(r["self_ms"], 3), "callers": r["callers"].most_common(1)[0][0]} for r in top]


def _model(cfg: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg).to(device)


def _table(args: argparse.Namespace, name: str) -> Path | None:
    """Where the profiled step's table of host ops goes (``--out``), for variant ``name``."""
    return Path(args.out) / f"profile_{name}.txt" if args.out else None


def run_piper(cfg: GPTConfig, args: argparse.Namespace, batch: tuple[torch.Tensor, ...], device: torch.device,
              microbatches: int | None = None, name: str = "piper") -> dict:
    """piper's step (``microbatches``: the ``split`` count, the run's by default); the main run (``name``
    "piper") also writes one step's Perfetto trace under ``--out``."""
    model = _model(cfg, device)
    opt = functools.partial(torch.optim.AdamW, lr=1e-4)
    step = piper.compile(model, directives=[piper.split(microbatches or args.microbatches)], optimizer=opt,
                         codegen=args.codegen, mixed_precision={"param_dtype": "bf16"})
    _reset_peak(device)
    first, median, host = _time(lambda: step(*batch), device, args.warmup, args.steps)
    metrics = piper.stats(step)
    out = {"first_s": first, "step_s": median, "host_s": host, "peak_bytes": _peak_bytes(device),
           "flops": metrics.flops, "loss": float(step(*batch).detach()),
           **_device_busy(lambda: step(*batch), device, _table(args, name))}
    if args.out and name == "piper":  # one more step with the recorder on: its Perfetto trace
        from piper_compile.runtime.trace import Recorder, flush_traces

        cs = piper.compiled_steps(step)[0]
        ex = cs.plans[False].executor
        ex.rec = Recorder(ex.program, Path(args.out) / "trace")
        step(*batch)
        flush_traces()
        out["trace"] = str(Path(args.out) / "trace" / "rank0.json")
    return out


# name -> (environment, split count, batch multiple); a variant on another batch is compared with the peer
# on that batch (timed with it)
VARIANTS = {"split1": ({}, 1, 1), "noregional": ({"PIPER_REGIONAL": "0"}, None, 1), "batch2x": ({}, None, 2),
            "cudagraph": ({"PIPER_CUDA_GRAPH": "1"}, None, 1)}


def run_variants(cfg: GPTConfig, args: argparse.Namespace, batch: tuple[torch.Tensor, ...], device: torch.device,
                 peer_s: float) -> dict:
    """piper again for each of ``--variants`` (one micro-batch; regional compilation off; twice the
    batch, micro-batches twice as large; the step replayed as a CUDA graph), for the next change's direction: step and host seconds, the
    ratio to the peer, the device's busy share. A variant that fails is reported, not raised."""
    out = {}
    for name in [v for v in args.variants.split(",") if v]:
        env, micro, times = VARIANTS[name]
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            torch._dynamo.reset()
            rows = tuple(torch.cat([t] * times) for t in batch) if times > 1 else batch
            base = peer_s if times == 1 else run_peer(cfg, args, rows, device, name=f"peer_{name}")["step_s"]
            torch._dynamo.reset()
            r = run_piper(cfg, args, rows, device, micro, name)
            out[name] = {k: r.get(k) for k in ("first_s", "step_s", "host_s", "device_busy_share", "device_ops",
                                               "first_device_op_s", "peak_bytes")}
            out[name].update(ratio=r["step_s"] / base, peer_s=base, batch=len(rows[0]))
        except Exception as e:  # noqa: BLE001 - a variant is a measurement beside the benchmark's
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "ratio": float("nan")}
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return out


def run_peer(cfg: GPTConfig, args: argparse.Namespace, batch: tuple[torch.Tensor, ...], device: torch.device,
             microbatches: int = 1, name: str = "") -> dict:
    """torch.compile's step on the whole batch, or with ``microbatches`` > 1 accumulating the gradients of
    that many slices (each loss scaled by 1/M), as a user of torch.compile micro-batches."""
    model = _model(cfg, device)
    opt = build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-4), list(model.parameters()))
    compiled = torch.compile(model, backend="inductor" if args.codegen == "inductor" else "aot_eager")
    slices = list(zip(*(t.chunk(microbatches) for t in batch)))

    def step() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for part in slices:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = compiled(*part) / microbatches
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    _reset_peak(device)
    first, median, host = _time(step, device, args.warmup, args.steps)
    return {"first_s": first, "step_s": median, "host_s": host, "peak_bytes": _peak_bytes(device),
            "loss": float(step().detach()), **_device_busy(step, device, _table(args, name or f"peer{microbatches}"))}


def _busy_text(mine: dict, peer: dict, accum: dict) -> str:
    """``  device busy: piper 41% of a profiled step (6,120 kernels and copies), ...`` (CUDA only)."""
    if mine.get("device_busy_share") is None:
        return ""
    parts = [f"{name} {100 * r['device_busy_share']:.0f}% of a profiled step ({r['device_ops']:,} "
             f"kernels and copies)" for name, r in (("piper", mine), ("torch.compile", peer), ("accumulating", accum))]
    return "  device busy: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="350m")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--out", default="", help="folder for bench_gpu.json, the Perfetto trace and the profiled "
                   "steps' tables of host ops (profile_*.txt)")
    p.add_argument("--variants", default="", help=f"comma-separated piper variants also timed: {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    cfg = PRESETS[args.preset]
    gen = torch.Generator().manual_seed(0)
    batch = tuple(t.to(device) for t in GPT(cfg).make_batch(args.batch, gen))
    nparams = sum(p.numel() for p in GPT(cfg).parameters())
    peer = run_peer(cfg, args, batch, device)
    torch._dynamo.reset()
    accum = run_peer(cfg, args, batch, device, args.microbatches) if args.microbatches > 1 else peer
    torch._dynamo.reset()
    mine = run_piper(cfg, args, batch, device)
    peak, source = peak_tflops(device, torch.bfloat16)
    tokens = args.batch * cfg.seq
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "params": nparams, "preset": args.preset, "batch": args.batch, "seq": cfg.seq,
              "microbatches": args.microbatches, "tokens_per_step": tokens, "peak_tflops": peak, "peak_source": source,
              "piper": mine, "peer": peer, "ratio": mine["step_s"] / peer["step_s"],
              "peer_accum": accum, "ratio_accum": mine["step_s"] / accum["step_s"], "variants": {}}
    for r in (mine, peer, accum):
        r["tokens_per_s"] = tokens / r["step_s"]
        r["mfu"] = mine["flops"] / r["step_s"] / 1e12 / peak if peak else 0.0
    if args.out:  # the main figures first: a run stopped in the variants still reports them
        Path(args.out, "bench_gpu.json").write_text(json.dumps(result, indent=1))
    result["variants"] = run_variants(cfg, args, batch, device, peer["step_s"])
    print(_summary(result, cfg), flush=True)
    if args.out:
        Path(args.out, "bench_gpu.json").write_text(json.dumps(result, indent=1))
    return result


def _summary(r: dict, cfg: GPTConfig) -> str:
    """The one-line report of :func:`main`'s ``result``."""
    mine, peer, accum = r["piper"], r["peer"], r["peer_accum"]
    variants = "".join(f"  {name}: " + (f"failed ({v['error']})" if "error" in v else
                                         f"{v['step_s'] * 1e3:.1f} ms, ratio {v['ratio']:.3f} (batch {v['batch']})")
                       for name, v in r["variants"].items())
    return (f"bench_gpu {r['preset']} ({r['params'] / 1e6:.0f}M params, {r['device']}, bf16, batch {r['batch']} x "
            f"{cfg.seq}, {r['microbatches']} micro-batches): piper {mine['step_s'] * 1e3:.1f} ms  torch.compile "
            f"{peer['step_s'] * 1e3:.1f} ms  ratio piper/peer {r['ratio']:.3f}  (throughput "
            f"{1 / r['ratio']:.3f}x); against torch.compile accumulating the same {r['microbatches']} micro-batches "
            f"{accum['step_s'] * 1e3:.1f} ms, ratio {r['ratio_accum']:.3f}  tok/s {mine['tokens_per_s']:,.0f} vs "
            f"{peer['tokens_per_s']:,.0f}  MFU {100 * mine['mfu']:.1f}% vs {100 * peer['mfu']:.1f}%  peak mem "
            f"{mine['peak_bytes'] / 2**30:.2f} vs {peer['peak_bytes'] / 2**30:.2f} GiB  host returned after "
            f"{mine['host_s'] * 1e3:.1f} vs {peer['host_s'] * 1e3:.1f} ms{_busy_text(mine, peer, accum)}{variants}")

if __name__ == "__main__":
    main()
