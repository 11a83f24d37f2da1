"""Gradient accumulation inside the compiled backward segments (``codegen/accumulate.py``): a segment writes
its parameter gradients into the gradient buffers itself -- the step's first micro-batch overwrites, later
ones add -- and the runtime adds none of them."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import piper_compile as piper
from piper_compile.codegen import accumulate
from piper_compile.codegen.compile import CompiledSegment, forget_compiled
from piper_compile.runtime.grads import GradBuffers
from piper_compile.testing.models import build_model

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _backward(x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gx = gy @ w
    return gx, gy.t() @ x, gy.sum(0), b  # (activation grad, weight grad, bias grad, a gradient passed through)


def _graph(dtype: torch.dtype = torch.float32) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(6, 4, generator=g, dtype=dtype), torch.randn(3, 4, generator=g, dtype=dtype),
            torch.randn(6, 3, generator=g, dtype=dtype), torch.randn(5, generator=g, dtype=dtype)]
    return make_fx(_backward, tracing_mode="fake")(*args), args


@pytest.mark.parametrize("mode", ["eager", "inductor"])
def test_a_fused_segment_overwrites_then_adds_and_returns_none_for_its_gradients(mode):
    gm, args = _graph()
    want = _backward(*args)
    seg = CompiledSegment("B.test", gm, mode)
    seg.fuse_gradients(((1, "w", torch.float32), (2, "b", torch.float32), (3, "p", torch.float32)))
    assert seg.fused == ("w", "b", "p")
    assert seg.temp_bytes == 3 * 4 * 4  # the largest gradient, w's, is a tensor of its own until written
    bufs = (torch.full((3, 4), float("nan")), torch.full((3,), float("inf")), torch.empty(5))  # stale contents
    out = seg(list(args), None, bufs, add=False)
    assert out[1:] == [None, None, None]
    torch.testing.assert_close(out[0], want[0])
    for buf, g in zip(bufs, want[1:]):
        torch.testing.assert_close(buf, g, rtol=1e-6, atol=1e-6)  # overwritten: stale NaN / inf gone
    seg(list(args), None, bufs, add=True)
    for buf, g in zip(bufs, want[1:]):
        torch.testing.assert_close(buf, 2 * g, rtol=1e-6, atol=1e-6)


def test_a_low_precision_gradient_is_accumulated_in_the_buffers_fp32():
    gm, args = _graph(torch.bfloat16)
    seg = CompiledSegment("B.bf16", gm, "eager")
    seg.fuse_gradients(((1, "w", torch.float32),))
    assert seg.temp_bytes == 3 * 4 * 2  # in the gradient's own dtype, not the buffer's
    buf = torch.zeros(3, 4)
    seg(list(args), None, (buf,), add=False)
    seg(list(args), None, (buf,), add=True)
    g = _backward(*args)[1]
    ref = torch.zeros(3, 4)
    ref.copy_(g)
    ref.add_(g)  # what GradBuffers.accumulate does with a bf16 gradient
    assert buf.dtype == torch.float32
    torch.testing.assert_close(buf, ref, rtol=0, atol=0)


def test_the_accumulating_nodes_follow_their_gradient_and_keep_its_module_stack():
    gm, _ = _graph()
    stack = {"blocks.1": ("blocks.1", torch.nn.Linear)}
    producer = list(gm.graph.output_node().args[0])[1]
    producer.meta["nn_module_stack"] = stack
    fused = accumulate.fuse(gm, ((1, torch.float32),))
    nodes = list(fused.graph.nodes)
    at = next(i for i, n in enumerate(nodes) if n.name == producer.name)
    assert [str(n.target) for n in nodes[at + 1:at + 4]] == ["aten.add.Tensor", "aten.where.self", "aten.copy_.default"]
    assert all(n.meta.get("nn_module_stack") == stack for n in nodes[at + 1:at + 4])
    assert len(fused.graph.output_node().args[0]) == 3
    assert [n.name for n in fused.graph.find_nodes(op="placeholder")][-2:] == ["grad_acc0", "grad_add"]


def test_the_memory_plan_counts_a_fused_gradient_only_while_its_segment_writes_it(monkeypatch):
    """Gradients a segment writes into the buffers itself (``accumulate.fused_positions``, the runtime's
    rule) outlive no step: the plan counts only the largest one, at that step, as the runtime does
    (each is a tensor of its own until it is written). Where another step reads one (so the segment is not
    fused), or with ``PIPER_FUSED_GRADS=0``, they are all live tensors."""
    from piper_compile.ir.dag import Node
    from piper_compile.ir.ops import Segment
    from piper_compile.plan.program import Instr, Program
    from piper_compile.sim.memory_walk import TEMP, memory_walk

    class Sizes:
        aliases: dict = {}

        def value_bytes(self, v: str) -> int:
            return {"gx": 100, "gw": 40, "gb": 30, "r": 0}[v]

        def transient(self, segment: str, dropped: tuple[int, ...] = ()) -> int:
            return 0  # no intermediates: the segment's graph is not needed here

    b = Node("B.x", Segment("B.x", grads=(("gw", "w"), ("gb", "b"))), (), (0,), "compute", ("gy",), ("gx", "gw", "gb"))
    reader = Node("R", Segment("R"), (), (0,), "compute", ("gw",), ("r",))
    fused = Program(0, [Instr(b, frees=("gx", "gw", "gb"))])
    read = Program(0, [Instr(b, frees=("gx", "gb")), Instr(reader, frees=("gw", "r"))])
    walk = memory_walk(fused, Sizes(), {})
    assert walk.peak == 140  # gx and the larger gradient, while it is written
    assert walk.at_peak[:2] == [("gx", 100), (f"{TEMP}gw", 40)]
    assert memory_walk(read, Sizes(), {}).peak == 170  # every gradient: gw is a tensor another step reads
    monkeypatch.setenv("PIPER_FUSED_GRADS", "0")
    assert memory_walk(fused, Sizes(), {}).peak == 170


def _train(model: torch.nn.Module, steps: int = 3) -> tuple[list[float], list[torch.Tensor], object]:
    forget_compiled()
    torch._dynamo.reset()  # a new compile, not another instance's compiled code
    step = piper.compile(model, directives=[piper.split(2)], optimizer=SGD)
    losses = [step(*model.make_batch(8, torch.Generator().manual_seed(s))).item() for s in range(steps)]
    return losses, [p.detach().clone() for p in model.parameters()], piper.compiled_steps(step)[0]


@pytest.mark.slow
def test_a_pipeline_of_micro_batches_fuses_every_gradient_and_matches_runtime_accumulation(monkeypatch):
    model = build_model("gpt", 0, layers=4)
    plain_model, eager = copy.deepcopy(model), copy.deepcopy(model)
    added: list[str] = []
    real = GradBuffers.accumulate
    monkeypatch.setattr(GradBuffers, "accumulate", lambda self, f, g: (added.append(f), real(self, f, g)))
    losses, params, cs = _train(model)
    assert added == []  # the runtime added no gradient: the compiled segments did
    seg = cs.compiled["B.all"]
    assert set(seg.fused) == {n for n, _ in model.named_parameters()} and seg.pieces > 1
    monkeypatch.setenv("PIPER_FUSED_GRADS", "0")
    plain_losses, plain_params, plain = _train(plain_model)
    assert not plain.compiled["B.all"].fused and added
    assert losses == plain_losses
    for a, b in zip(params, plain_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt = SGD(eager.parameters())
    for s in range(3):  # the eager reference: the same global batches
        opt.zero_grad()
        loss = eager(*eager.make_batch(8, torch.Generator().manual_seed(s)))
        loss.backward()
        opt.step()
        assert abs(loss.item() - losses[s]) < 1e-5
    for a, b in zip(params, eager.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
