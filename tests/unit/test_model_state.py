"""One training state per model instance (runtime/registry.py), and the call check's rules
(runtime/consistency.py) in one process."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import piper_compile as piper
from piper_compile.runtime.consistency import (
    ALL_ITEMS, CallCheck, CallLayout, CallRecord, batch_fingerprint, replicas, validate, weights_for,
)
from piper_compile.testing.models import build_model

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _compile(model: nn.Module, **options: Any) -> Any:
    return torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": [], "codegen": "eager", **options})


def _eager_steps(model: nn.Module, batches: list[tuple[torch.Tensor, ...]], steps: int = 2) -> list[float]:
    opt = SGD(model.parameters())
    losses = []
    for x, y in batches[:steps]:
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _batches(model: Any, n: int = 2) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    return [model.make_batch(8, gen) for _ in range(n)]


def test_two_models_of_one_class_with_equal_options_train_apart() -> None:
    """On main the second model reused the first's compiled step and training state: its updates landed
    on the first model and it never trained. Now each trains exactly as it would alone, interleaved."""
    a, b = build_model("mlp", 0), build_model("mlp", 1)
    ref_a, ref_b = build_model("mlp", 0), build_model("mlp", 1)
    sa, sb = _compile(a, optimizer=SGD), _compile(b, optimizer=SGD)
    batches = _batches(a)
    la, lb = [], []
    for x, y in batches:
        la.append(sa(x, y).item())
        lb.append(sb(x, y).item())
    assert la == pytest.approx(_eager_steps(ref_a, batches), abs=1e-6)
    assert lb == pytest.approx(_eager_steps(ref_b, batches), abs=1e-6)
    for p, q in zip(list(a.parameters()) + list(b.parameters()), list(ref_a.parameters()) + list(ref_b.parameters())):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert piper.optimizer(sa) is not piper.optimizer(sb)
    assert piper.compiled_steps(sb)[0].state is not piper.compiled_steps(sa)[0].state


def test_without_a_piper_optimizer_each_model_gets_its_own_gradients() -> None:
    a, b = build_model("mlp", 0), build_model("mlp", 1)
    ref_a, ref_b = build_model("mlp", 0), build_model("mlp", 1)
    sa, sb = _compile(a), _compile(b)
    x, y = _batches(a, 1)[0]
    sa(x, y)
    sb(x, y)
    for model, ref in ((a, ref_a), (b, ref_b)):
        ref(x, y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


class _Head(nn.Module):
    def __init__(self, trunk: nn.Module, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = trunk
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(torch.tanh(self.trunk(x))), y)


def _two_heads(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    trunk = nn.Linear(32, 32)
    return _Head(trunk, 1), _Head(trunk, 2)


def test_models_sharing_a_trunk_train_it_as_eager_would() -> None:
    """Two compiled models sharing a trunk each train their own parameters (on main the second model was
    handed the first's state because they share parameters); the trunk is stepped by both optimizers, as
    two eager optimizers over overlapping parameters would."""
    a, b = _two_heads()
    ra, rb = _two_heads()
    sa, sb = _compile(a, optimizer=SGD), _compile(b, optimizer=SGD)
    oa, ob = SGD(ra.parameters()), SGD(rb.parameters())
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)
        for step, ref, opt in ((sa, ra, oa), (sb, rb, ob)):
            loss = step(x, y)
            ref_loss = ref(x, y)
            opt.zero_grad()
            ref_loss.backward()
            opt.step()
            assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    for p, q in zip(list(a.parameters()) + list(b.head.parameters()), list(ra.parameters()) + list(rb.head.parameters())):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.fixture
def fake_world() -> Any:
    from piper_compile.runtime import groups

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()
        groups._GROUPS.clear()


def test_shared_parameters_with_a_sharded_model_are_refused(fake_world: Any) -> None:
    """Under ZeRO the trunk becomes a view of a flat shard buffer; the other model would update storage
    that is no longer its parameter. Refused with an error naming the shared weights."""
    a, b = _two_heads()
    opts = {"directives": [piper.replicate(zero=1)], "optimizer": SGD}
    sa, sb = _compile(a, **opts), _compile(b, **opts)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    sa(x, y)
    with pytest.raises(piper.PiperError, match=r"shares 2 parameter\(s\) \(trunk.bias, trunk.weight\)"):
        sb(x, y)


def test_optimizer_made_before_the_first_call_is_the_one_that_steps() -> None:
    a, b = build_model("mlp", 0), build_model("mlp", 1)
    sa, sb = _compile(a, optimizer=SGD), _compile(b, optimizer=SGD)
    oa, ob = piper.optimizer(sa), piper.optimizer(sb)
    x, y = _batches(a, 1)[0]
    sa(x, y)
    sb(x, y)
    assert piper.optimizer(sa) is oa and piper.optimizer(sb) is ob
    assert oa.state and ob.state and oa is not ob


# -- the call check's rules --------------------------------------------------------------------------
def _rec(program: int = 7, call: int = 0, batch: int = 8, forward_only: bool = False, data: int = 0) -> CallRecord:
    return CallRecord(0, program, call, batch, 11, forward_only, data)


LAYOUT = CallLayout(2, (0, 1), 1, (0, 1))


def test_validate_names_what_each_rank_called() -> None:
    with pytest.raises(piper.PiperRuntimeError) as e:
        validate([_rec(), _rec(program=9, forward_only=True), _rec()], CallLayout(2, (0, 1, 2), 1, (0, 1, 2)))
    msg = str(e.value)
    assert "ranks [0, 2]: a training step of model #0, its call #0" in msg
    assert "rank 1: a forward-only (torch.no_grad) step of model #0, its call #0" in msg
    with pytest.raises(piper.PiperRuntimeError, match="its call #3"):
        validate([_rec(call=3), _rec(call=4)], LAYOUT)
    validate([_rec(batch=8), _rec(batch=4)], LAYOUT)  # uneven data-parallel batches are fine
    with pytest.raises(piper.PiperRuntimeError, match="same call but planned different programs.*sequence length"):
        validate([_rec(), _rec(program=9)], LAYOUT)


def test_validate_batches() -> None:
    with pytest.raises(piper.PiperRuntimeError, match="5 on rank 1 cannot be split into 2 micro-batches"):
        validate([_rec(), _rec(batch=5)], LAYOUT)
    with pytest.raises(piper.PiperRuntimeError, match="ranks \\[0, 1\\] hold one replica"):
        validate([_rec(batch=8), _rec(batch=4)], CallLayout(2, (1,), 1, (0, 0)))


def test_validate_batch_contents_within_a_replica() -> None:
    """Ranks of one replica (here PP2 x DP2: ranks 0 and 2 are stages of replica 0) given different samples
    of one size raise, naming the replicas; data-parallel replicas may differ; 0 means not compared."""
    layout = CallLayout(2, (2, 3), 1, (0, 1, 0, 1))
    with pytest.raises(piper.PiperRuntimeError) as e:
        validate([_rec(data=5), _rec(data=6), _rec(data=7), _rec(data=6)], layout)
    msg = str(e.value)
    assert "ranks [0, 2] hold one replica" in msg and "different contents of the same size" in msg
    assert "2 data-parallel replica(s): ranks [0, 2], ranks [1, 3]" in msg and "DistributedSampler" in msg
    validate([_rec(data=5), _rec(data=6), _rec(data=5), _rec(data=6)], layout)
    validate([_rec(data=5), _rec(data=0), _rec(data=7), _rec(data=0)], CallLayout(2, (0, 1, 2, 3), 1, (0, 1, 2, 3)))


def test_batch_fingerprint_sees_contents_order_and_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (8, 16), generator=g)
    x = torch.randn(8, 3, 5, generator=g)
    base = batch_fingerprint([tokens, x])
    assert base == batch_fingerprint([tokens.clone(), x.transpose(0, 2).contiguous().transpose(0, 2)])  # equal values, other layout
    assert base != batch_fingerprint([tokens.flip(0), x])  # rows in another order
    assert base != batch_fingerprint([tokens, x.double()])
    nudged = x.clone()
    nudged[5, 2, 4] = torch.nextafter(nudged[5, 2, 4], torch.tensor(1e9))  # one bit of one element
    assert base != batch_fingerprint([tokens, nudged])
    big = torch.randn(5000, generator=g)
    swapped = big.clone()
    swapped[[10, 4000]] = big[[4000, 10]]  # two elements trade places (equal plain sums)
    assert batch_fingerprint([big]) != batch_fingerprint([swapped])
    odd = [torch.zeros(0, 4), torch.tensor([True, False]), torch.randn(3, dtype=torch.complex64, generator=g),
           torch.randn(4, generator=g).to(torch.bfloat16)]
    assert batch_fingerprint(odd) == batch_fingerprint([t.clone() for t in odd]) != 0
    assert batch_fingerprint([torch.nan * torch.ones(3)]) == batch_fingerprint([torch.nan * torch.ones(3)])


def test_weights_are_sample_counts_and_exact_when_even() -> None:
    even = weights_for(CallLayout(2, (0, 1), 1, (0, 1)), [8, 8], 0)
    assert even.seed == 1.0 / 4 and even.loss_divisor == 4.0
    w0, w1 = (weights_for(CallLayout(1, (0, 1), 1, (0, 1)), [12, 4], r) for r in (0, 1))
    assert w0.seed == pytest.approx(12 / 16) and w1.seed == pytest.approx(4 / 16)
    assert 1 / w0.loss_divisor + 1 / w1.loss_divisor == pytest.approx(1.0)
    tp = weights_for(CallLayout(1, (0, 1, 2, 3), 2, (0, 0, 2, 2)), [6, 6, 2, 2], 0)  # TP2 x DP2
    assert tp.seed == pytest.approx(6 / 8)


def test_replicas_join_peers() -> None:
    assert replicas(4, [(0, 1), (2, 3)]) == (0, 0, 2, 2)
    assert replicas(3, []) == (0, 1, 2)


# -- a trained model changed under piper ------------------------------------------------------------------
def test_a_parameter_replaced_after_training_started_is_refused() -> None:
    """``model.fc.weight = nn.Parameter(...)`` between steps: piper's optimizer state belongs to the old
    tensor. Before, data parallel silently started a fresh optimizer for the whole model (AdamW moments and
    step counts gone) and ZeRO/pipeline runs blamed "another model"; now the call names the parameter and
    the in-place way. An in-place change of the values trains on, as eager would."""
    model = build_model("mlp", 0)
    ref = build_model("mlp", 0)
    step = piper.compile(model, codegen="eager", optimizer=SGD)
    (x, y), = _batches(model, 1)
    step(x, y)
    name, p = next(iter(model.named_parameters()))
    owner, attr = (model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]) if "." in name else (model, name)
    with torch.no_grad():
        p.mul_(0.5)  # in place: fine
    step(x, y)
    setattr(owner, attr, nn.Parameter(p.detach().clone()))
    with pytest.raises(piper.PiperError, match=rf"1 parameter\(s\) of this model were replaced .*\({name}\).*copy_"):
        step(x, y)
    opt = SGD(ref.parameters())
    for i in range(2):
        if i == 1:
            with torch.no_grad():
                next(iter(ref.parameters())).mul_(0.5)
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    setattr(owner, attr, p)  # the trained tensor back: the model is the one piper trains again
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_a_parameter_replaced_in_a_model_with_an_unused_one_is_refused() -> None:
    """The check compared the whole module with the parameters the forward reads, so a model holding a
    parameter its forward never reads skipped it: a replaced weight silently got a fresh optimizer."""
    model = build_model("mlp", 0)
    model.spare = nn.Linear(4, 4)  # never read by the forward
    step = piper.compile(model, codegen="eager", optimizer=SGD)
    (x, y), = _batches(model, 1)
    step(x, y)
    model.layers[1].weight = nn.Parameter(model.layers[1].weight.detach().clone())
    with pytest.raises(piper.PiperError, match=r"1 parameter\(s\) of this model were replaced .*\(layers.1.weight\)"):
        step(x, y)


def test_a_model_converted_after_training_started_is_refused() -> None:
    """``model.to(torch.bfloat16)`` between steps failed deep in a kernel ("expected scalar type BFloat16
    but found Float"); now the call names the parameters, the dtypes, and mixed_precision."""
    model = build_model("mlp", 0)
    step = piper.compile(model, codegen="eager", optimizer=SGD)
    (x, y), = _batches(model, 1)
    step(x, y)
    model.to(torch.float64)
    with pytest.raises(piper.PiperError, match=r"changed dtype or device .* torch.float32 on cpu -> torch.float64 on "
                                               r"cpu.*mixed_precision"):
        step(x.double(), y.double())


def test_item_weights_where_items_are_not_proportional_to_samples() -> None:
    """Every label kept, but replica 1's samples are half as long (padded to its own length): the token
    mean weighs replicas by tokens (24 and 8 of 32), not by samples (half each)."""
    layout = CallLayout(1, (0, 1), 1, (0, 1))
    rows = [CallRecord(0, 7, 0, 4, 11, False, 0, 24.0, ALL_ITEMS), CallRecord(0, 7, 0, 4, 11, False, 0, 8.0, ALL_ITEMS)]
    check = CallCheck.alone(rows[0], 1, (24.0,))
    check.layout, check.table = layout, torch.tensor([r.row() for r in rows])
    assert check.resolve().seeds == (0.75,)
    even = [CallRecord(0, 7, 0, 4, 11, False, 0, 24.0, ALL_ITEMS), CallRecord(0, 7, 0, 2, 11, False, 0, 12.0, ALL_ITEMS)]
    check = CallCheck.alone(even[0], 1, (24.0,))
    check.layout, check.table = layout, torch.tensor([r.row() for r in even])
    assert check.resolve().seeds == () and check.resolve().seed == pytest.approx(4 / 6)  # by samples, as before
