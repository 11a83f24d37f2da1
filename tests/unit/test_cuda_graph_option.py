"""``options["cuda_graph"]`` (runtime/graph.py) on a machine without a GPU: what it refuses, with a
``piper:`` error naming why, before anything trains. Recording and replaying run in tests/gpu."""
from __future__ import annotations

import functools

import pytest
import torch

import piper_compile as piper
from piper_compile.errors import PiperError
from piper_compile.knobs import KNOBS
from piper_compile.runtime.graph import _capturable, refuse
from piper_compile.testing.models import build_model

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _first_call(**options):
    model = build_model("mlp", 0)
    step = piper.compile(model, directives=[piper.split(2)], codegen="eager", **options)
    return step(*model.make_batch(4, torch.Generator().manual_seed(0)))


def test_a_cpu_model_is_refused_at_its_first_training_call():
    with pytest.raises(PiperError, match=r"cuda_graph.*CUDA device; its parameters are on cpu"):
        _first_call(optimizer=ADAMW, cuda_graph=True)


def test_without_piper_s_optimizer_the_update_cannot_be_recorded():
    with pytest.raises(PiperError, match=r"cuda_graph.*needs piper's optimizer"):
        _first_call(cuda_graph=True)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_the_option_is_a_bool(bad):
    with pytest.raises(PiperError, match=r"options\['cuda_graph'\] must be True"):
        _first_call(optimizer=ADAMW, cuda_graph=bad)


def test_forward_only_calls_and_the_default_run_as_usual():
    assert KNOBS["PIPER_CUDA_GRAPH"].default is False
    assert torch.isfinite(_first_call(optimizer=ADAMW))
    model = build_model("mlp", 0)
    step = piper.compile(model, directives=[piper.split(2)], codegen="eager", optimizer=ADAMW, cuda_graph=True)
    with torch.no_grad():  # only a training step is recorded
        assert torch.isfinite(step(*model.make_batch(4, torch.Generator().manual_seed(0))))


@pytest.mark.parametrize("world, scaling, match", [(2, False, "has 2 ranks"), (1, True, "fp16 loss scaling")])
def test_several_ranks_or_loss_scaling_are_refused(world, scaling, match):
    with pytest.raises(PiperError, match=match):
        refuse(torch.device("cuda"), world, True, scaling)
    refuse(torch.device("cuda"), 1, True, False)  # one GPU, an optimizer, no scaling: recorded


def test_optimizers_are_made_recordable():
    """A fused optimizer is marked capturable; another gets its step counts moved to the parameters'
    device (here the CPU: the move itself is what a CUDA run does) and is marked; SGD has no flag."""
    w = [torch.nn.Parameter(torch.randn(4))]
    w[0].grad = torch.ones(4)
    fused = torch.optim.AdamW(w, lr=1e-3, fused=True)
    _capturable(fused)
    assert all(g["capturable"] for g in fused.param_groups)
    foreach = torch.optim.AdamW(w, lr=1e-3, foreach=True)
    foreach.step()
    _capturable(foreach)
    assert foreach.param_groups[0]["capturable"] and foreach.state[w[0]]["step"].device == w[0].device
    sgd = torch.optim.SGD(w, lr=0.1, momentum=0.9)
    _capturable(sgd)
    assert "capturable" not in sgd.param_groups[0]


def test_an_optimizer_counting_steps_in_python_is_refused():
    w = [torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(w, lr=1e-3)
    opt.state[w[0]]["step"] = 3  # an optimizer keeping a Python count
    with pytest.raises(PiperError, match=r"counts its steps on the host"):
        _capturable(opt)
