"""``capture/tp_shapes.py``: the shape rules, and the rewrite of baked-in head counts on a small Dynamo graph
(one process, no launch)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from piper_compile.capture.joint import fqn_from_source, source_names
from piper_compile.capture.tensor_parallel import shard_linears
from piper_compile.capture.tp_shapes import _Unfit, expand_split, reshape_split, rewrite_sizes, split_sizes
from piper_compile.errors import PiperCaptureError


def test_reshape_splits_the_outermost_dimension_of_the_group():
    # (b, t, 4 heads * 16) -> (b, t, 4, 16): the heads are split
    assert reshape_split([2, 8, 64], [2, 8, 4, 16], {2: 1}, 2) == {2: 1}
    # and merged back: (b, t, heads, hd) -> (b, t, heads * hd)
    assert reshape_split([2, 8, 4, 16], [2, 8, 64], {2: 1}, 2) == {2: 1}
    # repeat_kv: (b, kv, n_rep, t, hd) -> (b, kv * n_rep, t, hd)
    assert reshape_split([2, 2, 2, 8, 16], [2, 4, 8, 16], {1: 1}, 2) == {1: 1}
    # a fused qkv (3 blocks) viewed as (b, t, 3, heads, hd): the block index stays whole, the heads split
    assert reshape_split([2, 8, 48], [2, 8, 3, 4, 4], {2: 3}, 2) == {3: 1}


def test_reshape_rejects_what_no_local_shape_can_express():
    with pytest.raises(_Unfit, match="under the outer dimension"):
        reshape_split([2, 8, 16], [2, 128], {2: 1}, 2)  # (t, c) -> t*c with c split: not one block
    with pytest.raises(_Unfit, match="does not divide over 2 ranks"):
        reshape_split([2, 8, 12], [2, 8, 3, 4], {2: 1}, 2)  # 3 heads over 2 ranks
    with pytest.raises(_Unfit, match="cuts across the 3 fused blocks"):
        reshape_split([2, 8, 48], [2, 8, 2, 24], {2: 3}, 2)


def test_expand_and_split_rules():
    assert expand_split([2, 2, 1, 8, 16], [2, 2, 2, 8, 16], {1: 1}) == {1: 1}
    with pytest.raises(_Unfit, match="broadcasts the split dimension"):
        expand_split([2, 1, 8], [2, 4, 8], {1: 1})
    assert split_sizes(48, 3, [16, 16, 16], 2) == [1, 1, 1]
    with pytest.raises(_Unfit, match="colwise:N"):
        split_sizes(32, 1, [16, 16], 2)


def test_rewrite_sizes_only_touches_the_split_dimensions():
    def same(a: object) -> object:
        return a

    assert rewrite_sizes([4, 2, 2, 8, 16], [4, 2, 2, 8, 16], [4, 1, 2, 8, 16], same, same) == [4, 1, 2, 8, 16]
    assert rewrite_sizes([4, 8, -1, 16], [4, 8, 4, 16], [4, 8, 2, 16], same, same) == [4, 8, -1, 16]
    with pytest.raises(_Unfit, match="neither the full size"):
        rewrite_sizes([4, 2], [4, 6], [4, 3], same, same)


class _GQA(nn.Module):
    """Attention with 4 query heads over 2 key/value heads whose ``repeat_kv`` and head reshapes use fixed
    (full-model) head counts, as transformers' Llama does once Dynamo specializes them."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = (p(x).view(b, t, 2, 8).transpose(1, 2) for p in (self.k, self.v))
        k, v = (z[:, :, None].expand(b, 2, 2, t, 8).reshape(b, 4, t, 8) for z in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, 32)).square().mean()


def _dynamo_graph(model: nn.Module, *inputs: torch.Tensor, dynamic: bool | None = None
                  ) -> tuple[fx.GraphModule, list[str]]:
    captured: list[tuple[fx.GraphModule, list[str]]] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        captured.append((gm, source_names(gm)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    return captured[0]


GQA_TP = (("q", "colwise"), ("k", "colwise"), ("v", "colwise"), ("o", "rowwise"))


def _shard(model: nn.Module, params: tuple[tuple[str, str], ...]) -> fx.GraphModule:
    gm, sources = _dynamo_graph(model, torch.randn(2, 6, 32))
    shard_linears(gm, sources, params, 2)
    return gm


def _calls(gm: fx.GraphModule, name: str) -> list[tuple]:
    return [n.args[1:] for n in gm.graph.nodes if n.op == "call_method" and n.target == name]


def test_fixed_head_counts_become_local():
    gm = _shard(_GQA(), GQA_TP)
    assert _calls(gm, "view") == [(2, 6, 2, 8), (2, 6, 1, 8), (2, 6, 1, 8)]
    assert _calls(gm, "expand") == [(2, 1, 2, 6, 8)] * 2
    assert _calls(gm, "reshape") == [(2, 2, 6, 8)] * 2 + [(2, 6, 16)]
    # the rewritten graph runs on one rank's shard: 2 query heads, 1 key/value head, half of o's input
    local = {"q": (16, 32), "k": (8, 32), "v": (8, 32), "o": (32, 16)}
    args = []
    for ph, src in zip(gm.graph.find_nodes(op="placeholder"), source_names(gm)):
        fqn = fqn_from_source(src)
        shape = local.get(fqn.split(".")[0]) if fqn.endswith("weight") else None
        bias = {"q": (16,), "k": (8,), "v": (8,), "o": (32,)}.get(fqn.split(".")[0]) if fqn.endswith("bias") else None
        args.append(torch.randn(shape or bias or tuple(ph.meta["example_value"].shape)))
    assert gm(*args)[0].shape == ()


def test_unmodified_graph_when_heads_are_inferred():
    """piper's GPT writes -1 for the head count: nothing to rewrite."""
    from piper_compile.testing.models import build_model

    model = build_model("gpt", 0, layers=1)
    gm, sources = _dynamo_graph(model, *model.make_batch(2, torch.Generator().manual_seed(0)))
    before = {name: _calls(gm, name) for name in ("view", "reshape", "expand", "chunk")}
    shard_linears(gm, sources, (("blocks.*.qkv", "colwise:3"), ("blocks.*.proj", "rowwise")), 2)
    assert before["view"] and before == {name: _calls(gm, name) for name in before}


def test_fitting_local_shapes_keeps_the_batch_dynamic():
    """The walk on local fakes adds no guard to Dynamo's shape environment. Before, on torch 2.11, the
    row-parallel projection's linear evaluated ``batch == 4`` there, which fixed the tokens' batch size and
    not the targets' (a size mismatch in the loss once micro-batches cut only the targets)."""
    from piper_compile.testing.models import build_model

    model = build_model("gpt", 0, layers=1)
    gm, sources = _dynamo_graph(model, *model.make_batch(4, torch.Generator().manual_seed(0)), dynamic=True)
    vals = [ph.meta["example_value"] for ph in gm.graph.find_nodes(op="placeholder")]
    inputs = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() == 2 and not isinstance(v, nn.Parameter)]
    assert len(inputs) == 2 and all(isinstance(v.shape[0], torch.SymInt) for v in inputs)
    shard_linears(gm, sources, (("blocks.*.qkv", "colwise:3"), ("blocks.*.proj", "rowwise")), 2)
    assert all(v.shape[0].node.expr.is_Symbol for v in inputs), [v.shape for v in inputs]


class _TimeMix(_GQA):
    """Flattens time with the split feature dimension before the output layer: no rank holds one block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x)
        return self.o(q.reshape(b, t * 32).view(b, t, 32)).mean()


def test_unfixable_reshape_names_the_op_and_line():
    with pytest.raises(PiperCaptureError, match=r"(?s)reshape.*test_tp_shapes.py:\d+.*q.reshape\(b, t \* 32\).*"
                                                r"under the outer dimension"):
        _shard(_TimeMix(), (("q", "colwise"), ("o", "rowwise")))


class _Softmax(_GQA):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x).softmax(-1)).mean()


def test_op_along_the_split_dimension_is_rejected():
    with pytest.raises(PiperCaptureError, match=r"softmax.*works along the split dimension"):
        _shard(_Softmax(), (("q", "colwise"), ("o", "rowwise")))
