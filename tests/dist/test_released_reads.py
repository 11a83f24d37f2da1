"""Between steps, a weight piper released on this rank (another pipeline stage's, a ZeRO-3 parameter's
full tensor) has no storage. Reading it -- an EMA over ``model.parameters()``, a weight norm, calling the
original module instead of the compiled one, ``torch.save(model)`` -- read freed memory (a segfault on
CPU); now it is a ``piper:`` error naming the weight on every rank that released it, while metadata,
``model.state_dict()``, ``load_state_dict`` and further training stay exact (``runtime/released.py``)."""
from __future__ import annotations

import copy
import functools
import io
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.models import GPT, GPTConfig

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _directives(kind: str, model: GPT) -> list[Any]:
    if kind == "pp2":
        model.annotate_stages(2)
        return [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)]
    return [piper.replicate(zero=3), piper.split(1)]


def _reads(model: GPT) -> list[Any]:
    p = next(p for p in model.parameters() if type(p) is not torch.nn.Parameter)
    ema = torch.zeros(p.shape)
    batch = model.make_batch(2, torch.Generator().manual_seed(1))
    return [lambda: ema.lerp_(p, 0.1), lambda: p.norm(), lambda: model(*batch),
            lambda: torch.save(model, io.BytesIO()), lambda: copy.deepcopy(model)]


def _public_api(step: Any, model: GPT, path: str) -> bool:
    """piper's own functions that read parameters work between steps (they take the plain classes back and
    mark them again); a restore of the same state leaves training bitwise unchanged."""
    piper.save(step, path)
    piper.load(step, path)
    full = piper.full_state_dict(step)
    piper.load_full_state_dict(step, full)
    piper.sharded_state_dict(step)
    piper.memory_report(step)
    return all(torch.equal(full[k], v) for k, v in piper.trained_parameters(step).items())


def _worker(rank: int, world: int, kind: str, probe: bool, path: str = "") -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=32, layers=2, heads=2, seq=16, vocab=64))
    x, y = model.make_batch(8, torch.Generator().manual_seed(0))
    step = piper.compile(model, directives=_directives(kind, model), optimizer=SGD, codegen="eager")
    losses = [float(step(x, y))]
    out: dict[str, Any] = {"errors": []}
    if probe:
        out["count"] = sum(p.numel() for p in model.parameters())
        for read in _reads(model):
            try:
                read()
                out["errors"].append(None)
            except piper.PiperError as e:
                out["errors"].append(str(e).split(" has no storage")[0])
        sd = model.state_dict()  # every rank together
        out["sd_equal"] = all(torch.equal(sd[k], v) for k, v in piper.trained_parameters(step).items())
        model.load_state_dict(sd)
        out["api"] = _public_api(step, model, path)
        out["still_refused"] = _refused(_reads(model)[1])
    losses += [float(step(x, y)) for _ in range(2)]
    out["losses"] = losses
    return out


def _refused(read: Any) -> bool:
    try:
        read()
    except piper.PiperError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pp2", "zero3"])
def test_reading_a_released_weight_is_a_clear_error_and_training_stays_exact(kind, tmp_path):
    probed = run_local(_worker, 2, kind, True, str(tmp_path / "ckpt"))
    plain = run_local(_worker, 2, kind, False)
    n = sum(p.numel() for p in GPT(GPTConfig(dim=32, layers=2, heads=2, seq=16, vocab=64)).parameters())
    for rank, (r, q) in enumerate(zip(probed, plain)):
        assert r["count"] == n, rank  # metadata reads work
        assert len(r["errors"]) == 5 and all(e is not None and e.startswith("piper: '") for e in r["errors"]), r
        assert r["sd_equal"] and r["api"] and r["still_refused"], rank
        assert r["losses"] == q["losses"], (rank, r["losses"], q["losses"])  # the reads changed nothing


def _copy_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=32, layers=2, heads=2, seq=16, vocab=64))
    x, y = model.make_batch(8, torch.Generator().manual_seed(0))
    step = piper.compile(model, directives=[piper.replicate(zero=1), piper.split(1)], optimizer=SGD, codegen="eager")
    step(x, y)
    trained = piper.trained_parameters(step)
    ema = copy.deepcopy(model)  # its state-dict hooks are inert: a rank alone may read it
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    same = all(torch.equal(m.state_dict()[k], v) for m in (ema, loaded) for k, v in trained.items())
    return {"same": same, "link": loaded._piper_link, "losses": [float(step(x, y)) for _ in range(2)]}


@pytest.mark.slow
def test_a_zero1_model_copies_and_saves_with_its_trained_weights():
    """ZeRO-1 keeps full weights (views of the gathered buffers): copy.deepcopy(model) (an EMA) and
    torch.save(model) hold the trained weights; they failed on the hooks' training state (process groups,
    compiled code) and on the model's link to its compiled step, which are not copied now."""
    res = run_local(_copy_worker, 2)
    assert all(r["same"] and r["link"] is None for r in res), res
    assert res[0]["losses"] == res[1]["losses"]
