"""Rank-death matrix: kill one rank and measure, for every survivor, how long it takes to exit and what it
says.

For each strategy (DP2, PP2 1F1B, PP2 x DP2 ZeRO-3 on 4 ranks, EP2) and each kill point, the ranks are
launched as separate processes the way ``torchrun`` does (the rendezvous store is hosted by this launcher,
not by rank 0, with ``TORCHELASTIC_USE_AGENT_STORE``), each running an ordinary training script: compile,
one warm-up step, then the step or ``piper.save`` that the victim dies in, with no exception handling, so
a survivor exits the way a user's script would (traceback, interpreter exit). The victim SIGKILLs itself:

- ``before``: just before its first call of the compiled step (the others go on into it);
- ``mid``: inside the next step, when its first backward segment starts (the others wait on it);
- ``save``: inside ``piper.save``, when DCP starts writing its files.

For each survivor: seconds from the kill to its process exit, its exit status, and the first line of
the ``piper:`` message it printed (or of its last error line when it printed none). A survivor still
running ``--limit`` seconds after the kill is killed and reported as such.

    python benchmarks/rank_death.py                       # the whole matrix (a few minutes)
    python benchmarks/rank_death.py --strategies PP2 --points mid --full

``--timeout`` is piper's ``options["timeout"]`` (default 30 s here; piper's own default is 300 s) and
``--pg-timeout`` the default process group's timeout (``init_process_group``; torch's default is 30 min),
which bounds DCP's collectives in ``piper.save``.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

STRATEGIES: dict[str, int] = {"DP2": 2, "PP2": 2, "PP2xDP2-ZeRO3": 4, "EP2": 2}
POINTS = ("before", "mid", "save")
KILL_MARK = "RANK_DEATH_KILLED_AT"


# -- the per-rank training script ------------------------------------------------------------------
def _build(strategy: str) -> tuple[Any, list[Any]]:
    import piper_compile as piper
    from piper_compile.testing.models import build_model

    if strategy == "EP2":
        return build_model("moe", experts=4), [piper.split(2), piper.replicate(), piper.shard({"EP": "*"})]
    model = build_model("mlp")
    if strategy == "DP2":
        return model, [piper.replicate()]
    model.annotate_stages(2)
    if strategy == "PP2":
        return model, [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)]
    assert strategy == "PP2xDP2-ZeRO3", strategy
    return model, [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.replicate({"PP": "*"}, zero=3),
                   piper.split(2), *piper.schedules.one_f_one_b(2, 2)]


def _die() -> None:
    print(f"{KILL_MARK} {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def worker(strategy: str, point: str, victim: int, timeout: float, pg_timeout: float, ckpt: str) -> None:
    """One rank: an ordinary training script with the victim's death armed at ``point``."""
    import torch
    import torch.distributed as dist

    import piper_compile as piper

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=pg_timeout))
    model, directives = _build(strategy)
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": directives, "codegen": "eager", "timeout": timeout,
                                  "optimizer": functools.partial(torch.optim.AdamW, lr=1e-3)})
    replica = {"PP2": 0, "PP2xDP2-ZeRO3": rank // 2}.get(strategy, rank)  # a pipeline's stages share its batch
    batch = model.make_batch(8, torch.Generator().manual_seed(replica))
    if point == "before" and rank == victim:
        _die()
    step(*batch)  # the first call: capture, plan, process groups, first step
    if rank == victim and point == "mid":
        segments = piper.compiled_steps(step)[0].plans[False].executor.segments
        name = next(n for n in sorted(segments) if n.startswith("B"))
        segments[name]._run = lambda *_: _die()  # its compiled function, whatever the calling convention
    if rank == victim and point == "save":
        import torch.distributed.checkpoint as dcp

        dcp.FileSystemWriter.write_data = lambda *_a, **_k: _die()  # type: ignore[method-assign]
    if point == "save":
        piper.save(step, ckpt)
    for _ in range(3):
        step(*batch)
    print("FINISHED", flush=True)
    dist.destroy_process_group()


# -- the launcher ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    rank: int
    seconds: float | None  # from the kill to the process's exit; None: still running at the limit
    status: str  # "exit code 1", "signal SIGABRT", "killed at limit", ...
    message: str  # first line of its piper: message, or of its last error line


def _status(code: int | None) -> str:
    from piper_compile.testing.launch import exit_description

    return "killed at limit" if code is None else exit_description(code)


def first_message(stderr: str) -> str:
    """The first line of the ``piper:`` error a rank printed, else its last error-looking line (torch
    prefixes each line of a rank's stderr with ``[rankN]:``)."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln) for ln in stderr.splitlines()]
    for line in lines:  # an exception line (not indented: traceback source lines are)
        m = re.match(r"^(?:[\w.]+: )?(piper: .*)", line)
        if m:
            return m.group(1)
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)]
    if errors:
        return errors[-1]
    rest = [ln for ln in lines if ln.strip() and not ln.startswith("[")]
    return rest[-1] if rest else "(nothing)"


def run_cell(strategy: str, point: str, victim: int | None = None, timeout: float = 30, pg_timeout: float = 60,
             limit: float = 240, keep: str | None = None) -> tuple[float | None, list[Outcome]]:
    """Launch one cell; returns (when the victim died, relative to launch) and one ``Outcome`` per survivor.
    ``keep``: a directory to copy every rank's stdout and stderr into."""
    from torch.distributed import TCPStore

    import piper_compile

    world = STRATEGIES[strategy]
    victim = world - 1 if victim is None else victim
    here = os.path.dirname(os.path.dirname(os.path.abspath(piper_compile.__file__)))  # the ranks run this copy
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)  # the "agent" store
    with tempfile.TemporaryDirectory(prefix="rank_death_") as tmp:
        procs, outs, errs = [], [], []
        for r in range(world):
            env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
            out = open(os.path.join(tmp, f"{r}.out"), "w+")
            err = open(os.path.join(tmp, f"{r}.err"), "w+")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", strategy, point, str(victim), str(timeout),
                   str(pg_timeout), os.path.join(tmp, "ckpt")]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err))
            outs.append(out)
            errs.append(err)
        killed_at: float | None = None
        exited: dict[int, float] = {}
        start = time.time()
        while True:
            now = time.time()
            for r, p in enumerate(procs):
                if r not in exited and p.poll() is not None:
                    exited[r] = now
            if killed_at is None:
                outs[victim].seek(0)
                m = re.search(rf"{KILL_MARK} ([\d.]+)", outs[victim].read())
                killed_at = float(m.group(1)) if m else None
            if len(exited) == world:
                break
            deadline = (killed_at if killed_at is not None else start) + limit
            if now > deadline:
                break
            time.sleep(0.05)
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
        result = []
        for r in range(world):
            if r == victim:
                continue
            errs[r].seek(0)
            stderr = errs[r].read()
            outs[r].seek(0)
            finished = "FINISHED" in outs[r].read()
            end = exited.get(r)
            secs = None if end is None or killed_at is None else end - killed_at
            status = _status(procs[r].returncode if end is not None else None)
            msg = "finished its steps (no error)" if finished else first_message(stderr)
            result.append(Outcome(r, secs, status, msg))
        for f in outs + errs:
            f.close()
        if keep is not None:
            import shutil

            cell = os.path.join(keep, f"{strategy}-{point}")
            shutil.rmtree(cell, ignore_errors=True)
            shutil.copytree(tmp, cell, ignore=shutil.ignore_patterns("ckpt*"))
    return (None if killed_at is None else killed_at - start), result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="*", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--points", nargs="*", default=list(POINTS), choices=list(POINTS))
    p.add_argument("--victim", type=int, default=None, help="the rank that dies (default: the last)")
    p.add_argument("--timeout", type=float, default=30, help="piper's options['timeout'] (s)")
    p.add_argument("--pg-timeout", type=float, default=60, help="the default process group's timeout (s)")
    p.add_argument("--limit", type=float, default=240, help="kill survivors still running this long after the kill")
    p.add_argument("--full", action="store_true", help="print whole messages (default: 150 characters)")
    p.add_argument("--keep", default=None, help="copy every rank's stdout/stderr to KEEP/<strategy>-<point>/")
    a = p.parse_args()
    print(f"piper options['timeout'] = {a.timeout:g}s, default process group timeout = {a.pg_timeout:g}s; "
          "seconds = from the victim's SIGKILL to the survivor's exit")
    print(f"{'strategy':<14} {'kill at':<7} {'victim':>6} {'rank':>4} {'seconds':>8}  {'status':<16} message")
    for strategy in a.strategies:
        for point in a.points:
            _, outcomes = run_cell(strategy, point, a.victim, a.timeout, a.pg_timeout, a.limit, a.keep)
            victim = STRATEGIES[strategy] - 1 if a.victim is None else a.victim
            for o in outcomes:
                secs = "-" if o.seconds is None else f"{o.seconds:.1f}"
                msg = o.message if a.full else o.message[:150] + ("..." if len(o.message) > 150 else "")
                print(f"{strategy:<14} {point:<7} {victim:>6} {o.rank:>4} {secs:>8}  {o.status:<16} {msg}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        s, pt, v, t, pgt, ck = sys.argv[2:8]
        worker(s, pt, int(v), float(t), float(pgt), ck)
    else:
        main()
