"""Every rank makes the same call, or every rank raises (runtime/consistency.py); uneven local batches
are weighted by their sample counts, so the step equals single-process training on the concatenation."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.models import build_model
from piper_compile.testing.parity import RunConfig, run_parity

pytestmark = pytest.mark.slow

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _step(model: torch.nn.Module, directives: list[Any], **options: Any) -> Any:
    return torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": directives, "codegen": "eager", "optimizer": SGD, "timeout": 30,
                                  **options})


def _batch(model: Any, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    return model.make_batch(n, torch.Generator().manual_seed(seed))


def _eval_on_rank0_alone(rank: int, world: int) -> list[Any]:
    """The common loop "evaluate on rank 0": rank 0 makes a no_grad call the others do not make."""
    model = build_model("mlp", 0)
    step = _step(model, [piper.replicate()])
    out: list[Any] = []
    try:
        for s in range(3):
            x, y = _batch(model, 16, s)
            out.append(step(x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]).item())
            if rank == 0 and s == 0:
                with torch.no_grad():
                    out.append(step(x[:8], y[:8]).item())
    except piper.PiperRuntimeError as e:
        out.append(str(e))
    return out


def test_evaluation_on_one_rank_raises_on_every_rank() -> None:
    """On main, rank 0's eval paired its loss all-reduce with rank 1's training step and every later loss
    was wrong on both ranks; now the second call raises on both, naming what each rank called."""
    res = run_local(_eval_on_rank0_alone, 2, timeout_s=300)
    for rank, out in enumerate(res):
        msg = out[-1]
        assert isinstance(msg, str) and "making different calls" in msg, (rank, out)
        assert "rank 0: a forward-only (torch.no_grad) step of model #0, its call #1" in msg
        assert "rank 1: a training step of model #0, its call #1" in msg
        assert "piper.local()" in msg
        assert len(out) == 2  # the first training step ran, nothing after the mismatch did


def _local_eval(rank: int, world: int, schedule: str) -> dict[str, Any]:
    model = build_model("mlp", 0)
    directives = [piper.replicate()] if schedule == "dp" else [*piper.pipeline(2), piper.split(2)]
    if schedule == "pp":
        model.annotate_stages(2)
    step = _step(model, directives)
    losses, evals, error = [], [], None
    for s in range(3):
        x, y = _batch(model, 16, s)
        rows = slice(rank * 8, (rank + 1) * 8) if schedule == "dp" else slice(0, 16)
        losses.append(step(x[rows], y[rows]).item())
        if rank == 0:
            try:
                with torch.no_grad(), piper.local():
                    evals.append(step(x[:5], y[:5]).item() if schedule == "dp" else step(x[:4], y[:4]).item())
            except piper.PiperError as e:
                error = str(e)
    params = {n: p.detach().clone() for n, p in model.named_parameters()} if schedule == "dp" else {}
    return {"losses": losses, "evals": evals, "error": error, "params": params}


def test_local_evaluation_on_one_rank_under_data_parallel() -> None:
    """piper.local(): rank 0 evaluates a 5-sample batch alone (no communication, its own mean loss);
    the training steps around it are those of a run without it (eager on the concatenated batch)."""
    res = run_local(_local_eval, 2, "dp", timeout_s=300)
    model = build_model("mlp", 0)
    opt = SGD(model.parameters())
    for s in range(3):
        x, y = _batch(model, 16, s)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():  # rank 0 evaluates after its training step
            ref_eval = model(x[:5], y[:5]).item()
        for r in res:
            assert abs(r["losses"][s] - loss.item()) < 1e-6
        assert abs(res[0]["evals"][s] - ref_eval) < 1e-6
    assert res[0]["error"] is None and res[1]["evals"] == []
    for n, p in model.named_parameters():
        torch.testing.assert_close(res[0]["params"][n], p.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res[1]["params"][n], p.detach(), rtol=1e-5, atol=1e-6)


def test_local_evaluation_refused_where_the_forward_communicates() -> None:
    """Under pipeline stages a forward-only call sends activations, so it cannot run on one rank; the
    error says so, and training goes on unharmed (nothing was sent)."""
    res = run_local(_local_eval, 2, "pp", timeout_s=300)
    assert "piper.local()" in res[0]["error"] and "communicates" in res[0]["error"] and "SEND" in res[0]["error"]
    assert res[0]["losses"] == res[1]["losses"] and len(res[0]["losses"]) == 3


@pytest.mark.parametrize("case", ["dp2_zero0", "dp2_mb2_zero3", "pp2xdp2_zero1"])
def test_uneven_batches_equal_the_global_mean(case: str) -> None:
    """A last partial batch: replicas hold 8 and 4 (or 12 and 4) samples. The loss is the mean over the
    concatenated 12 (16) samples and gradients are weighted the same way (on main: the mean of the
    replicas' means, parameters off by ~1e-3)."""
    if case == "dp2_zero0":
        cfg = RunConfig(model="mlp", directives=[piper.replicate()], batches=(8, 4))
        world, atol = 2, 1e-6
    elif case == "dp2_mb2_zero3":
        cfg = RunConfig(model="gpt", directives=[piper.replicate(zero=3, bucket_mb=0.01), piper.split(2)],
                        batches=(12, 4), optimizer=("AdamW", {"lr": 1e-3}))
        # AdamW divides by sqrt(v): the fp32 summation order of another CPU's kernels (AVX2 vs AVX-512 MKL)
        # moved one element of 4096 by 1.04e-6 after three steps; the wrong weighting moves them by ~1e-3
        world, atol = 2, 1e-5
    else:
        directives = [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(2),
                      *piper.schedules.one_f_one_b(2, 2), piper.replicate({"PP": "*"}, zero=1)]
        cfg = RunConfig(model="mlp", stages=2, directives=directives, batches=(8, 4), no_grad_eval=True)
        world, atol = 4, 1e-6
    run_parity(cfg, world, rtol=1e-5, atol=atol)


def _bad_batches(rank: int, world: int, case: str) -> str:
    model = build_model("mlp", 0)
    if case == "indivisible":
        step, n = _step(model, [piper.replicate(), piper.split(2)]), (8 if rank == 0 else 5)
    elif case == "empty":
        step, n = _step(model, [piper.replicate()]), (8 if rank == 0 else 0)
    else:  # the two stages of one pipeline get different batches: sizes (8, 12) or samples (seed 0, 1)
        model.annotate_stages(2)
        step, n = _step(model, [*piper.pipeline(2), piper.split(2)]), 8 + 4 * rank * (case == "stages_disagree")
    x, y = _batch(model, 16, rank if case == "stages_sample_apart" else 0)
    try:
        step(x[:n], y[:n])
    except piper.PiperError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case", ["indivisible", "empty", "stages_disagree", "stages_sample_apart"])
def test_bad_local_batches_raise_on_every_rank(case: str) -> None:
    """Rank 1's batch cannot be run (5 rows for 2 micro-batches, no rows: its own capture refuses it; the
    two stages of one pipeline given batches of different sizes, or different samples of one size -- a
    DistributedSampler over the world -- the call check refuses it): every rank raises at once, naming
    the cause or the rank that has it. Before the content check, the sampled-apart pipeline trained
    stage 0's tokens against stage 1's labels and returned a plausible loss."""
    res = run_local(_bad_batches, 2, case, timeout_s=300)
    if case == "stages_disagree":
        assert all("ranks [0, 1] hold one replica" in r and "[8, 12]" in r for r in res), res
        return
    if case == "stages_sample_apart":
        assert all("ranks [0, 1] hold one replica" in r and "different contents of the same size" in r
                   and "1 data-parallel replica(s): ranks [0, 1]" in r for r in res), res
        return
    assert "rank 1 could not start this call" in res[0], res
    assert res[1].startswith("piper:") and "could not start" not in res[1], res
    if case == "indivisible":
        assert "does not divide into 2 micro-batches" in res[1]


def _rank1_never_calls(rank: int, world: int) -> tuple[str, float]:
    import time

    model = build_model("mlp", 0)
    step = _step(model, [piper.replicate()], timeout=3)
    x, y = _batch(model, 16, 0)
    step(x[:8], y[:8])
    if rank == 1:
        time.sleep(6)  # busy with something else, then gone
        return "", 0.0
    t0 = time.perf_counter()
    try:
        step(x[:8], y[:8])
    except piper.PiperRuntimeError as e:
        return str(e), time.perf_counter() - t0
    return "no error", 0.0


def test_a_rank_that_does_not_call_is_named_by_the_check() -> None:
    msg, waited = run_local(_rank1_never_calls, 2, timeout_s=300)[0]
    assert "the call check of a training step of model #0, its call #1" in msg and "did not complete" in msg, msg
    assert waited < 10
