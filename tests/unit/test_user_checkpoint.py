"""The user's own ``torch.utils.checkpoint`` calls (and Hugging Face's ``gradient_checkpointing_enable()``)
are honoured (``capture/checkpointing.UserCheckpoint``): the backward recomputes what they wrap instead of
keeping it, training is unchanged bitwise, a ``checkpoint`` directive matching the region takes their
place, and the tags survive the capture cache. They used to be dropped silently: the activations stayed."""
from __future__ import annotations

import copy
import functools
import warnings
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import piper_compile as piper
from piper_compile.disk import TESTED_TORCH, torch_version

sys.path.insert(0, str(Path(__file__).parent))
from test_remat import _kept_elements, _ops, _plan  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, p: float) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.dropout(F.gelu(self.fc(x)), self.p))


class Net(nn.Module):
    """Three residual blocks with dropout ``p``, each wrapped in ``checkpoint`` when ``wrap`` (reentrant or not)."""

    def __init__(self, wrap: bool, dim: int = 16, p: float = 0.1, reentrant: bool = False) -> None:
        super().__init__()
        self.wrap, self.reentrant = wrap, reentrant
        self.blocks = nn.ModuleList(Block(dim, p) for _ in range(3))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant) if self.wrap else b(x)
        return F.cross_entropy(self.head(x), t)

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _nets(p: float = 0.1, reentrant: bool = False) -> tuple[Net, Net]:
    torch.manual_seed(0)
    plain = Net(False, p=p)
    wrapped = copy.deepcopy(plain)
    wrapped.wrap, wrapped.reentrant = True, reentrant
    return plain, wrapped


def _back_addmm(p: piper.StaticPlan) -> int:
    return sum(_ops(s, "addmm") for s in p.segments.values() if s.pass_ != "F")


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_backward_recomputes_what_the_calls_wrap_and_keeps_less(reentrant: bool):
    plain, wrapped = _nets(reentrant=reentrant)
    off, on = _plan(plain, [piper.replicate()]), _plan(wrapped, [piper.replicate()])
    assert _kept_elements(on) < _kept_elements(off) / 2, (_kept_elements(on), _kept_elements(off))
    assert _back_addmm(on) - _back_addmm(off) == 6  # both linears of each of the three blocks run again
    # a directive matching the region takes the calls' place: the same plan as without them
    sel = [piper.replicate(), piper.checkpoint(policy="selective")]
    assert _kept_elements(_plan(wrapped, sel)) == _kept_elements(_plan(plain, sel))


def _grads(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    torch._dynamo.reset()
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"codegen": "eager", "directives": [piper.split(2)]})
    torch.manual_seed(3)
    step(x, t)
    return [p.grad.clone() for p in model.parameters()]


def test_training_is_bitwise_unchanged_dropout_masks_included():
    plain, wrapped = _nets()
    x, t = plain.make_batch(8, torch.Generator().manual_seed(1))
    on, off = _grads(wrapped, x, t), _grads(plain, x, t)
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    plain, wrapped = _nets(p=0.0)  # no dropout: eager autograd of the checkpointed model on the micro-batches agrees
    ref = copy.deepcopy(wrapped)
    (ref(x[:4], t[:4]) / 2 + ref(x[4:], t[4:]) / 2).backward()
    for a, p in zip(_grads(wrapped, x, t), ref.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_hugging_face_gradient_checkpointing_lowers_measured_activations(tmp_path, monkeypatch):
    """A Llama with ``gradient_checkpointing_enable()`` (transformers' default, reentrant) trains as eager
    and its measured peak activations drop (the prediction agrees), also when its joint graph comes from
    the capture cache. The drop is 13% on this small model, not more: the layer recomputed in the backward
    holds its intermediates while the backward runs (sim/segment_memory; the CPU allocator's own peak
    agrees within 100 bytes, 721,240 vs 829,784 bytes without checkpointing)."""
    from piper_compile.testing.hf import LlamaLoss, make_batch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    if torch_version() < TESTED_TORCH:  # 'auto' is off there (the GPU machine's 2.11): asked for by name
        monkeypatch.setenv("PIPER_CAPTURE_CACHE", "turns")

    def run(gc: bool) -> tuple[float, float, str]:
        m = LlamaLoss(seed=0)
        if gc:
            m.model.gradient_checkpointing_enable()
        ref = copy.deepcopy(m)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        torch._dynamo.reset()
        step = piper.compile(m, directives=[piper.split(2)], optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             codegen="eager")
        for s in range(2):
            x, y = make_batch(4, torch.Generator().manual_seed(s))
            ropt.zero_grad()
            want = ref(x, y)
            want.backward()
            ropt.step()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.testing.assert_close(step(x, y), want.detach(), rtol=1e-5, atol=1e-6)
            # checkpointed layers are not tried as nested compile regions (Dynamo fails on them): no warning
            assert not [w for w in seen if "nested" in str(w.message)], [str(w.message) for w in seen]
        assert piper.stats(step).recompiles == 0
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        mem = piper.memory_report(step)
        return mem.measured.peak_activations, mem.predicted.peak_activations, piper.stats(step).capture

    none = run(False)
    cold, warm = run(True), run(True)
    assert cold[2] == "captured" and warm[2] == "loaded"
    for measured, predicted, _ in (cold, warm):
        assert measured < 0.9 * none[0], (measured, none)
        assert measured == pytest.approx(predicted, rel=0.1)


def _save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveNet(Net):
    """``Net`` under torch's selective activation checkpointing: the linears' outputs are saved."""

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        ctx = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False, context_fn=ctx)
        return F.cross_entropy(self.head(x), t)


def test_a_selective_policy_keeps_what_it_saves():
    """Values the policy function saves are kept: nothing between the plain call and no call at all, and no
    linear runs again in the backward."""
    plain, wrapped = _nets()
    torch.manual_seed(0)
    sac = SelectiveNet(False)
    sac.load_state_dict(plain.state_dict())
    plans = {name: _plan(m, [piper.replicate()]) for name, m in (("off", plain), ("full", wrapped), ("sac", sac))}
    kept = {name: _kept_elements(p) for name, p in plans.items()}
    assert kept["full"] < kept["sac"] < kept["off"], kept
    assert _back_addmm(plans["sac"]) == _back_addmm(plans["off"])
