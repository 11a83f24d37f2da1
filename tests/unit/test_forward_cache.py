"""piper.compile's traced forward on disk (``capture/forward_cache.py``): a warm model loads it and runs no
Dynamo trace at all, training bitwise as the traced one; whatever the trace depended on and the call
changed (an attribute, a global, a line of source, a replaced torch function, the batch size) traces
again and trains as a fresh trace does; a guard failing after the load recompiles through Dynamo with
piper's one-line message."""
from __future__ import annotations

import enum
import functools
import importlib
import os
import sys
import textwrap

import pytest
import torch
from torch import nn

import piper_compile as piper
from piper_compile.capture import forward_cache
from piper_compile.capture.identity import identity
from piper_compile.disk import TESTED_TORCH, torch_version
from piper_compile.testing.models import GPT, GPTConfig, build_model

SGD = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    if torch_version() < TESTED_TORCH:  # 'auto' is off there (the GPU machine's 2.11): asked for by name
        monkeypatch.setenv("PIPER_FORWARD_CACHE", "on")
        monkeypatch.setenv("PIPER_CAPTURE_CACHE", "turns")  # an entry names the joint graph's entry
    return tmp_path / "inductor" / "piper-forward"


@pytest.fixture
def dynamo_traces(monkeypatch):
    """How many frames Dynamo traced (its hook's and piper's whole-graph capture both go through here)."""
    from torch._dynamo import convert_frame

    seen = []
    original = convert_frame.compile_frame

    def counted(*args, **kwargs):
        seen.append(args[0].co_name)
        return original(*args, **kwargs)

    monkeypatch.setattr(convert_frame, "compile_frame", counted)
    return seen


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(dim=32, heads=2, layers=3, seq=16, vocab=64))


def _train(model: nn.Module, batch: int = 4, steps: int = 3, edit=None):
    """Losses of ``steps`` steps (``edit(model)`` after the first), the parameters after, the stats of the
    first step and of the last."""
    x, y = model.make_batch(batch, torch.Generator().manual_seed(1))
    step = piper.compile(model, directives=[piper.split(2)], optimizer=SGD, codegen="eager")
    losses, first = [], None
    for i in range(steps):
        if i == 1 and edit is not None:
            edit(model)
        losses.append(float(step(x, y).detach()))
        first = first or piper.stats(step)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, first, piper.stats(step)


def _same(a, b) -> None:
    assert a[0] == b[0]
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


class Encoder(nn.Module):
    """torch's own transformer layers: their trace guards pytree's node registry (by its keys) and torch by
    an import."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.enc(self.emb(x))).flatten(0, 1), y.flatten())

    def make_batch(self, batch: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 64, (batch, 8), generator=g)
        return x, x.roll(1, dims=1)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "moegpt":  # piper's expert op: guarded as torch.ops.piper.moe_experts
        return build_model("moegpt", 0, dim=32, heads=2, layers=2, seq=16, vocab=64)
    return Encoder() if kind == "encoder" else _gpt()


@pytest.mark.parametrize("kind", ["gpt", pytest.param("moegpt", marks=pytest.mark.slow),  # 20 s each: full suite
                                  pytest.param("encoder", marks=pytest.mark.slow)])
def test_a_warm_model_runs_no_dynamo_trace_and_trains_bitwise_as_the_traced_one(cache_dir, dynamo_traces, kind):
    cold = _train(_model(kind))
    assert cold[2].forward == "traced" and len(os.listdir(cache_dir)) == 1
    traced = len(dynamo_traces)
    warm = _train(_model(kind))
    assert warm[2].forward == "loaded" and len(dynamo_traces) == traced  # no frame traced for the warm model
    _same(cold, warm)


def test_the_traced_forward_trains_as_dynamos_own_path(cache_dir, monkeypatch):
    ours = _train(_gpt())
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    theirs = _train(_gpt())
    assert (ours[2].forward, theirs[2].forward) == ("traced", "dynamo")
    _same(ours, theirs)
    assert len(os.listdir(cache_dir)) == 1  # the off run wrote nothing


def _with_eps(model: nn.Module) -> None:
    model.blocks[2].ln1.eps = 0.5


def test_an_attribute_changed_before_the_warm_call_traces_again(cache_dir, monkeypatch):
    _train(_gpt())
    model = _gpt()
    _with_eps(model)
    warm = _train(model)
    assert warm[2].forward == "traced"
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    model = _gpt()
    _with_eps(model)
    _same(warm, _train(model))


def _eps_model() -> nn.Module:
    model = _gpt()
    _with_eps(model)
    return model


def test_two_configurations_alternating_each_load_their_own_trace(cache_dir, monkeypatch):
    """Before: one entry per name, so runs alternating between two configurations (a sweep, a training and
    an evaluation script) overwrote each other's entry and traced every time."""
    runs = [_train(make()) for make in (_gpt, _eps_model, _gpt, _eps_model)]
    assert [r[2].forward for r in runs] == ["traced", "traced", "loaded", "loaded"]
    assert len(os.listdir(cache_dir)) == 2
    _same(runs[0], runs[2])
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    _same(runs[3], _train(_eps_model()))


def test_the_least_recently_used_trace_is_evicted(cache_dir, monkeypatch):
    monkeypatch.setattr(forward_cache, "SLOTS", 2)
    third = _gpt()
    third.blocks[0].ln2.eps = 0.25
    for model in (_gpt(), _eps_model(), _gpt()):  # the plain model's entry is used last
        _train(model)
    assert _train(third)[2].forward == "traced"  # evicts the eps model's
    assert len(os.listdir(cache_dir)) == 2
    assert [_train(m)[2].forward for m in (_gpt(), _eps_model())] == ["loaded", "traced"]


def test_a_new_trace_drops_the_file_of_the_one_entry_layout(cache_dir):
    _train(_gpt())
    (slot,) = os.listdir(cache_dir)
    legacy = cache_dir / f"{slot.split('.')[0]}.pkl"  # where the entry lived before entries had slots
    legacy.write_bytes(b"an entry of the old layout")
    assert _train(_eps_model())[2].forward == "traced"
    assert not legacy.exists() and len(os.listdir(cache_dir)) == 2


def test_an_attribute_changed_after_the_load_recompiles_with_the_guard_named(cache_dir, monkeypatch):
    _train(_gpt())
    with pytest.warns(UserWarning, match=r"compiles the piper step again: a guard failed: .*eps"):
        warm = _train(_gpt(), edit=_with_eps)
    assert warm[2].forward == "loaded"  # the first step; the second compiled through Dynamo
    assert (warm[3].forward, warm[3].recompiles) == ("dynamo", 1)
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    _same(warm, _train(_gpt(), edit=_with_eps))


def test_another_batch_size_traces_again(cache_dir):
    _train(_gpt(), batch=4)
    warm = _train(_gpt(), batch=6)
    assert warm[2].forward == "traced"


def test_a_replaced_torch_function_is_not_taken_for_the_traced_one(cache_dir, monkeypatch):
    _train(_gpt())
    gelu = torch.nn.functional.gelu
    monkeypatch.setattr(torch.nn.functional, "gelu", lambda x, approximate="none": 2 * gelu(x, approximate=approximate))
    warm = _train(_gpt())
    assert warm[2].forward == "traced"
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    _same(warm, _train(_gpt()))


_USER_MODEL = '''
import torch
from torch import nn

SCALE = 1.0


def act(x):
    return torch.tanh(x) * 1.0


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return act(self.lin(x)) + x * 0.5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Layer()
        self.b = nn.Linear(8, 1)

    def forward(self, x, y):
        return ((self.b(self.a(x)) * SCALE - y) ** 2).mean()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A model defined in a file of the user's, which the test edits between runs."""
    path = tmp_path / "users_model.py"
    path.write_text(textwrap.dedent(_USER_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("users_model", None)
    yield path
    sys.modules.pop("users_model", None)


def _train_user(module, steps: int = 3):
    torch.manual_seed(0)
    model = module.Net()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    step = piper.compile(model, directives=[piper.split(2)], optimizer=SGD, codegen="eager")
    losses = [float(step(x, y).detach()) for _ in range(steps)]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, piper.stats(step), None


@pytest.mark.parametrize("edit", [("torch.tanh(x) * 1.0", "torch.tanh(x) * 3.0"),  # a function (guarded by identity)
                                  ("x * 0.5", "x * 0.25")])  # a layer's forward (its class is guarded by name)
def test_an_edited_line_the_forward_runs_traces_again(cache_dir, user_module, monkeypatch, edit):
    module = importlib.import_module("users_model")
    assert _train_user(module)[2].forward == "traced"
    assert _train_user(module)[2].forward == "loaded"
    user_module.write_text(user_module.read_text().replace(*edit))
    module = importlib.reload(module)
    edited = _train_user(module)
    assert edited[2].forward == "traced"
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    _same(edited, _train_user(module))


def test_a_changed_global_the_forward_reads_traces_again(cache_dir, user_module, monkeypatch):
    module = importlib.import_module("users_model")
    first = _train_user(module)
    assert _train_user(module)[2].forward == "loaded"
    monkeypatch.setattr(module, "SCALE", 2.0)
    changed = _train_user(module)
    assert changed[2].forward == "traced" and changed[0] != first[0]
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    _same(changed, _train_user(module))


def test_identities_name_objects_the_same_way_in_another_process():
    import math

    assert identity(math) == "module math"
    assert identity(torch.arange) == "object torch.arange"
    assert identity(nn.Linear).startswith("class torch.nn.modules.linear.Linear ")  # and its code
    assert identity(object()) is None  # nothing names an arbitrary object across processes
    assert identity(lambda x: x).startswith("function - ")  # by its code
    captured = object()
    assert identity(lambda x: captured) is None  # a closure over an unnameable object

    def scaled(s):
        return lambda x: x * s

    assert identity(scaled(2.0)) == identity(scaled(2.0)) != identity(scaled(3.0))
    assert identity(Color.RED) == f"enum {Color.__module__}.Color.RED"
    before = identity(Color)
    Color.describe = lambda self: "red"  # a method more: another class for code traced with the first
    try:
        assert identity(Color) != before
    finally:
        del Color.describe
    assert identity(Color) == before


class Color(enum.Enum):
    RED = 1


def test_another_structure_of_the_same_class_traces_again(cache_dir, monkeypatch):
    _train(_gpt())
    torch.manual_seed(0)
    deeper = _train(GPT(GPTConfig(dim=32, heads=2, layers=4, seq=16, vocab=64)))
    assert deeper[2].forward == "traced"
    monkeypatch.setenv("PIPER_FORWARD_CACHE", "off")
    torch.manual_seed(0)
    _same(deeper, _train(GPT(GPTConfig(dim=32, heads=2, layers=4, seq=16, vocab=64))))


@pytest.mark.slow  # 30 s: two transformers traces
@pytest.mark.skipif(torch_version() < TESTED_TORCH, reason="torch 2.11 cannot rebuild BERT's saved guards "
                    "(DefaultsSource.__init__ takes 3 arguments, its pickle gives 6): the load traces again")
@pytest.mark.parametrize("family", ["bert", "mistral"])
def test_a_transformers_model_loads_its_trace(cache_dir, monkeypatch, family):
    """BERT's trace reads ``type(x)`` through a global Dynamo names by the id of ``torch`` (``_<id>_c0``): the
    load installs torch under a name of its own and renames it in the guards. A decoder's causal mask is made
    under ``torch.vmap``, whose values the graph's metadata holds as functorch ``BatchedTensor`` fakes (kept as
    plain fakes of their logical shape), and its layers, stamped out of a nested compile region, guard each
    weight twice (one check kept on load). Before: the decoder was never saved, then never loaded."""
    from piper_compile.testing.hf import HFLoss

    def run():
        model = HFLoss(family, seed=0, num_hidden_layers=2)
        batch = model.make_batch(4, torch.Generator().manual_seed(0))
        step = piper.compile(model, directives=[piper.split(2)], optimizer=SGD, codegen="eager")
        losses = [float(step(*batch).detach()) for _ in range(2)]
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, piper.stats(step)

    cold = run()
    warm = run()
    assert (cold[2].forward, warm[2].forward) == ("traced", "loaded")
    _same(cold, warm)
