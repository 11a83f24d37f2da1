"""runtime/optimizer.py: piper builds the fused optimizer only where it is known to update like the default
one, and the first update with a nonzero gradient must move the parameters."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from piper_compile.errors import PiperError
from piper_compile.runtime import optimizer as popt
from piper_compile.testing.models import build_model

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _train(model: torch.nn.Module, factory, steps: int = 3, dtype: torch.dtype = torch.bfloat16):
    x, y = model.make_batch(8, torch.Generator().manual_seed(0))
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"optimizer": factory, "codegen": "eager"})
    losses = [step(x.to(dtype), y.to(dtype)).item() for _ in range(steps)]
    import piper_compile as piper
    return losses, piper.optimizer(step)


def test_bf16_model_trains_with_the_default_optimizer():
    """Fused SGD on CPU leaves bf16 parameters unchanged (torch 2.13): piper used to ask for it, and a bf16
    model then never trained, silently. Now it gets the default implementation and trains as eager does."""
    model = build_model("mlp").to(torch.bfloat16)
    ref = copy.deepcopy(model)
    losses, opt = _train(model, SGD)
    assert not opt.defaults.get("fused")
    ref_opt = SGD(ref.parameters())
    x, y = ref.make_batch(8, torch.Generator().manual_seed(0))
    ref_losses = []
    for _ in range(3):
        loss = ref(x.bfloat16(), y.bfloat16())
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    assert losses == ref_losses and losses[-1] < losses[0]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_fp32_keeps_the_fused_implementation(cls):
    p = torch.nn.Parameter(torch.randn(4))
    assert popt.build_optimizer(functools.partial(cls, lr=1e-3), [p]).defaults["fused"] is True


def test_fused_optimizer_knob_and_explicit_implementation(monkeypatch):
    p = torch.nn.Parameter(torch.randn(4))
    assert popt.build_optimizer(functools.partial(torch.optim.AdamW, foreach=True), [p]).defaults["fused"] is None
    monkeypatch.setenv("PIPER_FUSED_OPTIMIZER", "0")
    assert popt.build_optimizer(functools.partial(torch.optim.AdamW), [p]).defaults["fused"] is None


def test_probe_rejects_a_fused_kernel_that_updates_differently(monkeypatch):
    """Were fused SGD on CPU bf16 listed as known correct, the probe would still catch it."""
    monkeypatch.setattr(popt, "FUSED_KNOWN_CORRECT", popt.FUSED_KNOWN_CORRECT | {("SGD", "cpu", torch.bfloat16)})
    assert not popt.fused_matches_default(SGD, torch.device("cpu"), torch.bfloat16)
    assert popt.fused_matches_default(SGD, torch.device("cpu"), torch.float32)
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    assert not popt.build_optimizer(SGD, [p]).defaults.get("fused")


def test_an_update_that_moves_nothing_raises():
    """The user picked fused SGD for a bf16 model: the first step moves nothing, which piper reports."""
    model = build_model("mlp").to(torch.bfloat16)
    with pytest.raises(PiperError, match=r"left every torch.bfloat16 parameter on cpu unchanged.*SGD \(fused"):
        _train(model, functools.partial(torch.optim.SGD, lr=0.1, fused=True))


def test_a_zero_learning_rate_is_not_an_error():
    model = build_model("mlp").to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, functools.partial(torch.optim.SGD, lr=0.0))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


class _OnlyLarge(torch.optim.Optimizer):
    """Moves only parameters of more than 1000 elements (as an optimizer whose update is zero on small,
    zero-initialized parameters would)."""

    def __init__(self, params) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):  # noqa: ANN001, ANN201
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and p.numel() > 1000:
                    p.data.add_(p.grad, alpha=-g["lr"])


def _big_and_small() -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (16, 8 * 2**20)]  # 64 B and 32 MiB
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def test_the_moved_check_copies_only_the_smallest_parameters():
    """The first step's check clones the smallest parameters up to SAMPLE_BYTES, not all of them: nothing
    of 16 MiB or more is allocated for a 32 MiB parameter beside a small one that moves."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Large(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.sizes += [t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                           and t.untyped_storage().data_ptr() not in inputs  # new memory, not an alias
                           and t.untyped_storage().nbytes() >= 16 * 2**20]
            return out

    ps = _big_and_small()
    opt = torch.optim.SGD(ps, lr=0.1)
    opt.step = lambda: [p.data.add_(p.grad, alpha=-0.1) for p in ps]  # in place: only the check allocates
    with Large() as seen:
        popt.step_checked(opt, ps)
    assert seen.sizes == [], seen.sizes  # copying every parameter would allocate 32 MiB
    assert opt._piper_moved == {(torch.device("cpu"), torch.float32)}


def test_an_inconclusive_sample_grows_until_it_sees_a_parameter_move(monkeypatch):
    """Only the large parameter moves: the small sample is inconclusive (no error), the budget doubles
    until the large one is checked, and then the kind counts as moved; nothing is raised."""
    monkeypatch.setattr(popt, "SAMPLE_BYTES", 2**20)
    ps = _big_and_small()
    opt = _OnlyLarge(ps)
    for _ in range(10):
        popt.step_checked(opt, ps)
        if opt._piper_moved:
            break
    assert opt._piper_moved and opt._piper_check_bytes[(torch.device("cpu"), torch.float32)] >= 32 * 2**20


def test_an_update_that_moves_nothing_is_found_once_the_sample_covers_every_parameter(monkeypatch):
    monkeypatch.setattr(popt, "SAMPLE_BYTES", 2**20)
    ps = _big_and_small()
    opt = torch.optim.SGD(ps, lr=0.1)
    opt.step = lambda: None  # moves nothing
    with pytest.raises(PiperError, match="left every torch.float32 parameter on cpu unchanged"):
        for _ in range(10):
            popt.step_checked(opt, ps)
    assert opt._piper_check_bytes[(torch.device("cpu"), torch.float32)] >= 32 * 2**20
