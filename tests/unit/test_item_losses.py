"""Which losses are means over items and how their micro-batches weigh (``capture/items.py``), in one
process: the loss found in the captured graph, the item weights it gives per micro-batch, the seeds the
call check derives from them, and one-process training with micro-batches equal to eager's."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper
from piper_compile.api import capture_step
from piper_compile.capture.items import find_item_count, is_sum_over_batch
from piper_compile.runtime.consistency import CallLayout, items_weights

SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


class Tagger(nn.Module):
    """A token classifier whose loss is chosen per test: cross-entropy over shifted labels (the
    language-model shift), with class weights, a custom ``ignore_index``, a sum, or a mean-squared error."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 8)
        self.loss = loss
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(x))
        if self.loss == "mse":
            return F.mse_loss(logits.float().mean(-1), y.float())
        flat, target = logits[:, :-1].reshape(-1, 8), y[:, 1:].reshape(-1)
        if self.loss == "weighted":
            return F.cross_entropy(flat, target, weight=self.class_weight)
        if self.loss == "ignore_0":
            return F.cross_entropy(flat, target, ignore_index=0)
        if self.loss == "sum":
            return F.cross_entropy(flat, target, reduction="sum") / target.numel()
        if self.loss == "aux":  # a cross-entropy plus a regularizer of the whole batch
            return F.cross_entropy(flat, target) + 0.1 * logits.pow(2).mean()
        if self.loss == "smooth":  # label smoothing: the cross-entropy plus a mean over the same kept labels
            return F.cross_entropy(flat, target, label_smoothing=0.1)
        if self.loss == "smooth_weighted":
            return F.cross_entropy(flat, target, weight=self.class_weight, label_smoothing=0.2)
        if self.loss == "two_targets":  # two label means over different labels: one weight cannot serve both
            return F.cross_entropy(flat, target) + F.cross_entropy(logits[:, 1:].reshape(-1, 8), y[:, :-1].reshape(-1))
        if self.loss == "argmax":  # labels made from the model's own output: not known before the step
            return F.cross_entropy(flat, flat.argmax(-1).detach())
        return F.cross_entropy(flat, target)


def _batch(n: int = 8, seed: int = 0, pad: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 32, (n, 6), generator=gen), torch.randint(1, 8, (n, 6), generator=gen)
    for r in range(n):
        y[r, 1 + r % 5:] = pad  # row r keeps r % 5 shifted labels (rows 0 and 5: none)
    return x, y


def _items(loss: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Tagger(loss)
    step = capture_step(model, *_batch(), directives=[], world_size=1)
    step._capture()
    return step, find_item_count(step.joint)


@pytest.mark.parametrize("loss", ["mse", "sum", "argmax"])
def test_only_a_mean_over_labels_known_up_front_is_an_item_mean(loss: str) -> None:
    assert _items(loss)[1] is None


def _args(step, x: torch.Tensor, y: torch.Tensor) -> tuple:  # type: ignore[no-untyped-def]
    """The joint graph's arguments (parameters, buffers, inputs, sizes) for one call."""
    by_name = {"x": x, "y": y, **step.joint.params, **step.joint.buffers}
    out: list = [None] * len(step.joint.inputs)
    for s in step.joint.inputs:
        if s.arg_index is not None:
            out[s.arg_index] = by_name.get(s.name, x.shape[1] if s.kind == "sym" else None)
    return tuple(out)


@pytest.mark.parametrize("loss", ["plain", "weighted", "ignore_0"])
def test_item_counts_per_micro_batch(loss: str) -> None:
    """Each micro-batch's total weight is what ``F.cross_entropy`` divides its sum by."""
    step, items = _items(loss)
    assert items is not None
    ignore = 0 if loss == "ignore_0" else -100
    x, y = _batch(pad=ignore)
    got = items.counts(_args(step, x, y), 4, 2)
    target = y[:, 1:]
    want = []
    for k in range(4):
        t = target[2 * k:2 * k + 2].reshape(-1)
        kept = t != ignore
        w = step.joint.buffers["class_weight"][t.clamp(min=0)] if loss == "weighted" else torch.ones(t.shape)
        want.append(float((w * kept).sum()))
    assert got.counts == pytest.approx(want) and not got.full
    full = items.counts(_args(step, x, torch.ones_like(y)), 2, 4)
    per_label = float(step.joint.buffers["class_weight"][1]) if loss == "weighted" else 1.0
    assert full.full == (loss != "weighted") and full.counts == pytest.approx([20 * per_label] * 2)


def test_seeds_are_item_shares() -> None:
    """Two replicas of a TP2 group each (ranks 0-1, 2-3): every holder reports its replica's items, which
    count once; a micro-batch without items weighs 0; no items at all is 0/0 as in eager."""
    layout = CallLayout(2, (0, 1, 2, 3), 2, (0, 0, 2, 2))
    w = items_weights(layout, [30.0, 30.0, 10.0, 10.0], (0.0, 30.0))
    assert w.seeds == (0.0, 0.75) and w.loss_weight(1) == 0.375 and w.loss_weight(0) == 0.0
    assert w.seed_of(1) == 0.75 and w.seed_of(None) == 0.0
    assert all(math.isnan(s) for s in items_weights(layout, [0.0] * 4, (0.0, 0.0)).seeds)


@pytest.mark.parametrize("loss", ["plain", "weighted", "smooth", "smooth_weighted"])
def test_micro_batches_train_as_eager(loss: str) -> None:
    """One process, split(4) (one micro-batch without items at the first step): losses and weights
    equal eager training on the whole batch; before, each micro-batch's mean weighed a quarter."""
    torch.manual_seed(0)
    model, ref = Tagger(loss), Tagger(loss)
    ref.load_state_dict(model.state_dict())
    step = piper.compile(model, directives=[piper.split(4)], codegen="eager", optimizer=SGD)
    opt = SGD(ref.parameters())
    for s in range(3):
        x, y = _batch(8, s)
        got = step(x, y).item()
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        opt.step()
        assert got == pytest.approx(float(want), rel=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_a_cross_entropy_among_other_terms_warns_when_labels_are_dropped() -> None:
    """One seed per micro-batch cannot weigh a token mean and a sample mean each as the global batch
    would: such a loss keeps the sample weights and says so once, where labels are dropped."""
    items = _items("aux")[1]
    assert items is not None and not items.exact and _items("plain")[1].exact
    torch.manual_seed(0)
    step = piper.compile(Tagger("aux"), directives=[piper.split(2)], codegen="eager", optimizer=SGD)
    x, y = _batch()
    step(x, torch.ones_like(y))  # every label kept: exact, no warning
    with pytest.warns(UserWarning, match="adds other terms to a cross-entropy whose labels are not all kept"):
        step(x, y)


class Regressor(nn.Module):
    """A linear regressor whose loss reduction is chosen per test."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o = self.a(x)
        return {
            "mse_sum": lambda: F.mse_loss(o, y, reduction="sum"),
            "l1_sum": lambda: F.l1_loss(o, y, reduction="sum"),
            "half_sum": lambda: (o - y).pow(2).sum() / 2,
            "ce_sum": lambda: F.cross_entropy(o, y.argmax(-1), reduction="sum"),
            "bce_sum": lambda: F.binary_cross_entropy_with_logits(o, y.sigmoid(), reduction="sum"),
            "mse_mean": lambda: F.mse_loss(o, y),
            "batchmean": lambda: (o - y).pow(2).sum() / x.shape[0],
            "rows_kept": lambda: (o - y).pow(2).sum(dim=1, keepdim=True).mean(),
            "weights_only": lambda: F.mse_loss(o, y) + self.a.weight.pow(2).sum(),
        }[self.loss]()


@pytest.mark.parametrize("loss", ["mse_sum", "l1_sum", "half_sum", "ce_sum", "bce_sum",
                                  "mse_mean", "batchmean", "rows_kept", "weights_only"])
def test_a_sum_over_the_batch_is_additive(loss: str) -> None:
    torch.manual_seed(0)
    step = capture_step(Regressor(loss), torch.randn(8, 8), torch.randn(8, 4), directives=[], world_size=1)
    step._capture()
    assert is_sum_over_batch(step.joint) == loss.endswith("_sum")


@pytest.mark.parametrize("loss", ["mse_sum", "half_sum"])
def test_a_sum_over_the_batch_trains_as_eager(loss: str) -> None:
    """split(4) in one process: before, each micro-batch's sum was seeded with 1/4 (the returned loss and
    the gradients a quarter of eager's)."""
    torch.manual_seed(0)
    model, ref = Regressor(loss), Regressor(loss)
    ref.load_state_dict(model.state_dict())
    opt_kind = functools.partial(torch.optim.SGD, lr=0.01)
    step = piper.compile(model, directives=[piper.split(4)], codegen="eager", optimizer=opt_kind)
    opt = opt_kind(ref.parameters())
    for s in range(3):
        gen = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        got = step(x, y).item()
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        opt.step()
        assert got == pytest.approx(want.item(), rel=1e-6)


def test_label_means_over_different_labels_warn_when_they_disagree() -> None:
    """Two cross-entropies over differently padded targets: each micro-batch counts other labels for
    each, so one seed per micro-batch cannot weigh both; the call checks and keeps the sample weights."""
    step, items = _items("two_targets")
    assert items is not None and items.exact and len(items.parts) == 2
    x, y = _batch()
    assert not items.counts(_args(step, x, y), 4, 2).agree
    assert items.counts(_args(step, x, torch.ones_like(y)), 4, 2).agree
    torch.manual_seed(0)
    step = piper.compile(Tagger("two_targets"), directives=[piper.split(2)], codegen="eager", optimizer=SGD)
    with pytest.warns(UserWarning, match="count different labels"):
        step(x, y)
