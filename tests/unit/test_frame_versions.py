"""``torch.compile(model, backend="piper")`` never runs a model's forward eagerly (``capture/frame_versions.py``).

Dynamo keeps at most ``recompile_limit`` (8) versions of a frame per code object, counted together for
every model of a class (each ``torch.compile`` is a new backend), and past that runs the forward eagerly:
for piper, a step that trains nothing. Before the fix the ninth model of a class compiled in one process
silently kept its initial weights."""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class _Net(nn.Module):
    """A class of its own: its ``forward`` code object holds only this file's versions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)
        self.k = 1

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.relu(self.a(x))) * self.k - y).square().mean()


class _Other(_Net):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # another code object
        return (self.b(torch.relu(self.a(x))) * self.k - y).square().mean()


@pytest.fixture
def limits():
    """Dynamo's limits as a fresh process has them, restored afterwards (piper raises them)."""
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        yield


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)


def _eager_step(ref: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    ref(x, y).backward()
    opt.step()


def test_every_model_of_a_class_trains_like_eager_past_dynamos_limit(limits):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for i in range(11):  # models 9-11 ran eagerly and kept their initial weights before
            torch.manual_seed(i)
            model = _Net()
            ref = copy.deepcopy(model)
            opt = SGD(ref.parameters())
            # a partial of its own, as a loop that builds its options does: equal options would make
            # torch.compile's backends equal, and the models would share one compiled version (bind)
            fresh = functools.partial(torch.optim.SGD, lr=0.1)
            step = torch.compile(model, backend="piper", options={"codegen": "eager", "optimizer": fresh})
            for s in range(2):
                x, y = _batch(s)
                loss = step(x, y)
                ref_loss = ref(x, y)
                _eager_step(ref, opt, x, y)
                torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=0)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"model {i}")
    recompiles = [str(w.message) for w in said if "compiles the piper step again" in str(w.message)]
    assert recompiles == [], recompiles[:1]  # a new model's first version is no recompile


def test_a_model_past_its_versions_is_refused_not_run_eagerly(limits):
    model = _Other()
    small = functools.partial(torch.optim.SGD, lr=1e-3)  # lr 0.1 with k up to 8 diverged to NaN, equal to nothing
    step = torch.compile(model, backend="piper", options={"codegen": "eager", "optimizer": small})
    x, y = _batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each new k is a reported recompile
        for k in range(1, 9):  # an int attribute Dynamo guards on: a version per value
            model.k = k
            before = model.a.weight.detach().clone()
            step(x, y)
            assert not torch.equal(before, model.a.weight), f"version {k} did not train"
        model.k = 9
        before = model.a.weight.detach().clone()
        with pytest.raises(Exception, match=r"piper: Dynamo has compiled this model's step 8 times") as e:
            step(x, y)
    assert "k == 8" in str(e.value)  # names the guard that failed
    assert model.a.weight.isfinite().all() and torch.equal(before, model.a.weight)


def test_the_users_own_limit_counts(limits):
    class Net(_Net):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (self.a(x).sum(-1, keepdim=True) * self.k - y).square().mean()

    torch._dynamo.config.recompile_limit = 2
    model = Net()
    step = torch.compile(model, backend="piper", options={"codegen": "eager", "optimizer": SGD})
    x, y = _batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(x, y)
        model.k = 2
        step(x, y)
        model.k = 3
        with pytest.raises(Exception, match=r"compiled this model's step 2 times"):
            step(x, y)


def test_a_dropped_model_frees_its_parameters_and_state(limits):
    """Dynamo keeps a class's compiled versions, each holding its piper step, as long as the class: the
    step lets go of the model's tensors and training state when the model is garbage-collected, and piper's
    note of the grad modes each model's frame has versions for goes with the model."""
    import gc
    import weakref

    from piper_compile import recompiles

    class Net(_Net):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (self.b(self.a(x)) - y).square().mean()

    def train_one(seed: int) -> list[weakref.ref]:
        torch.manual_seed(seed)
        model = Net()
        step = torch.compile(model, backend="piper", options={"codegen": "eager", "optimizer": SGD})
        step(*_batch(0))
        assert seed or model in recompiles._GRAD_MODES  # the class's first compile notes its grad mode
        return [weakref.ref(p) for p in model.parameters()]

    gc.collect()
    noted = len(recompiles._GRAD_MODES)
    held = [train_one(i) for i in range(3)]
    gc.collect()
    assert [sum(r() is not None for r in refs) for refs in held] == [0, 0, 0]
    assert len(recompiles._GRAD_MODES) == noted  # nor does piper's recompile bookkeeping keep an entry of them


def test_a_step_shared_by_two_models_trains_the_survivor_like_eager(limits):
    """One compiled function called with two models: each gets its own training state (``bind``). The
    first model's release when it goes leaves the second one's state (momentum) as it was."""
    import gc

    momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)

    def train_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, y)

    step = torch.compile(train_fn, backend="piper", options={"codegen": "eager", "optimizer": momentum})
    torch.manual_seed(0)
    first, second = _Net(), _Net()
    ref = copy.deepcopy(second)
    opt = momentum(ref.parameters())
    x, y = _batch(0)
    step(first, x, y)
    for s in range(4):
        if s == 1:
            del first
            gc.collect()
        loss = step(second, x, y)
        ref_loss = ref(x, y)
        _eager_step(ref, opt, x, y)
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-7)  # fp32 rounding of the updates
    for p, q in zip(second.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_model_on_another_models_version_is_told_of_its_own_recompile(limits):
    """Two models of one class with equal options share Dynamo's compiled version (``bind``). When the
    second one's attribute changes, Dynamo compiles that model's first version of its own: a recompile,
    said once and counted. Before: a model's first version was never one, so it went unsaid (stats 0)."""
    import piper_compile as piper

    class Net(_Net):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (self.b(torch.relu(self.a(x))) * self.k - y).square().mean()

    options = {"codegen": "eager", "optimizer": SGD}
    torch.manual_seed(0)
    models = [Net(), Net()]
    refs = [copy.deepcopy(m) for m in models]
    opts = [SGD(r.parameters()) for r in refs]
    steps = [torch.compile(m, backend="piper", options=options) for m in models]
    x, y = _batch(0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for s in range(3):
            if s == 2:
                models[1].k = refs[1].k = 2
            for step, ref, opt in zip(steps, refs, opts):
                torch.testing.assert_close(step(x, y).detach(), ref(x, y).detach(), rtol=1e-6, atol=1e-7)
                _eager_step(ref, opt, x, y)
            if s < 2:
                with torch.no_grad():  # a switch to no_grad is expected: no report
                    steps[1](x, y)
    told = [str(w.message) for w in said if "compiles the piper step again" in str(w.message)]
    assert len(told) == 1 and "self.k == 1" in told[0], told
    assert [piper.stats(s).recompiles for s in steps] == [0, 1]
    for model, ref in zip(models, refs):
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_compiling_a_model_again_with_other_options_is_no_recompile(limits):
    """A second ``torch.compile`` of one model with other options (a new backend for Dynamo) compiles that
    step's first version: not a recompile, so nothing says "keep that attribute fixed" (before: a report
    naming Dynamo's BACKEND_MATCH guard). A changed attribute afterwards still is one, for either step."""
    import piper_compile as piper

    class Net(_Net):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (self.b(torch.relu(self.a(x))) * self.k - y).square().mean()

    model = Net()
    x, y = _batch(0)
    first = torch.compile(model, backend="piper", options={"codegen": "eager", "optimizer": SGD})
    second = torch.compile(model, backend="piper", options={"codegen": "eager", "optimizer": SGD, "directives": []})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        first(x, y)
        second(x, y)
        before = len(said)
        model.k = 2
        first(x, y)
    told = [str(w.message) for w in said if "compiles the piper step again" in str(w.message)]
    assert len(told) == 1 and "self.k == 1" in told[0] and not any("BACKEND_MATCH" in t for t in told), told
    assert not any("compiles the piper step again" in str(w.message) for w in said[:before])
    assert [piper.stats(s).recompiles for s in (first, second)] == [1, 1]  # counted per model (its state)


@pytest.mark.parametrize("version, skips", [((2, 11), False), ((2, 12), False), ((2, 13), True)])
def test_parameter_guards_are_checked_where_dynamo_skips_them(monkeypatch, version, skips):
    """Before torch 2.13 Dynamo skipped a module's parameter guards while its parameter dict was unchanged,
    so freezing a layer (``requires_grad_(False)``) reused the version that trains it (seen on 2.11; the
    parity test is ``tests/dist/test_requires_grad_change.py``). piper turns the skip off there, and leaves a
    torch that checks ``requires_grad`` itself alone."""
    from piper_compile import disk
    from piper_compile.capture.frame_versions import check_parameter_guards

    monkeypatch.setattr(disk, "torch_version", lambda: version)
    with torch._dynamo.config.patch(skip_tensor_guards_with_matching_dict_tags=True):
        check_parameter_guards()
        assert torch._dynamo.config.skip_tensor_guards_with_matching_dict_tags is skips


@pytest.mark.parametrize("first_after", ["train", "no_grad"])
def test_one_changed_attribute_is_one_report_in_either_grad_mode(limits, first_after):
    """A model trained and evaluated (``torch.no_grad``) whose attribute changes gets a new version in each
    mode: the change is said once, by whichever call comes first, naming the attribute. Before: the other
    mode's version was reported too and counted as a second recompile, and a report could name only the
    grad mode ("a guard failed (TORCH_LOGS=recompiles names it)": Dynamo names the first version it checked,
    the other mode's)."""
    import piper_compile as piper

    class Net(_Net):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (self.b(torch.relu(self.a(x))) * self.k - y).square().mean()

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = SGD(ref.parameters())
    step = torch.compile(model, backend="piper", options={"codegen": "eager", "optimizer": SGD})
    x, y = _batch(0)

    def train() -> None:
        torch.testing.assert_close(step(x, y).detach(), ref(x, y).detach(), rtol=1e-6, atol=1e-7)
        _eager_step(ref, opt, x, y)

    def evaluate() -> None:
        with torch.no_grad():
            torch.testing.assert_close(step(x, y), ref(x, y), rtol=1e-6, atol=1e-7)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train(), evaluate()
        model.k = ref.k = 2
        calls = (train, evaluate) if first_after == "train" else (evaluate, train)
        for call in calls * 2:
            call()
    told = [str(w.message) for w in said if "compiles the piper step again" in str(w.message)]
    assert len(told) == 1 and "self.k == 1" in told[0], told  # not "a guard failed (TORCH_LOGS=...)"
    assert piper.stats(step).recompiles == 1
