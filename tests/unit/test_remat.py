"""Activation rematerialization (capture/remat.py): which activations the backward recomputes instead of
keeping, that it never keeps more or adds cross-region traffic, and that training is unchanged."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_compile as piper
from piper_compile.errors import PiperError
from piper_compile.testing.models import build_model

ADAMW = {"optimizer": functools.partial(torch.optim.AdamW, lr=1e-3)}
GPT_CFG = {"dim": 32, "heads": 4, "layers": 2, "seq": 16, "vocab": 64}
BATCH = 4


def _plan(model: nn.Module, directives: list, world: int = 2, **options: object) -> piper.StaticPlan:
    x, y = model.make_batch(BATCH, torch.Generator().manual_seed(0))
    return piper.plan(model, x, y, directives=directives, world_size=world, options=options or None)


def _ops(seg: object, name: str) -> int:
    return sum(1 for n in seg.gm.graph.nodes if getattr(getattr(n.target, "overloadpacket", None), "__name__", "") == name)


def _numel(node: torch.fx.Node) -> int:
    out = 1
    for d in node.meta["val"].shape:  # symbolic sizes (batch, sequence) at the sizes seen at capture
        out *= int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)
    return out


def _kept_elements(p: piper.StaticPlan, stage: int | None = None) -> int:
    """Elements forward segments hand to backward segments (of pipeline stage ``stage``, or all): the
    activations kept between them, over the whole local batch."""
    readers = {v for s in p.segments.values() if s.pass_ != "F" and (stage is None or dict(s.region).get("PP") == stage)
               for v in s.inputs}
    total = 0
    for s in p.segments.values():
        if s.pass_ == "F":
            outs = s.gm.graph.find_nodes(op="output")[0].args[0]
            total += sum(_numel(o) for v, o in zip(s.outputs, outs) if v in readers)
    return total


@pytest.mark.slow  # 6 s: keeps the fast subset under 5 min
def test_gpt_recomputes_gelu_and_layer_norm_outputs_in_the_backward():
    model = build_model("gpt", **GPT_CFG)
    on = _plan(model, [piper.replicate()])
    off = _plan(model, [piper.replicate()], remat=False)
    back = [s for s in on.segments.values() if s.pass_ == "B"]
    layers, dim = GPT_CFG["layers"], GPT_CFG["dim"]
    assert sum(_ops(s, "gelu") for s in back) == layers
    assert sum(_ops(s, "native_layer_norm") for s in back) == 2 * layers + 1  # ln1, ln2 per block, ln_f
    assert not any(_ops(s, "gelu") or _ops(s, "native_layer_norm") for s in off.segments.values() if s.pass_ == "B")
    # exactly the GELU outputs (4 * dim per token) and the norm outputs (dim per token) are no longer kept,
    # and the loss backward reads the flattened labels (one per token) as a view of the input, not from F
    tokens = BATCH * GPT_CFG["seq"]
    assert _kept_elements(off) - _kept_elements(on) == tokens * (layers * 4 * dim + (2 * layers + 1) * dim + 1)


@pytest.mark.parametrize("bucket_mb", [1e-4, 0.05])
def test_zero3_recomputation_reads_only_buckets_its_step_gathers(bucket_mb: float):
    """Under ZeRO-3 every backward step gathers the buckets it reads: a recomputation may read a parameter
    only from one of those (else it would gather one more). With a bucket per parameter no layer norm is
    recomputed (its weight is never in the bucket of the linear layer that reads its output); with about a
    bucket per block some are; GELU (parameter-free) always is; no step reads a parameter it did not."""
    model = build_model("gpt", **GPT_CFG)
    dirs = [piper.replicate(zero=3, bucket_mb=bucket_mb)]
    on, off = _plan(model, dirs, **ADAMW), _plan(model, dirs, remat=False, **ADAMW)
    back = [s for s in on.segments.values() if s.pass_ == "B"]
    assert sum(_ops(s, "gelu") for s in back) == GPT_CFG["layers"]
    norms = sum(_ops(s, "native_layer_norm") for s in back)
    assert norms == 0 if bucket_mb < 1e-3 else 0 < norms <= 2 * GPT_CFG["layers"] + 1
    params = {s.name: {v for v in s.inputs if v.startswith("param:")} for s in on.segments.values()}
    assert params == {s.name: {v for v in s.inputs if v.startswith("param:")} for s in off.segments.values()}
    assert _kept_elements(on) < _kept_elements(off)


def _cross_region_values(p: piper.StaticPlan) -> set[str]:
    where = {v: s.region for s in p.segments.values() for v in s.outputs}
    return {v for s in p.segments.values() for v in s.inputs if v in where and where[v] != s.region}


def test_pipeline_stages_exchange_the_same_values_with_and_without_remat():
    model = build_model("gpt", **{**GPT_CFG, "layers": 4})
    model.annotate_stages(2)
    dirs = [*piper.pipeline(stages=2), piper.split(2), *piper.schedules.one_f_one_b(stages=2, microbatches=2)]
    on, off = _plan(model, dirs), _plan(model, dirs, remat=False)
    assert _cross_region_values(on) == _cross_region_values(off)
    assert _kept_elements(on) < _kept_elements(off)


class DropoutMLP(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(F.dropout(F.gelu(self.fc(x)), 0.1)), y)

    def make_batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(n, 16, generator=gen), torch.randn(n, 16, generator=gen)


def test_random_ops_are_never_recomputed():
    p = _plan(DropoutMLP(), [piper.replicate()])
    back = [s for s in p.segments.values() if s.pass_ == "B"]
    random = [n for s in back for n in s.gm.graph.nodes
              if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert not random
    assert _kept_elements(p) <= _kept_elements(_plan(DropoutMLP(), [piper.replicate()], remat=False))


@pytest.mark.parametrize("name", ["mlp", "skip", "gpt", pytest.param("moegpt", marks=pytest.mark.slow), "moe", "shared_norm"])
def test_remat_never_keeps_more(name: str):
    kw = GPT_CFG if name in ("gpt", "moegpt") else {}
    model = build_model(name, **kw)
    assert _kept_elements(_plan(model, [piper.replicate()])) <= _kept_elements(_plan(model, [piper.replicate()],
                                                                                      remat=False))


def test_training_is_bitwise_unchanged():
    """Eager codegen runs the same ops on the same values: gradients equal with and without remat, and
    match eager autograd."""
    torch.manual_seed(0)
    _assert_remat_bitwise_and_eager(build_model("gpt", **GPT_CFG))


def _assert_remat_bitwise_and_eager(base: torch.nn.Module) -> None:
    """Two micro-batches with eager codegen, remat on and off: gradients bitwise equal to each other and
    close to eager autograd on the same halves."""
    x, y = base.make_batch(8, torch.Generator().manual_seed(1))  # type: ignore[operator]
    grads = {}
    for remat in (True, False):
        model = copy.deepcopy(base)
        step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                             options={"codegen": "eager", "remat": remat, "directives": [piper.split(2)]})
        step(x, y)
        grads[remat] = [p.grad.clone() for p in model.parameters()]
    ref = copy.deepcopy(base)
    (ref(x[:4], y[:4]) / 2 + ref(x[4:], y[4:]) / 2).backward()
    for a, b, p in zip(grads[True], grads[False], ref.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


def test_remat_option_must_be_a_bool():
    model = build_model("mlp")
    step = torch.compile(model, backend="piper", options={"remat": "yes", "codegen": "eager"})
    with pytest.raises(PiperError, match=r"options\['remat'\] must be True"):
        step(*model.make_batch(4, torch.Generator().manual_seed(0)))


EXTERNAL = ("param:", "buffer:", "input:", "sym:", "symexpr:", "tangent")


def test_recomputation_reads_only_values_some_segment_produces():
    """GPT-2's tanh GELU: the backward keeps ``tanh`` through a detached alias and recomputes ``1 + tanh``,
    which reads ``tanh`` itself. The forward segment must then hand ``tanh`` over (it once did not: every
    GPT-2, GPT-NeoX and Phi-3 failed with ``piper: internal: rank 1 has no value tanh`` under the default
    remat=True)."""
    model = build_model("gelu_tanh")
    p = _plan(model, [piper.replicate()])
    produced = {v for s in p.segments.values() for v in s.outputs}
    missing = {(s.name, v) for s in p.segments.values() for v in s.inputs
               if not v.startswith(EXTERNAL) and v not in produced}
    assert not missing
    back = [s for s in p.segments.values() if s.pass_ == "B"]
    assert any(_ops(s, "add") for s in back)  # 1 + tanh is recomputed, not kept


def test_tanh_gelu_trains_the_same_with_and_without_remat():
    torch.manual_seed(0)
    _assert_remat_bitwise_and_eager(build_model("gelu_tanh"))
