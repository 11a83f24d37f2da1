"""Pipeline parallel: piper GPipe / 1F1B vs ``torch.distributed.pipelining`` ScheduleGPipe / Schedule1F1B.

One stage per rank (PP2 on 2 ranks by default; ``--stages 2 4`` adds PP4 on 4 ranks), the same GPT split
the same way in both: stage 0 = token/position embeddings + its blocks, the last stage = its blocks +
ln_f + head + cross-entropy, blocks divided as ``GPT.annotate_stages`` does (block i on stage
i * stages // layers). The LM head is UNTIED from the token embedding in both variants (the head gets
its own copy of the weight), so neither side pays a tied-gradient transfer. Same micro-batch count
(``--microbatches``), same full batch fed to the pipeline every step, same seed and AdamW on each
stage's parameters, gloo on CPU with 1 thread per rank, every variant in freshly spawned processes.

piper: ``annotate`` the stages, ``[*pipeline(S), split(M), *schedules.gpipe|one_f_one_b(S, M)]``, one
call per step. pipelining: a hand-written stage module per rank in ``PipelineStage``, ``schedule.step``
then ``opt.step()``; its loss_fn is the same cross-entropy, grads scaled by 1/M (``scale_grads``).

``--precision bf16``: bf16 compute with fp32 master weights on both sides. piper:
``mixed_precision={"param_dtype": "bf16"}`` (a bf16 compute copy, bf16 activations between stages). The
peer: each stage module cast to bf16 (bf16 activations and P2P, the same bytes), its gradients copied
into fp32 master weights that AdamW steps, which are then copied back into the bf16 module (``Masters``).
Losses then differ by bf16 rounding, so their check uses a 2% tolerance.

Read ``piper/this`` as piper's median step time divided by the pipelining schedule's: below 1.00 piper
is faster. The correctness lines compare the last stage's per-step mean loss of the two.

    python benchmarks/bench_pp.py                       # PP2, M=8, piper codegen inductor
    python benchmarks/bench_pp.py --codegen eager --stages 2 4
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RankResult, Spec, Summary, add_common_args, best_of, build_gpt, compare_losses,  # noqa: E402
                    global_batches, load_note, peer_adamw, print_ratios, print_table, timed_loop)

from piper_compile.testing.launch import run_local  # noqa: E402
from piper_compile.testing.models import GPT  # noqa: E402


def stage_blocks(layers: int, stage: int, stages: int) -> list[int]:
    """The blocks of ``stage``, exactly as ``GPT.annotate_stages`` assigns them."""
    return [i for i in range(layers) if i * stages // layers == stage]


def piper_worker(rank: int, world: int, spec: Spec, schedule: str, microbatches: int, bf16: bool = False) -> RankResult:
    import piper_compile as piper

    model = build_gpt(spec, untie=True)
    batches = global_batches(model, spec, spec.batch)
    model.annotate_stages(world)
    piper.annotate(model.wte, PP=0)  # explicit, though the region rule puts them there anyway
    piper.annotate(model.wpe, PP=0)
    piper.annotate(model.ln_f, PP=world - 1)
    piper.annotate(model.head, PP=world - 1)
    build = {"gpipe": piper.schedules.gpipe, "1f1b": piper.schedules.one_f_one_b}[schedule]
    directives = [*piper.pipeline(world), piper.split(microbatches), *build(world, microbatches)]
    options = {"codegen": spec.codegen, "optimizer": functools.partial(torch.optim.AdamW, lr=spec.lr)}
    if bf16:
        options["mixed_precision"] = {"param_dtype": "bf16"}
    step = piper.compile(model, directives=directives, **options)
    res = timed_loop(lambda i: step(*batches[i]), spec)
    stats = piper.last_stats(step)
    cs = piper.compiled_steps(step)[0]
    res.extra = {"collectives": dict(stats.collectives), "p2p": stats.p2p, "compute": stats.compute,
                 "peak_live_mib": round(stats.peak_live_bytes / 2**20, 1),
                 "compile_s": round(sum(c.compile_seconds for c in cs.compiled.values()), 1),
                 "segments": sorted(cs.compiled)}
    return res


class StageModule(nn.Module):
    """One pipeline stage of ``GPT`` for ``torch.distributed.pipelining`` (shares the GPT's modules)."""

    def __init__(self, gpt: GPT, stage: int, stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in stage_blocks(len(gpt.blocks), stage, stages))
        if self.last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


class Masters:
    """fp32 master weights for a bf16 module: AdamW steps the masters on the module's gradients (cast to
    fp32), then the module gets the new values in bf16."""

    def __init__(self, module: nn.Module, lr: float) -> None:
        self.low = list(module.parameters())
        self.master = [nn.Parameter(p.detach().float().clone()) for p in self.low]
        self.opt = peer_adamw(self.master, lr)

    def step(self) -> None:
        for m, p in zip(self.master, self.low):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(self.master, self.low):
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the module's gradients were handed over (and cleared) in step


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def pipelining_worker(rank: int, world: int, spec: Spec, schedule: str, microbatches: int,
                      bf16: bool = False) -> RankResult:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model = build_gpt(spec, untie=True)
    batches = global_batches(model, spec, spec.batch)
    module = StageModule(model, rank, world)
    del model
    opt: Any = peer_adamw(module.parameters(), spec.lr)
    if bf16:  # the master weights keep the fp32 values; the module computes in bf16
        opt = Masters(module, spec.lr)
        module.to(torch.bfloat16)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=microbatches, loss_fn=_ce)
    first, last = rank == 0, rank == world - 1

    def step(i: int) -> torch.Tensor | None:
        return pipelining_step(sched, opt, *batches[i], first, last)

    return timed_loop(step, spec)


def pipelining_step(sched: object, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, first: bool,
                    last: bool) -> torch.Tensor | None:
    """One training step of a ``torch.distributed.pipelining`` schedule: inputs on the first stage,
    targets on the last; returns the mean micro-batch loss on the last stage."""
    losses: list[torch.Tensor] = []
    if first:
        sched.step(x)  # type: ignore[attr-defined]
    elif last:
        sched.step(target=y, losses=losses)  # type: ignore[attr-defined]
    else:
        sched.step()  # type: ignore[attr-defined]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return torch.stack(losses).float().mean() if last else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(batch=16)
    p.add_argument("--stages", type=int, nargs="+", default=[2], help="pipeline stages = ranks (e.g. 2 4)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedules", nargs="+", choices=["gpipe", "1f1b"], default=["gpipe", "1f1b"])
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: bf16 compute and activations, fp32 master weights, on both sides")
    args = p.parse_args()
    bf16 = args.precision == "bf16"
    spec = Spec.from_args(args)
    m = args.microbatches
    if spec.batch % m:
        p.error(f"--batch {spec.batch} must be a multiple of --microbatches {m}")
    print(f"bench_pp: {spec.describe()} (the whole batch goes through the pipeline), {m} micro-batches, "
          f"precision {args.precision}, "
          f"{os.cpu_count()} CPU cores", flush=True)
    print(f"before: {load_note()}")
    rows: dict[str, dict[str, Summary]] = {}
    piper_of: dict[str, str] = {}
    all_ok = True
    for stages in args.stages:
        if stages > spec.model["layers"]:
            print(f"  skipping PP{stages}: only {spec.model['layers']} layers")
            continue
        for sched in args.schedules:
            config = f"PP{stages} {sched}"
            piper_name = f"piper {sched} ({spec.codegen})"
            peer_name = f"pipelining {'ScheduleGPipe' if sched == 'gpipe' else 'Schedule1F1B'}"
            rows[config], piper_of[config] = {}, piper_name
            print(f"  running {config}: {piper_name} ...", flush=True)
            ours = best_of(args.rounds, functools.partial(run_local, piper_worker, stages, spec, sched, m, bf16,
                                                          timeout_s=args.timeout))
            print(f"  running {config}: {peer_name} ...", flush=True)
            theirs = best_of(args.rounds, functools.partial(run_local, pipelining_worker, stages, spec, sched, m, bf16,
                                                            timeout_s=args.timeout))
            rows[config][piper_name], rows[config][peer_name] = Summary.of(ours), Summary.of(theirs)
            for r in range(stages):
                print(f"  {config} piper rank {r} counters: {ours[r].extra}")
            all_ok &= compare_losses(f"{config} last-stage loss piper vs pipelining", ours[-1].losses,
                                     theirs[-1].losses, rtol=2e-2 if bf16 else 1e-4)
    print_table(f"pipeline parallel, {m} micro-batches: median step time (slowest rank per step)", rows, piper_of)
    print_ratios(rows, piper_of)
    print(f"after: {load_note()}")
    print(f"correctness: {'all losses agree' if all_ok else 'LOSS MISMATCH (see above)'}")


if __name__ == "__main__":
    main()
