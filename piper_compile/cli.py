"""``python -m piper_compile explain``: plan a strategy for a built-in model (or the user's, ``--model
pkg.module:factory``) at any world size, verify every rank's program and print them; ``autoplan``: search
and rank strategies for a world and a memory budget -- no processes launched."""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from piper_compile.errors import PiperError


def _directives(args: argparse.Namespace) -> list:
    import piper_compile as piper

    if args.directives:
        with open(args.directives) as f:
            return json.load(f)
    stages, dp, m = args.stages, args.dp, args.microbatches
    out: list = []
    if stages > 1:
        out += piper.pipeline(stages, ranks=[[s + stages * r for r in range(dp)] for s in range(stages)])
    if dp > 1:
        out.append(piper.replicate({"PP": "*"} if stages > 1 else {}, zero=args.zero, bucket_mb=args.bucket_mb))
    out.append(piper.split(m))
    if stages > 1:
        sched = piper.schedules.one_f_one_b if args.schedule == "1f1b" else piper.schedules.gpipe
        out += sched(stages, m)
    return out


BUILT_IN = ("mlp", "skip", "gpt", "moegpt")


def load_model(spec: str, batch: int, depth: int | None = None, dim: int | None = None,
               fake: bool = True) -> tuple[torch.nn.Module, tuple]:
    """A model and an example batch of ``batch`` rows: a built-in toy model (``BUILT_IN``), or the user's
    ``pkg.module:factory`` -- a callable returning a model with ``make_batch(n, generator)``, or a
    ``(model, batch)`` pair. ``fake``: parameters are fake (meta storage, no memory), so plans for models
    of any size fit on this machine (the meta device itself loses nll_loss's backward in the joint trace)."""
    import contextlib
    import importlib

    with FakeTensorMode() if fake else contextlib.nullcontext():
        if spec in BUILT_IN:
            from piper_compile.testing.models import build_model

            sizes: dict = {}
            if depth:
                sizes["layers" if spec.endswith("gpt") else "depth"] = depth
            if dim:
                sizes["dim"] = dim
            made: object = build_model(spec, **sizes)
        else:
            module, _, name = spec.partition(":")
            try:
                factory = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise PiperError(f"piper: --model {spec!r}: cannot load it ({e}); write a built-in name "
                                 f"{list(BUILT_IN)} or pkg.module:factory") from None
            made = factory()
        if isinstance(made, tuple):
            return made[0], tuple(made[1])
        if not hasattr(made, "make_batch"):
            raise PiperError(f"piper: --model {spec!r}: the factory returned a {type(made).__name__} without "
                             "make_batch(n, generator); return (model, example_batch) instead")
        return made, tuple(made.make_batch(batch, torch.Generator().manual_seed(0)))  # type: ignore[union-attr]


def explain(args: argparse.Namespace) -> int:
    import piper_compile as piper

    model, batch = load_model(args.model, args.batch, max(4, args.stages), args.dim)
    if args.stages > 1:
        model.annotate_stages(args.stages)
    world = args.world_size or args.stages * args.dp
    t0 = time.perf_counter()
    # ZeRO runs piper's optimizer: any elementwise one plans the same
    options = {"optimizer": functools.partial(torch.optim.AdamW, lr=1e-3)} if args.zero else None
    result = piper.plan(model, *batch, directives=_directives(args), world_size=world, options=options)
    dt = time.perf_counter() - t0
    if args.cmd == "explain":
        _show_programs(result.programs, args.ranks, args.verbose)
    classes = result.programs.symmetry.classes
    print(f"# {world} ranks in {len(classes)} classes of identical programs, {len(result.dag)} DAG nodes "
          f"({result.dag.summary()}); verified in {dt:.2f}s")
    _report_simulation(result, args)
    if args.cmd == "explain":
        _report_memory(result, args.ranks)
    return 0


def _show_programs(programs: Any, ranks: list[int] | None, verbose: bool) -> None:
    """The programs of ``ranks``, or one per class of ranks with the same program up to rank ids, each
    with the ranks it stands for."""
    def show(p: Any, note: str = "") -> None:
        lines = p.to_text().splitlines()
        print(lines[0] + note)
        if verbose:
            print("\n".join(lines[1:]))

    if ranks is not None:
        for r in ranks:
            show(programs[r])
        return
    for rep, members in programs.symmetry.classes.items():
        if len(members) == 1:
            show(programs[rep])
        else:
            listed = ", ".join(map(str, members[1:4])) + (", ..." if len(members) > 4 else "")
            show(programs[rep], f"\n  (the same program, own peers, on {len(members) - 1} more ranks: {listed})")


def _report_memory(result: "piper.StaticPlan", ranks: list[int] | None) -> None:  # noqa: F821
    """Predicted memory of the ranks shown (default: rank 0 and the rank with the highest peak)."""
    memory = result.memory
    worst = max(memory.reps.values(), key=lambda m: m.figures.peak_total)  # one per class
    for r in sorted(set(ranks) if ranks is not None else {0, worst.rank}):
        print("# memory " + str(memory[r]).replace("\n", "\n# "))


def _report_simulation(result: object, args: argparse.Namespace) -> None:
    from piper_compile.sim import FlopCost, draw_grid, simulate_plan, write_trace

    t0 = time.perf_counter()
    sim = simulate_plan(result, FlopCost(flops_per_s=args.flops, bytes_per_s=args.bandwidth,
                                         latency_s=args.latency))
    dt = time.perf_counter() - t0
    bubble = 1 - sum(sim.busy.values()) / (sim.step_time * len(sim.ranks)) if sim.step_time else 0.0
    peak = max(sim.peak_bytes.values()) if sim.peak_bytes else 0
    print(f"# predicted step {sim.step_time * 1e3:.3f} ms, bubble {bubble:.1%}, peak memory per rank "
          f"{peak / 2**20:.2f} MiB (rank 0: {sim.peak_bytes.get(0, 0) / 2**20:.2f} MiB); simulated in {dt:.2f}s "
          f"(FLOP model: {args.flops:.3g} FLOP/s, {args.bandwidth:.3g} B/s)")
    if args.trace:
        write_trace(sim, args.trace)
        print(f"# trace: {args.trace}")
    if args.grid:
        draw_grid(sim, args.grid)
        print(f"# grid: {args.grid}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_compile", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("explain", help="plan, verify and print per-rank programs, with predicted time/memory")
    _add_plan_args(e)
    s = sub.add_parser("simulate", help="plan, verify and report predicted step time, bubble and memory")
    _add_plan_args(s)
    sub.add_parser("knobs", help="print the table of every PIPER_* environment variable (README's table)")
    a = sub.add_parser("autoplan", help="search strategies for a world and a memory budget; print them ranked")
    _add_autoplan_args(a)
    args = p.parse_args(argv)
    if args.cmd == "autoplan":
        return _guarded(autoplan, args)
    if args.cmd == "knobs":
        from piper_compile.knobs import markdown_table

        print(markdown_table())
        return 0
    return _guarded(explain, args)


def _guarded(fn: Any, args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except PiperError as err:
        print(err, file=sys.stderr)
        return 2


def autoplan(args: argparse.Namespace) -> int:
    import piper_compile as piper

    model, batch = load_model(args.model, args.batch, args.layers, args.dim)
    network = json.loads(args.network) if args.network.startswith("{") else args.network
    res = piper.autoplan(model, *batch, world_size=args.world_size, memory_mb=args.memory_mb, network=network,
                         flops_per_s=args.flops, top=args.top, schedules=args.schedules, zero_levels=args.zero,
                         tp_plan=json.loads(args.tp_plan) if args.tp_plan else None, workers=args.workers,
                         expert_load=args.expert_load)
    print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"label": c.candidate.label(), "directives": c.directives, "block_stages": c.block_stages,
                        "step_time_s": c.step_time, "peak_mb": c.max_peak_mb} for c in res.ranked], f, indent=1)
        print(f"# directives of the ranked strategies: {args.json}")
    return 0


def _add_autoplan_args(a: argparse.ArgumentParser) -> None:
    from piper_compile.autoplan import NETWORKS
    from piper_compile.autoplan.space import SCHEDULES

    a.add_argument("--model", default="gpt", help=f"one of {list(BUILT_IN)} or pkg.module:factory")
    a.add_argument("--world-size", type=int, required=True)
    a.add_argument("--memory-mb", type=float, default=None, help="per-rank memory budget (MiB)")
    a.add_argument("--network", default="ethernet", help=f"one of {sorted(NETWORKS)}, measured (this machine's "
                   "link between two local ranks) or a JSON object "
                   '{"pp": [bytes_per_s, latency_s], "dp": ...}')
    a.add_argument("--flops", type=float, default=1e12, help="FLOP/s per rank")
    a.add_argument("--batch", type=int, default=16, help="global batch")
    a.add_argument("--layers", type=int, default=None, help="blocks of a built-in model")
    a.add_argument("--dim", type=int, default=None, help="width of a built-in model")
    a.add_argument("--top", type=int, default=5)
    a.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=list(SCHEDULES))
    a.add_argument("--zero", type=int, nargs="*", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    a.add_argument("--json", help="write the ranked strategies' directives here")
    a.add_argument("--workers", type=int, default=None, help="processes planning side by side, one captured "
                   "graph each (default: one per core)")
    a.add_argument("--tp-plan", help='search tensor parallelism too: a JSON object of shard_tensor layers, e.g. '
                   '{"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise"}')
    a.add_argument("--expert-load", type=float, default=1.0, help="MoE models: plan expert parallelism for a "
                   "router whose busiest rank receives this many times its share (shard's load)")


def _add_plan_args(e: argparse.ArgumentParser) -> None:
    e.add_argument("--model", default="gpt", help=f"one of {list(BUILT_IN)} or pkg.module:factory (a callable "
                   "returning a model with make_batch(n, generator), or (model, batch))")
    e.add_argument("--stages", type=int, default=2)
    e.add_argument("--dp", type=int, default=1)
    e.add_argument("--microbatches", type=int, default=4)
    e.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    e.add_argument("--batch", type=int, default=8, help="local batch per replica")
    e.add_argument("--dim", type=int, default=None, help="model width (parameters are fake: any size fits)")
    e.add_argument("--world-size", type=int, default=None, help="default: stages * dp")
    e.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage of the data parallelism")
    e.add_argument("--bucket-mb", type=float, default=25.0, help="gradient / shard bucket size in MB")
    e.add_argument("--directives", help="a JSON file of directives (overrides --stages/--dp/...)")
    e.add_argument("--ranks", type=int, nargs="*", help="only print these ranks")
    e.add_argument("-v", "--verbose", action="store_true", help="one line per instruction")
    e.add_argument("--flops", type=float, default=1e12, help="cost model: FLOP/s per rank")
    e.add_argument("--bandwidth", type=float, default=10e9, help="cost model: bytes/s per link")
    e.add_argument("--latency", type=float, default=10e-6, help="cost model: seconds per message")
    e.add_argument("--trace", help="write the simulated Chrome/Perfetto trace here (.json)")
    e.add_argument("--grid", help="draw the simulated schedule grid here (.svg)")


if __name__ == "__main__":
    sys.exit(main())
