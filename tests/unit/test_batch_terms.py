"""Steps that do not add up over pieces of the batch (``capture/decompose.py``): each is refused where the
plan cuts the batch, naming the op, the user's line and the rule; runs as eager where nothing is cut; and
runs per piece where the user accepts that meaning (``options["local_batch_ops"]``). Losses that do add
up -- sums and means, a sum divided by a count passed in, means plus a term without the batch -- train as
eager with micro-batches. Before, every refused model here returned a plausible, different loss."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper
from piper_compile.api import capture_step
from piper_compile.capture.decompose import MEAN, SUM, batch_terms
from piper_compile.disk import torch_version

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class Net(nn.Module):
    """Two linear layers; ``kind`` picks what the forward does with the batch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b, self.kind = nn.Linear(8, 16), nn.Linear(16, 4), kind
        self.bn = nn.BatchNorm1d(16, track_running_stats=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        k = self.kind
        if k == "dispatch":  # rows picked by value, transformed, put back (MoE-style routing by nonzero)
            picked = (x[:, 0] > 0).nonzero().squeeze(1)
            x = x.index_add(0, picked, torch.tanh(x[picked]))
        h = self.a(x)
        h = {"batchnorm": lambda: self.bn(h), "center": lambda: h - h.mean(0),
             "softmax": lambda: h * F.softmax(h, dim=0), "cumsum": lambda: h.cumsum(0),
             "capacity": lambda: h * _within_capacity(h.argmax(-1), 16, 1).unsqueeze(-1),
             "sorted_dispatch": lambda: _by_route(h, h.argmax(-1))}.get(k, lambda: h)()
        o = self.b(torch.relu(h))
        mask, keep = (y[:, 0] > -1).float(), y[:, 0] > -1
        return {
            "masked": lambda: ((o - y).pow(2).mean(-1) * mask).sum() / mask.sum(),
            "masked_apart": lambda: (o - y).pow(2).mean(-1).sum() / mask.sum(),  # every row over the kept count
            "masked_by_output": lambda: (o - y).pow(2).mean(-1).sum() / (o[:, 0] > 0).float().sum(),
            "masked_plus": lambda: ((o - y).pow(2).mean(-1) * mask).sum() / mask.sum() + o.pow(2).mean(),
            "product": lambda: F.mse_loss(o, y) + o.mean() * h.mean(),
            "sum_and_mean": lambda: F.mse_loss(o, y, reduction="sum") + o.pow(2).mean(),
            "sum_and_const": lambda: F.mse_loss(o, y, reduction="sum") + self.a.weight.pow(2).sum(),
            "variance": lambda: F.mse_loss(o, y) + o.var(0).sum(),
            "sqrt": lambda: F.mse_loss(o, y).sqrt(),
            "square": lambda: (lambda m: m * m)(F.mse_loss(o, y)),
            "top_k": lambda: (o - y).pow(2).mean(-1).topk(2).values.mean(),
            "sum_by_count": lambda: F.mse_loss(o, y, reduction="sum") / count,
            "selected_sum": lambda: (o - y).pow(2).mean(-1)[keep].sum(),
            "selected_ce": lambda: F.cross_entropy(o[keep], y.argmax(-1)[keep]),
            "ce_by_output": lambda: F.cross_entropy(o[o[:, 0] > 0], y.argmax(-1)[o[:, 0] > 0]),
            "ce_ignore_by_output": lambda: F.cross_entropy(o, torch.where(o[:, 0] > 0, y.argmax(-1), -100)),
            "ce_kept_by_output": lambda: (F.cross_entropy(o, y.argmax(-1), reduction="none")
                                          * (o[:, 0] > 0)).sum() / len(y),  # what the refusal advises
            "selected_mse": lambda: F.mse_loss(o[keep], y[keep]),
            "sums": lambda: (o - y).pow(2).sum() + 0.5 * (o - y).abs().sum() * 2,
            "mean_and_const": lambda: F.mse_loss(o, y) + 0.1 * self.a.weight.pow(2).sum(),
            "one_minus": lambda: 1 - F.cosine_similarity(o, y).mean() + (2.0 - F.mse_loss(o, y)) * 0.5,
            "stacked": lambda: torch.stack([F.mse_loss(o, y), F.l1_loss(o, y)]).mean(),
            "sum_over_batch_size": lambda: (o - y).pow(2).sum() / x.shape[0],
        }.get(k, lambda: F.mse_loss(o, y))()


def _within_capacity(route: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """1.0 for a row within its expert's capacity, 0.0 for one dropped (GShard/Switch style)."""
    onehot = F.one_hot(route, experts)
    return ((onehot.cumsum(0) * onehot).sum(-1) <= capacity).float()


def _by_route(h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert, transformed, put back in place: an integer sort only permutes the batch."""
    order = route.argsort(stable=True)
    return torch.zeros_like(h).index_copy(0, order, torch.tanh(h[order]))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


REFUSED = {
    "batchnorm": ("_native_batch_norm_legit", "self.bn(h)", "together with a statistic over the batch"),
    "center": ("sub.Tensor", "h - h.mean(0)", "combines per-sample values with a statistic"),
    "softmax": ("_softmax", "F.softmax(h, dim=0)", "mixes samples along the batch dimension"),
    "cumsum": ("cumsum", "h.cumsum(0)", "mixes samples along the batch dimension"),
    "ce_by_output": ("nll_loss_forward", "F.cross_entropy(o[o[:, 0] > 0]", "labels that the model's own outputs"),
    "ce_ignore_by_output": ("nll_loss_forward", "torch.where(o[:, 0] > 0", "labels that the model's own outputs"),
    "capacity": ("cumsum", "onehot.cumsum(0)", "counts along the batch dimension by the samples' values"),
    "selected_mse": ("mse_loss", "F.mse_loss(o[keep], y[keep])", "averages samples selected by their values"),
    "masked_by_output": ("div.Tensor", "(o[:, 0] > 0)", "not a count known before the step"),
    "masked_plus": ("add.Tensor", "mask.sum() + o.pow(2).mean()", "adds other terms to a sum divided by a count"),
    "product": ("mul.Tensor", "o.mean() * h.mean()", "non-linear function"),
    "sqrt": ("sqrt", ".sqrt()", "non-linear function"),
    "square": ("mul.Tensor", "m * m", "non-linear function"),
    "variance": ("var", "o.var(0)", "not a sum or a mean over its samples"),
    "top_k": ("topk", "topk(2)", "not a sum or a mean over its samples"),
    "sum_and_mean": ("add.Tensor", "reduction=\"sum\") + o.pow(2).mean()", "adds a sum over the batch and a mean"),
    "sum_and_const": ("add.Tensor", "self.a.weight.pow(2).sum()", "adds a sum over the batch and a term without"),
}


# torch 2.11's Dynamo cannot trace a cross-entropy over rows the outputs select (data-dependent sizes it
# must compare: Ne(u0, u1)): piper names the line before any batch analysis
UNTRACEABLE_BEFORE_2_13 = {"ce_by_output"}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_a_step_that_does_not_add_up_is_refused_where_the_batch_is_cut(kind: str) -> None:
    op, line, rule = REFUSED[kind]
    torch.manual_seed(0)
    step = piper.compile(Net(kind), directives=[piper.split(2)], codegen="eager", optimizer=SGD)
    with pytest.raises(piper.PiperError) as err:
        step(*_batch(0))
    msg = str(err.value)
    if kind in UNTRACEABLE_BEFORE_2_13 and torch_version() < (2, 13):  # refused earlier, as clearly
        assert msg.startswith("piper: Dynamo cannot trace the training step as one graph at ") and line in msg, msg
        return
    assert msg.startswith("piper: the step does not add up over pieces of the batch: at ") and op in msg \
        and line in msg and rule in msg and "into 2 micro-batches" in msg and "local_batch_ops" in msg, msg
    assert "move it to dim 0" not in msg  # every input is cut: no note on the layout


class SeqFirst(nn.Module):
    """A sequence-first encoder, ``x: (time, batch, 8)``, with per-sample targets ``y: (batch, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.enc(x)[-1]), y)


def test_a_sequence_first_layout_is_named_in_the_refusal() -> None:
    """piper cuts dim 0: a ``(time, batch, ...)`` input reads as a batch of time steps. The refusal says
    which inputs it cut and which it passed whole, and to move the batch to dim 0 (before: only the op,
    ``out[-1]``, as a statistic of the batch, which misled)."""
    torch.manual_seed(0)
    step = piper.compile(SeqFirst(), directives=[piper.split(2)], codegen="eager", optimizer=SGD)
    with pytest.raises(piper.PiperError) as err:
        step(torch.randn(6, 4, 8), torch.randn(4, 4))
    assert "piper cuts the inputs along dim 0 (`x` (6)) and passes `y` (4) whole" in str(err.value), str(err.value)
    assert "move it to dim 0" in str(err.value)


def test_data_parallel_plans_are_refused_too() -> None:
    torch.manual_seed(0)
    with pytest.raises(piper.PiperError, match="h - h.mean.*into 2 data-parallel replicas"):
        piper.plan(Net("center"), *_batch(0), directives=[piper.replicate()], world_size=2)


def _eager(model: nn.Module, pieces: int, steps: int = 2, **kw: torch.Tensor) -> list[float]:
    """Eager SGD where each step's loss is the mean of its ``pieces`` equal pieces' own losses."""
    opt = SGD(model.parameters())
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = sum(model(*(t.chunk(pieces)[k] for t in _batch(s)), **kw) for k in range(pieces)) / pieces
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("kind", ["center", "product", "masked_plus"])
@pytest.mark.parametrize("split", [1, 2])
def test_whole_batch_exact_and_local_meaning_on_request(kind: str, split: int) -> None:
    """One micro-batch: eager's step (nothing is cut). split(2) with local_batch_ops: each half's own
    value, averaged -- what DDP computes."""
    torch.manual_seed(0)
    model = Net(kind)
    ref = copy.deepcopy(model)
    step = piper.compile(model, directives=[piper.split(split)], codegen="eager", optimizer=SGD,
                         local_batch_ops=split > 1)
    got = [step(*_batch(s)).item() for s in range(2)]
    assert got == pytest.approx(_eager(ref, split), rel=1e-5)


def _form(kind: str) -> str | None:
    torch.manual_seed(0)
    x, y = _batch(0)
    extra = (torch.tensor(8.0),) if kind == "sum_by_count" else ()
    step = capture_step(Net(kind), x, y, *extra, directives=[], world_size=1)
    step._capture()
    terms = batch_terms(step.joint)
    assert terms.problem is None
    return terms.form


@pytest.mark.parametrize("kind,form", [("plain", MEAN), ("mean_and_const", MEAN), ("sum_over_batch_size", MEAN),
                                       ("one_minus", MEAN), ("stacked", MEAN),
                                       ("sums", SUM), ("sum_by_count", SUM)])
def test_what_adds_up_is_told_apart(kind: str, form: str) -> None:
    assert _form(kind) == form


@pytest.mark.parametrize("kind", ["sum_by_count", "sums", "mean_and_const", "one_minus", "stacked",
                                  "sum_over_batch_size", "selected_sum", "selected_ce", "dispatch",
                                  "sorted_dispatch", "ce_kept_by_output"])
def test_what_adds_up_trains_as_eager_with_micro_batches(kind: str) -> None:
    """``sum / count`` with the count passed in (transformers' ``num_items_in_batch``): each piece's sum over
    the global count adds up. Before, it was weighed as a mean: its loss and gradients a quarter of eager's.
    Rows selected by value (``x[mask]``, ``nonzero``) stay per sample: their sum adds up, a cross-entropy
    over them is a mean over the rows each piece selects (weighed by its count), and rows routed out and
    back, or sorted by route and put back (an integer sort only permutes the batch), are untouched by the
    cut. Before, ``selected_ce`` crashed in planning (a size known only at run
    time has no hint) and, past that, weighed its micro-batches by samples."""
    torch.manual_seed(0)
    model = Net(kind)
    ref = copy.deepcopy(model)
    count = torch.tensor(32.0)
    step = piper.compile(model, directives=[piper.split(4)], codegen="eager", optimizer=SGD)
    extra = (count,) if kind == "sum_by_count" else ()
    got = [step(*_batch(s), *extra).item() for s in range(3)]
    kw = {"count": count} if kind == "sum_by_count" else {}
    assert got == pytest.approx(_eager(ref, 1, steps=3, **kw), rel=1e-5)
    # a sum's gradients are the whole batch's, not a mean's: four pieces' rounding differs from one
    # batch's by ~1e-5 of a weight after three SGD steps (a wrong weighing is off by 2x or more)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["masked", "masked_apart"])
def test_a_hand_written_masked_mean_trains_as_eager_even_with_an_empty_micro_batch(kind: str) -> None:
    """``(loss * mask).sum() / mask.sum()``: each micro-batch weighs its count's share of the global count
    (``capture/items.py``). Micro-batch 0 of step 0 has no kept rows: it weighs nothing, and its ``0 / 0``
    divides by 1 instead, so no NaN reaches the gradients. Before: refused; before that, a plausible wrong
    loss (micro-batch means averaged) or NaN. Where the sum is not masked (``masked_apart``), that
    micro-batch's sum is still added over the global count (before: left out, 1.48 against eager's 6.79)."""
    torch.manual_seed(0)
    model = Net(kind)
    ref = copy.deepcopy(model)
    step = piper.compile(model, directives=[piper.split(4)], codegen="eager", optimizer=SGD)
    opt = SGD(ref.parameters())
    for s in range(3):
        x, y = _batch(s)
        if s == 0:
            y[:2, 0] = -5.0  # micro-batch 0 keeps no row
        got = step(x, y).item()
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        opt.step()
        assert got == pytest.approx(want.item(), rel=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


class RouterLossQwen(nn.Module):
    """transformers' Qwen3-MoE with its router load-balancing loss added (``output_router_logits``)."""

    def __init__(self) -> None:
        super().__init__()
        from piper_compile.testing.hf import build_qwen3_moe

        self.model = build_qwen3_moe(seed=0, output_router_logits=True, num_hidden_layers=1)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


@pytest.mark.slow
def test_a_routers_load_balancing_loss_over_the_batch_is_refused_where_the_batch_is_cut() -> None:
    """Switch-style ``E * sum(tokens_per_expert * mean_router_prob)`` over the whole batch is a product of
    two batch means; each micro-batch's own would be a different number."""
    from piper_compile.testing.hf import make_batch

    model = RouterLossQwen()
    ids, _ = make_batch(4, torch.Generator().manual_seed(0), vocab=model.model.config.vocab_size)
    step = piper.compile(model, directives=[piper.split(2)], codegen="eager")
    # torch 2.11's Dynamo takes transformers' router logits for no tuple and the aux loss for an int
    # (AttributeError: 'to'): piper names the line that fails to trace
    refusal = (r"at mul.Tensor.*load_balancing_loss_func.*non-linear function" if torch_version() >= (2, 13)
               else r"cannot trace the training step as one graph at .*modeling_qwen3_moe.py:\d+ in forward")
    with pytest.raises(piper.PiperError, match=refusal):
        step(ids, ids.clone())
