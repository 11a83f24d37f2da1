"""The joint graph on disk (``capture/cache.py``): a second capture of the same Dynamo graph loads what the
first exported, with the metadata planning reads, and plans exactly as a fresh export does; the key changes
with everything the export reads; a damaged entry is exported again."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import fx, nn

import piper_compile as piper
from piper_compile.capture import cache
from piper_compile.capture.dynamo import trace
from piper_compile.capture.joint import capture_joint
from piper_compile.disk import TESTED_TORCH, torch_version
from piper_compile.testing.models import build_model

_META = ("custom", "stack_trace", "partitioner_tag", "seq_nr")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    if torch_version() < TESTED_TORCH:  # 'auto' is off there (the GPU machine's 2.11): asked for by name
        monkeypatch.setenv("PIPER_CAPTURE_CACHE", "turns")
    return tmp_path / "inductor" / "piper-capture"


def _traced(model: nn.Module, batch: int = 4):
    x, y = model.make_batch(batch, torch.Generator().manual_seed(0))
    return trace(model, (x, y))


def _fakes(t):
    return tuple(n.meta["example_value"] for n in t.gm.graph.find_nodes(op="placeholder"))


def _key(model: nn.Module, batch: int = 4) -> str | None:
    t = _traced(model, batch)
    return cache.joint_key(t.gm, _fakes(t))


def test_the_key_follows_what_the_export_reads():
    base = _key(build_model("gpt", 0, layers=1))
    assert base is not None and base == _key(build_model("gpt", 1, layers=1))  # weights are not read
    assert _key(build_model("gpt", 0, layers=1), batch=6) != base  # the size hints
    assert _key(build_model("gpt", 0, layers=1, dim=64)) != base  # shapes
    tagged = build_model("gpt", 0, layers=1)
    piper.annotate(tagged.blocks[0], PP=0)
    assert _key(tagged) != base  # tags travel in node metadata
    import torch._functorch.config as functorch_config

    with functorch_config.patch(view_replay_for_aliased_outputs=not functorch_config.view_replay_for_aliased_outputs):
        assert _key(build_model("gpt", 0, layers=1)) != base


def _user_fn(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_targets_the_key_cannot_see_make_a_graph_uncacheable():
    assert cache.joint_key(fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2))), ()) is None  # a module call
    g = fx.Graph()
    g.output(g.call_function(_user_fn, (g.placeholder("x"),)))
    key = cache.joint_key(fx.GraphModule({}, g), ())
    assert key is not None and "return x * 2" in cache._target_text(_user_fn)  # its source is in the key
    lib = torch.library.Library("piper_cache_test", "FRAGMENT")  # noqa: TOR901 - a throwaway op
    lib.define("twice(Tensor x) -> Tensor")
    g = fx.Graph()
    g.output(g.call_function(torch.ops.piper_cache_test.twice.default, (g.placeholder("x"),)))
    assert cache.joint_key(fx.GraphModule({}, g), ()) is None  # a custom op: its formulas are not in the key


def _same_graph(a: fx.GraphModule, b: fx.GraphModule) -> None:
    assert a.code == b.code
    for m, n in zip(a.graph.nodes, b.graph.nodes):
        va, vb = m.meta.get("val"), n.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (str(va.shape), va.stride(), va.dtype) == (str(vb.shape), vb.stride(), vb.dtype), m.name
        else:
            assert str(va) == str(vb), m.name
        assert all(str(m.meta.get(k)) == str(n.meta.get(k)) for k in _META), m.name
        assert type(m.meta.get("desc")) is type(n.meta.get("desc")), m.name
        for k in ("nn_module_stack", "fwd_nn_module_stack"):
            paths = lambda s: [p for p, _ in (s or {}).values()]  # noqa: E731
            assert paths(m.meta.get(k)) == paths(n.meta.get(k)), m.name


@pytest.mark.slow
def test_a_second_capture_loads_the_first_and_plans_the_same(cache_dir, monkeypatch):
    model = build_model("gpt", 0, layers=2)
    model.annotate_stages(2)
    t = _traced(model)
    first = capture_joint(t.gm, t.inputs, t.sources)
    second = capture_joint(t.gm, t.inputs, t.sources)
    assert (first.how, second.how) == ("captured", "loaded") and len(os.listdir(cache_dir)) == 1
    path = cache_dir / os.listdir(cache_dir)[0]  # the flat graph's entry (piper.plan below traces regions)
    _same_graph(first.gm, second.gm)
    assert first.grad_of == second.grad_of and first.loss == second.loss
    x, y = model.make_batch(4, torch.Generator().manual_seed(0))
    ds = [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)]
    loaded = piper.plan(model, x, y, directives=ds, world_size=2)
    monkeypatch.setenv("PIPER_CAPTURE_CACHE", "off")
    fresh = piper.plan(model, x, y, directives=ds, world_size=2)
    assert loaded.text() == fresh.text()
    assert {s.name: s.gm.code for s in loaded.segments.values()} == {s.name: s.gm.code for s in fresh.segments.values()}
    # another script (its __main__ without torch) loads the entry too
    code = ("from piper_compile.capture import cache; "
            f"print(len(cache._loads(open({str(path)!r}, 'rb').read()).graph.nodes))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and int(out.stdout.split()[-1]) == len(first.gm.graph.nodes), out.stderr[-2000:]


def test_a_capture_under_inference_mode_has_gradients_and_a_key_of_its_own(cache_dir):
    """An export under ``torch.inference_mode`` had no backward, and it was kept under the key of a
    ``torch.no_grad`` capture of the same graph, which then loaded it: ZeRO-3's forward-only plan lost its
    parameter gathers and read released weights. The export now leaves inference mode, and the key reads
    inference mode."""
    model = build_model("mlp", 0)
    with torch.inference_mode():
        t = _traced(model)
        inference = capture_joint(t.gm, t.inputs, t.sources)
    with torch.no_grad():
        t = _traced(model)
        no_grad = capture_joint(t.gm, t.inputs, t.sources)
    names = sorted(n for n, _ in model.named_parameters())
    assert (inference.how, no_grad.how) == ("captured", "captured"), "the two modes share a key"
    assert sorted(inference.grad_of.values()) == sorted(no_grad.grad_of.values()) == names


def test_a_damaged_entry_is_exported_again(cache_dir, caplog):
    model = build_model("gpt", 0, layers=1)
    t = _traced(model)
    assert capture_joint(t.gm, t.inputs, t.sources).how == "captured"
    (entry,) = cache_dir.iterdir()
    entry.write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING, logger="piper_compile.capture.cache"):
        again = capture_joint(t.gm, t.inputs, t.sources)
    assert again.how == "captured" and "did not load" in caplog.text
    assert capture_joint(t.gm, t.inputs, t.sources).how == "loaded"


def test_the_knob_turns_it_off(cache_dir, monkeypatch):
    monkeypatch.setenv("PIPER_CAPTURE_CACHE", "off")
    t = _traced(build_model("gpt", 0, layers=1))
    assert capture_joint(t.gm, t.inputs, t.sources).how == "off" and not cache_dir.exists()


def test_auto_is_off_on_a_torch_whose_round_trip_is_untested(cache_dir, monkeypatch):
    monkeypatch.setenv("PIPER_CAPTURE_CACHE", "auto")
    t = _traced(build_model("gpt", 0, layers=1))
    monkeypatch.setattr(cache.torch, "__version__", "2.11.0+cu128")
    assert capture_joint(t.gm, t.inputs, t.sources).how == "off" and not cache_dir.exists()
    monkeypatch.setenv("PIPER_CAPTURE_CACHE", "turns")  # asked for by name: cached
    assert capture_joint(t.gm, t.inputs, t.sources).how == "captured"


def test_ranks_take_turns_unless_each_has_two_cores(monkeypatch):
    monkeypatch.setattr(cache, "usable_cores", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    assert cache._take_turns("auto") and not cache._take_turns("each")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert not cache._take_turns("auto") and cache._take_turns("turns")


class _TreeInputs(nn.Module):
    """A forward that walks its inputs with torch's pytree (as transformers' models do): its Dynamo guards
    check the version of pytree's node registry."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.utils._pytree.tree_leaves({"x": (x,)})[0] * 2
        return torch.nn.functional.mse_loss(self.lin(x), y)


def test_exporting_or_loading_the_joint_graph_does_not_recompile_the_step(cache_dir):
    """GraphPickler registers ``slice`` with pytree for its work and removes it after; done on the live
    registry, that changed the version a step's guards (built before the deferred capture) check, and the
    second call traced the model again. Exported (cold) and loaded (warm): no recompile."""
    for want in ("captured", "loaded"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _TreeInputs()
        step = piper.compile(model, directives=[piper.split(2)], codegen="eager",
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            step(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
        m = piper.stats(step)
        assert (m.capture, m.recompiles) == (want, 0), (m.capture, m.recompiles)
    assert slice not in torch.utils._pytree.SUPPORTED_NODES
