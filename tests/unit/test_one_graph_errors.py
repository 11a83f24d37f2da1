"""A forward Dynamo cannot trace as one graph (``capture/dynamo.one_graph_errors``): a ``piper:`` error that
names the user's line, the reason and the ways out, from ``piper.compile`` and from ``piper.plan``. Before,
each of these raised Dynamo's own ``UserError`` or ``Unsupported``, several screens long, naming no fix
that piper users have (``F.gaussian_nll_loss`` checks its variance with ``torch.any(var < 0)``)."""
from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper
from piper_compile.errors import PiperCaptureError


class Net(nn.Module):
    """One linear layer; ``kind`` picks what Dynamo cannot put into one graph."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.kind = nn.Linear(8, 4), kind

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        o = self.a(x)
        if self.kind == "gaussian_nll":
            return F.gaussian_nll_loss(o, t, torch.ones_like(o))
        if self.kind == "item_branch" and o.sum().item() > 1e9:
            o = o * 2
        if self.kind == "tensor_branch" and o.sum() > 1e9:
            o = o * 2
        if self.kind == "file_io":
            open("/dev/null").close()
        return F.mse_loss(o, t)


LINES = {"gaussian_nll": "return F.gaussian_nll_loss(o, t, torch.ones_like(o))",
         "item_branch": 'if self.kind == "item_branch" and o.sum().item() > 1e9:',
         "tensor_branch": 'if self.kind == "tensor_branch" and o.sum() > 1e9:',
         "file_io": 'open("/dev/null").close()'}


def _check(err: pytest.ExceptionInfo, kind: str) -> None:
    msg = str(err.value)
    head = msg.split("Dynamo's message:")[0]
    assert head.startswith("piper: Dynamo cannot trace the training step as one graph at "), msg
    assert "test_one_graph_errors.py" in head and f"`{LINES[kind]}`" in head, head
    assert "torch.where" in head and "move the check out of the model's forward" in head, head
    assert "adapt_moe" not in head, head
    assert isinstance(err.value.__cause__, torch._dynamo.exc.TorchDynamoException)


@pytest.mark.parametrize("kind", sorted(LINES))
def test_compile_names_the_line_and_the_fix(kind: str) -> None:
    step = piper.compile(Net(kind), directives=[piper.split(2)], codegen="eager",
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(PiperCaptureError) as err:
        step(torch.randn(8, 8), torch.randn(8, 4))
    _check(err, kind)


def test_plan_names_the_line_and_the_fix() -> None:
    with pytest.raises(PiperCaptureError) as err:
        piper.plan(Net("tensor_branch"), torch.randn(8, 8), torch.randn(8, 4), directives=[piper.split(2)],
                   world_size=1)
    _check(err, "tensor_branch")


@pytest.mark.slow  # ~4 s (transformers): keeps the fast subset under 5 min
def test_an_unadapted_transformers_moe_is_pointed_to_adapt_moe() -> None:
    """Qwen3-MoE's expert loop (``for expert_idx in expert_hit``): the error names the block and
    ``adapt_moe``, which makes the same model capturable."""
    pytest.importorskip("transformers")
    from piper_compile.testing.hf import build_qwen3_moe, make_batch

    model = build_qwen3_moe(adapt=False)
    ids, _ = make_batch(2, torch.Generator().manual_seed(0))
    step = piper.compile(model, directives=[piper.split(1)], codegen="eager",
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(PiperCaptureError) as err, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(input_ids=ids, labels=ids)
    head = str(err.value).split("Dynamo's message:")[0]
    assert not [w for w in caught if "nested compile regions" in str(w.message)]  # the flat retry failed too
    assert "modeling_qwen3_moe.py" in head and "mixture-of-experts block model.layers." in head, head
    assert "(Qwen3MoeSparseMoeBlock)" in head and "piper_compile.nn.hf.adapt_moe(model)" in head, head


class Tempered(nn.Module):
    """A float attribute read in forward: Dynamo makes it a constant and guards it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.temp = nn.Linear(8, 4), 1.0

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.a(x) / self.temp, t)


def test_the_recompile_limit_names_the_guard_and_the_fix() -> None:
    """An attribute changed before every step recompiles it each time (one line each); at Dynamo's limit the
    error names the limit, the latest guard and the fix. Before: ``FailOnRecompileLimitHit: Hard failure
    due to fullgraph=True``."""
    with torch._dynamo.config.patch(recompile_limit=3):  # (monkeypatch's undo deletes a config entry)
        _step_until_the_limit()


def _step_until_the_limit() -> None:
    model = Tempered()
    step = piper.compile(model, directives=[piper.split(2)], codegen="eager",
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    x, t = torch.randn(8, 8), torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recompile lines
        for i in range(3):
            model.temp = 1.0 + 0.1 * i
            step(x, t)
        model.temp = 2.0
        with pytest.raises(PiperCaptureError) as err:
            step(x, t)
    msg = str(err.value)
    assert msg.startswith("piper: Dynamo has compiled this model's step 3 times (torch._dynamo.config.recompile_limit)")
    # a guard of a version the new value fails: 2.13 names the second version's, 2.11 the latest one's
    assert re.search(r"self\.temp == 1\.[12]\b", msg), msg
    assert "pass a value that changes every step as an argument of forward" in msg, msg
