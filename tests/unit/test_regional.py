"""Regional compilation (``codegen/regional.py``): a segment of repeated blocks is cut into one piece per
block, identical blocks compile once, and the pieces compute exactly what the whole segment does."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import piper_compile as piper
from piper_compile.codegen import regional
from piper_compile.codegen.compile import CompiledSegment, forget_compiled
from piper_compile.testing.models import build_model

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _segments(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, object]:
    plan = piper.plan(model, *batch, directives=[piper.split(2)], world_size=1)
    return {s.name: s for s in (plan.segments.values() if isinstance(plan.segments, dict) else plan.segments)}


def _check_order(cut: regional.Cut) -> None:
    """Every piece reads only segment inputs and outputs of pieces before it; every result is produced."""
    have = set(range(cut.inputs))
    for p in cut.pieces:
        assert set(p.inputs) <= have, (p.label, sorted(set(p.inputs) - have))
        assert not set(p.frees) & set(cut.results)
        have |= set(p.outputs)
    assert set(cut.results) <= have


@pytest.mark.slow  # 6-26 s: keeps the fast subset under 5 min
def test_a_gpt_segment_is_cut_per_block_and_alike_blocks_share_one_graph():
    model = build_model("gpt", 0, layers=4)
    segs = _segments(model, model.make_batch(4, torch.Generator().manual_seed(0)))
    for name in ("F.all", "B.all"):
        cut = regional.cut(segs[name].gm)
        assert cut is not None, name
        _check_order(cut)
        blocks = [p for p in cut.pieces if p.label.startswith("blocks.")]
        assert sorted(p.label for p in blocks) == [f"blocks.{i}" for i in range(4)], [p.label for p in cut.pieces]
        keys = [regional.structure_key(p.gm) for p in blocks]
        # every block but the first of the backward (it also holds the embedding's backward) is one graph
        assert len(set(keys)) <= 2 and max(keys.count(k) for k in keys) >= 3, (name, keys)


def test_small_blocks_and_segments_without_repeats_compile_whole():
    mlp = build_model("mlp")  # a Linear per block: too small to be worth a graph each
    for seg in _segments(mlp, mlp.make_batch(8, torch.Generator().manual_seed(0))).values():
        assert regional.cut(seg.gm) is None
    one = build_model("gpt", 0, layers=1)
    for seg in _segments(one, one.make_batch(4, torch.Generator().manual_seed(0))).values():
        assert regional.cut(seg.gm) is None


@pytest.mark.slow  # in the full suite; keeps the fast subset under 5 min
@pytest.mark.parametrize("family", ["qwen2", "gpt2", "bert"])
def test_transformers_families_cut_into_ordered_pieces_with_one_graph_per_layer(family):
    from piper_compile.testing.hf import HFLoss

    model = HFLoss(family, seed=0, num_hidden_layers=4)
    segs = _segments(model, model.make_batch(4, torch.Generator().manual_seed(0)))
    for name, seg in segs.items():
        cut = regional.cut(seg.gm)
        assert cut is not None, (family, name)
        _check_order(cut)
        keys = [regional.structure_key(p.gm) for p in cut.pieces]
        assert max(keys.count(k) for k in keys) >= 3, (family, name, [p.label for p in cut.pieces])


def _train(model: torch.nn.Module, steps: int = 3) -> tuple[list[float], list[torch.Tensor], object]:
    step = piper.compile(model, directives=[piper.split(2)], optimizer=SGD)
    losses = [step(*model.make_batch(8, torch.Generator().manual_seed(s))).item() for s in range(steps)]
    return losses, [p.detach().clone() for p in model.parameters()], piper.stats(step)


@pytest.mark.slow
def test_regional_compilation_matches_the_whole_graph_and_compiles_each_block_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    model = build_model("gpt", 0, layers=4)
    whole_model = copy.deepcopy(model)
    forget_compiled()
    losses, params, m = _train(model)
    # F: embeddings, 4 blocks, head; B: head, 3 blocks, the first block, the embeddings' backward (with
    # their gradients' in-place accumulation, codegen/accumulate.py, it is a piece of its own)
    assert m.cache_misses + m.cache_hits <= 7 and m.reused >= 5 and m.fallbacks == 0, m
    monkeypatch.setenv("PIPER_REGIONAL", "0")
    forget_compiled()
    torch._dynamo.reset()  # a new compile, not the first model's compiled code (shared by instances)
    whole_losses, whole_params, whole = _train(whole_model)
    assert whole.reused == 0 and whole.cache_misses + whole.cache_hits == 2
    torch.testing.assert_close(losses, whole_losses, rtol=1e-6, atol=1e-6)
    for a, b in zip(params, whole_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 6 s: keeps the fast subset under 5 min
def test_a_piece_inductor_cannot_compile_runs_eagerly_and_names_the_piece(monkeypatch):
    real = CompiledSegment._inductor

    def broken_blocks(self, gm, args, same):
        if any(n.op == "call_function" and "scaled_dot_product" in str(n.target) for n in gm.graph.nodes):
            raise AssertionError("simulated Inductor bug")
        return real(self, gm, args, same)

    monkeypatch.setattr(CompiledSegment, "_inductor", broken_blocks)
    forget_compiled()
    torch._dynamo.reset()
    model = build_model("gpt", 0, layers=2)
    ref = copy.deepcopy(model)
    step = piper.compile(model, directives=[piper.split(2)], optimizer=SGD)
    x, y = model.make_batch(8, torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"segment F.all .*\(piece blocks\.0\)"):
        loss = step(x, y)
    torch.testing.assert_close(loss.detach(), ref(x, y).detach(), rtol=1e-5, atol=1e-6)
    seg = piper.compiled_steps(step)[0].compiled["F.all"]
    assert seg.pieces == 4 and seg.fallback and "reused" not in seg.outcomes


@pytest.mark.slow  # in the full suite; keeps the fast subset under 5 min
@pytest.mark.parametrize("blocks_per_bucket,dim", [(1.0, 32), (2.5, 32), (0.5, 32), (1.0, 192)])
def test_zero3_chunks_hold_whole_blocks(blocks_per_bucket, dim):
    """ZeRO-3 cuts the forward where it reads another gradient bucket, and buckets used to end inside a
    block, so no two chunks held alike pieces. A bucket at least a block large now ends with a block:
    every block's forward and backward lie in one chunk each (so alike blocks can compile as one graph),
    also the first bucket, which is otherwise cut at 1 MiB (dim 192: a block of 1.7 MiB). A bucket
    smaller than a block is cut where it fills, as asked."""
    model = build_model("gpt", 0, layers=4, dim=dim)
    block_mb = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters()) / 2**20
    plan = piper.plan(model, *model.make_batch(4, torch.Generator().manual_seed(0)), world_size=2,
                      directives=[piper.replicate(zero=3, bucket_mb=blocks_per_bucket * block_mb), piper.split(1)],
                      options={"optimizer": SGD})
    chunks: dict[tuple[str, str], set[str]] = {}
    for seg in plan.segments.values():
        for n in seg.gm.graph.nodes:
            if n.op in ("placeholder", "output"):  # an input keeps its producer's module
                continue
            block = regional.block_of(n)
            if block and block[0]:
                chunks.setdefault((seg.name[0], block[0]), set()).add(seg.name)
    assert len({k[1] for k in chunks}) == 4, chunks
    whole = all(len(names) == 1 for names in chunks.values())
    assert whole == (blocks_per_bucket >= 1), chunks
    backward = {name for names in chunks.values() for name in names if name.startswith("B")}
    assert len(backward) >= (4 if blocks_per_bucket == 1 else 2)
