"""``python -m piper_compile explain``: plan a strategy for a built-in model at any world size, verify
every rank's program and print them -- no processes launched."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

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
        out.append(piper.replicate({"PP": "*"} if stages > 1 else {}))
    out.append(piper.split(m))
    if stages > 1:
        sched = piper.schedules.one_f_one_b if args.schedule == "1f1b" else piper.schedules.gpipe
        out += sched(stages, m)
    return out


def explain(args: argparse.Namespace) -> int:
    import piper_compile as piper
    from piper_compile.testing.models import build_model

    depth = max(4, args.stages)
    # CPU parameters: the built-in models are small. (On the meta device the joint trace loses the
    # loss's backward: aten::nll_loss has no meta autograd kernel.)
    model = build_model(args.model, **({"layers": depth} if args.model == "gpt" else {"depth": depth}))
    if args.stages > 1:
        model.annotate_stages(args.stages)
    batch = model.make_batch(args.batch, torch.Generator().manual_seed(0))
    world = args.world_size or args.stages * args.dp
    t0 = time.perf_counter()
    result = piper.plan(model, *batch, directives=_directives(args), world_size=world)
    dt = time.perf_counter() - t0
    shown = result.programs if args.ranks is None else [result.programs[r] for r in args.ranks]
    for p in shown:
        print(p.to_text() if args.verbose else p.to_text().splitlines()[0])
    print(f"# {world} ranks, {len(result.dag)} DAG nodes ({result.dag.summary()}); verified in {dt:.2f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_compile", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("explain", help="plan, verify and print per-rank programs")
    e.add_argument("--model", choices=["mlp", "skip", "gpt"], default="gpt")
    e.add_argument("--stages", type=int, default=2)
    e.add_argument("--dp", type=int, default=1)
    e.add_argument("--microbatches", type=int, default=4)
    e.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    e.add_argument("--batch", type=int, default=8, help="local batch per replica")
    e.add_argument("--world-size", type=int, default=None, help="default: stages * dp")
    e.add_argument("--directives", help="a JSON file of directives (overrides --stages/--dp/...)")
    e.add_argument("--ranks", type=int, nargs="*", help="only print these ranks")
    e.add_argument("-v", "--verbose", action="store_true", help="one line per instruction")
    args = p.parse_args(argv)
    try:
        return explain(args)
    except PiperError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
