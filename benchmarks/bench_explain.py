"""How planning scales with the world size: ``piper.plan`` (capture, passes, per-rank programs,
verification of all ranks together) plus the simulation, for PP8 x DP(N/8) 1F1B on the GPT, in a fresh
process per size. Prints wall time of each phase, the classes of ranks with the same program (planned,
verified and simulated once each: ``plan/symmetry.py``), the instructions of all ranks together and the
process's peak RSS.

    python benchmarks/bench_explain.py --worlds 1024 16384 100000
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _one(world: int, stages: int, microbatches: int) -> dict:
    import torch

    import piper_compile as piper
    from piper_compile.sim import FlopCost, simulate_plan
    from piper_compile.testing.models import build_model

    dp = world // stages
    model = build_model("gpt", layers=stages)
    model.annotate_stages(stages)
    batch = model.make_batch(2 * microbatches, torch.Generator().manual_seed(0))
    directives = [*piper.pipeline(stages, ranks=[[s + stages * r for r in range(dp)] for s in range(stages)]),
                  piper.replicate({"PP": "*"}), piper.split(microbatches),
                  *piper.schedules.one_f_one_b(stages, microbatches)]
    t0 = time.perf_counter()
    plan = piper.plan(model, *batch, directives=directives, world_size=world)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    sim = simulate_plan(plan, FlopCost())
    t_sim = time.perf_counter() - t0
    classes = plan.programs.symmetry.classes  # one program built per class (plan/symmetry.py)
    instrs = sum(len(plan.programs[rep].instrs) * len(ranks) for rep, ranks in classes.items())
    return {"world": world, "plan_s": t_plan, "sim_s": t_sim, "dag_nodes": len(plan.dag), "instructions": instrs,
            "classes": len(classes), "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_ms": sim.step_time * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[1024, 16384, 100000])
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_one(a.child, a.stages, a.microbatches)))
        return
    print(f"PP{a.stages} x DP(N/{a.stages}) 1F1B, {a.microbatches} micro-batches, GPT {a.stages} layers")
    print(f"{'ranks':>6} {'plan+verify s':>14} {'simulate s':>11} {'DAG nodes':>10} {'classes':>8} "
          f"{'instructions':>13} {'peak RSS MiB':>13} {'step ms':>8}")
    for w in a.worlds:
        out = subprocess.run([sys.executable, __file__, "--child", str(w), "--stages", str(a.stages),
                              "--microbatches", str(a.microbatches)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['world']:>6} {r['plan_s']:>14.2f} {r['sim_s']:>11.2f} {r['dag_nodes']:>10} {r['classes']:>8} "
              f"{r['instructions']:>13} {r['rss_mib']:>13.0f} {r['step_ms']:>8.3f}")


if __name__ == "__main__":
    main()
