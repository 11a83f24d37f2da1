"""Losses that are not means over samples, on every strategy, equal single-process training on the
global batch (``capture/items.py``): a mean over items -- a language model's cross-entropy over padded
labels (-100) -- and a sum over the batch (``reduction="sum"``).

Before: each micro-batch's and replica's mean weighed its share of the *samples*, so a micro-batch of
short sequences counted as much as one of long ones, and DP2 x split(2) of the bench GPT trained to a
different loss at step 2 (4.1532 against eager's 4.1302, 4.3384 against 4.3851 at step 3). The batches
here keep a different number of labels per row, and at step 1 two rows keep none: one micro-batch of
the split(4) cases has no items at all (its own mean is 0/0; it must weigh nothing)."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.hf import LlamaLoss
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, run_mixed_parity, run_parity

pytestmark = pytest.mark.slow

GPT = {"layers": 2}
ADAMW = ("AdamW", {"lr": 1e-3, "weight_decay": 0.01})
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


def _pp_dp(zero: int, m: int = 2) -> list:
    return [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(m), *piper.schedules.one_f_one_b(2, m),
            piper.replicate({"PP": "*"}, zero=zero, bucket_mb=0.01)]


@pytest.mark.parametrize("case", ["dp2_split4", "dp2_uneven_zero1", "pp2_1f1b", "dp2_split2_inductor"])
def test_item_mean_two_ranks(case: str) -> None:
    cfg = {
        "dp2_split4": RunConfig(model="gpt", model_kwargs=GPT, directives=[piper.replicate(), piper.split(4)]),
        "dp2_uneven_zero1": RunConfig(model="gpt", model_kwargs=GPT, batches=(12, 4), optimizer=ADAMW,
                                      directives=[piper.replicate(zero=1), piper.split(2)]),
        "pp2_1f1b": RunConfig(model="gpt", model_kwargs=GPT, stages=2, no_grad_eval=True,
                              directives=[*piper.pipeline(2), piper.split(4), *piper.schedules.one_f_one_b(2, 4)]),
        "dp2_split2_inductor": RunConfig(model="gpt", model_kwargs=GPT, codegen="inductor",
                                         directives=[piper.replicate(), piper.split(2)]),
    }[case]
    run_parity(RunConfig(**{**cfg.__dict__, "ignored_labels": True}), 2)


def test_item_mean_pp2_x_dp2_zero3() -> None:
    run_parity(RunConfig(model="gpt", model_kwargs=GPT, stages=2, directives=_pp_dp(3), optimizer=ADAMW,
                         ignored_labels=True), 4)


def test_item_mean_tp2() -> None:
    """Both ranks of the tensor-parallel group hold the loss: each replica's items count once."""
    run_parity(RunConfig(model="gpt", model_kwargs=GPT, directives=[piper.split(2), piper.shard_tensor(TP)],
                         local_batch=4, tp=2, ignored_labels=True), 2)


def test_item_mean_bf16() -> None:
    """Mixed precision: the reference seeds each piece with its items' share too (``ComputeCopy``)."""
    run_mixed_parity(RunConfig(model="gpt", model_kwargs=GPT, optimizer=ADAMW, mixed_precision={"param_dtype": "bf16"},
                               directives=[piper.replicate(zero=2, bucket_mb=0.01), piper.split(2)],
                               ignored_labels=True), 2)


def _padded(model: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of 8 whose rows keep 2, 4, ... 16 labels (transformers' loss shifts them itself)."""
    ids, labels = model.make_batch(8, torch.Generator().manual_seed(step))
    labels = labels.clone()
    for r in range(8):
        labels[r, 2 + 2 * r:] = -100
    return ids, labels


def _eager_losses(ref: torch.nn.Module, batch_of: Any, steps: int = 3) -> list[float]:
    """Eager SGD on the whole batch ``batch_of(step)`` of each step: its losses (``ref`` trained in place)."""
    opt = SGD(ref.parameters())
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = ref(*batch_of(s))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _hf_worker(rank: int, world: int) -> dict[str, Any]:
    model = LlamaLoss(hf_loss=True, seed=0, num_hidden_layers=2)
    step = piper.compile(model, directives=[piper.replicate(zero=1), piper.split(2)], codegen="eager",
                         optimizer=SGD)
    losses = [step(*(t[4 * rank:4 * rank + 4] for t in _padded(model, s))).item() for s in range(3)]
    return {"losses": losses, "params": piper.trained_parameters(step)}


def test_transformers_shifted_loss_over_padded_labels() -> None:
    """A Llama's own ``labels=`` loss (pad-and-shift inside transformers), DP2 ZeRO-1 x split(2)."""
    res = run_local(_hf_worker, 2, timeout_s=600)
    ref = LlamaLoss(hf_loss=True, seed=0, num_hidden_layers=2)
    want = _eager_losses(ref, lambda s: _padded(ref, s))
    for r in res:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(res[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["dp2_split2_zero1", "pp2_1f1b"])
def test_sum_over_the_batch(case: str) -> None:
    """``reduction="sum"``: each piece's sum adds up unweighted. Before, each was seeded with 1/(M x R) as
    a mean would be, so the loss and gradients came out M x R times too small (27.8 for eager's 55.7)."""
    mlp = {"reduction": "sum"}
    cfg = RunConfig(model="mlp", model_kwargs=mlp, directives=[piper.replicate(zero=1), piper.split(2)])
    if case == "pp2_1f1b":
        cfg = RunConfig(model="mlp", model_kwargs=mlp, stages=2, no_grad_eval=True,
                        directives=[*piper.pipeline(2), piper.split(4), *piper.schedules.one_f_one_b(2, 4)])
    run_parity(RunConfig(**{**cfg.__dict__, "optimizer": ("SGD", {"lr": 0.002, "momentum": 0.9})}), 2)


def test_item_mean_expert_parallel() -> None:
    """EP2: every rank holds the loss of its own replica; tokens routed across ranks."""
    run_parity(RunConfig(model="moegpt", model_kwargs={"layers": 2, "experts": 4, "top_k": 2}, local_batch=4,
                         directives=[piper.split(2), piper.replicate(), piper.shard({"EP": "*"})],
                         ignored_labels=True), 2)


def _weighted_pp2(rank: int, world: int) -> list[float]:
    from tests.unit.test_item_losses import Tagger, _batch

    torch.manual_seed(0)
    model = Tagger("weighted")
    piper.annotate(model.emb, PP=0)
    piper.annotate(model.head, PP=1)
    step = piper.compile(model, directives=[*piper.pipeline(2), piper.split(4), *piper.schedules.one_f_one_b(2, 4)],
                         codegen="eager", optimizer=SGD)
    return [step(*_batch(8, s)).item() for s in range(3)]


def test_class_weighted_item_mean_pp2() -> None:
    """Class weights held by the last stage (released on the first): only the ranks holding the loss
    count its items; both return eager's losses."""
    from tests.unit.test_item_losses import Tagger, _batch

    res = run_local(_weighted_pp2, 2, timeout_s=300)
    torch.manual_seed(0)
    ref = Tagger("weighted")
    want = _eager_losses(ref, lambda s: _batch(8, s))
    for r in res:
        assert r == pytest.approx(want, rel=1e-5)


def _masked_batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.unit.test_batch_terms import _batch

    x, y = _batch(s)
    if s == 0:
        y[:2, 0] = -5.0  # rows 0-1 keep nothing: a micro-batch without items on rank 0 / stage input
    return x, y


def _masked_worker(rank: int, world: int, job: tuple[str, str]) -> dict[str, Any]:
    from tests.unit.test_batch_terms import Net

    case, kind = job
    torch.manual_seed(0)
    model = Net(kind)
    if case == "pp2_1f1b":
        piper.annotate(model.a, PP=0)
        piper.annotate(model.b, PP=1)
        directives = [*piper.pipeline(2), piper.split(4), *piper.schedules.one_f_one_b(2, 4)]
    else:
        directives = [piper.replicate(zero=1), piper.split(2)]
    step = piper.compile(model, directives=directives, codegen="eager", optimizer=SGD)
    rows = slice(None) if case == "pp2_1f1b" else slice(4 * rank, 4 * rank + 4)
    losses = [step(*(t[rows] for t in _masked_batch(s))).item() for s in range(3)]
    return {"losses": losses, "params": piper.trained_parameters(step)}


@pytest.mark.parametrize("case,kind", [("dp2_split2_zero1", "masked"), ("pp2_1f1b", "masked"),
                                       ("dp2_split2_zero1", "masked_apart")])
def test_hand_written_masked_mean(case: str, kind: str) -> None:
    """``(loss * mask).sum() / mask.sum()`` (``capture/decompose.py``): every piece weighs its count's share
    of the global count; a micro-batch that keeps no row adds nothing and puts no NaN anywhere. Where the
    sum is not masked (``l.sum() / mask.sum()``), that micro-batch's rows still add their sum over the
    global count, as in eager (before: left out, loss 1.48 against eager's 6.79 at step 0)."""
    from tests.unit.test_batch_terms import Net

    res = run_local(_masked_worker, 2, (case, kind), timeout_s=300)
    torch.manual_seed(0)
    ref = Net(kind)
    want = _eager_losses(ref, _masked_batch)
    for r in res:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
    trained = {**res[0]["params"], **res[1]["params"]}  # a pipeline stage holds its own layer
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        torch.testing.assert_close(trained[name], ref.get_parameter(name).detach(), rtol=1e-5, atol=1e-6)
