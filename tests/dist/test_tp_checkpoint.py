"""Checkpoints under tensor parallelism (``piper.shard_tensor``) on real gloo ranks: each rank writes its
piece of every split layer (and of its AdamW state) as boxes of the full tensor, one per fused block
(``colwise:3``: three), the data-parallel replicas' copies once; a run resumed in fresh processes
continues bitwise, the checkpoint loads into another layout and into an eager model, and full weights
(``full_state_dict``, ``model.state_dict()``) are gathered from the pieces."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import _make, _train, check_sharded_resume

import piper_compile as piper
from piper_compile.testing.launch import run_local
from piper_compile.testing.parity import RunConfig, _model, eager_reference

pytestmark = pytest.mark.slow

ADAMW = ("AdamW", {"lr": 1e-3, "weight_decay": 0.1})
TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
SPLIT = {f"blocks.{i}.{name}": how for i in range(2)  # (split dim, fused blocks)
         for name, how in {"qkv.weight": (0, 3), "qkv.bias": (0, 3), "proj.weight": (1, 1), "fc.weight": (0, 1),
                           "fc.bias": (0, 1), "out.weight": (1, 1)}.items()}


def _cfg(directives: list, stages: int = 1) -> RunConfig:
    return RunConfig(model="gpt", model_kwargs={"layers": 2}, local_batch=4, tp=2, optimizer=ADAMW, steps=6,
                     directives=directives, stages=stages)


def _first_run(rank: int, world: int, cfg: RunConfig, path: str) -> dict:
    model, step = _make(cfg, cfg.seed)
    losses = _train(step, model, cfg, rank, world, range(3))
    piper.save(step, path)  # mid-run: the run goes on undisturbed
    full3 = piper.full_state_dict(step)
    losses += _train(step, model, cfg, rank, world, range(3, 6))
    st = piper.compiled_steps(step)[0].state
    trained = piper.trained_parameters(step)  # under PP: this stage's
    local = {f: tuple(sh.param.shape) for f, sh in st.shards.items() if f in SPLIT and f in trained}
    module_sd = {k: v.clone() for k, v in model.state_dict().items()}  # pieces gathered by piper's hook
    full = piper.full_state_dict(step)
    # model.load_state_dict(full) puts each rank's piece into its shard (the model's weights stay released)
    before = {f: st.shards[f].param.detach().clone() for f in local}
    with torch.no_grad():
        for f in local:
            st.shards[f].param.zero_()
    piper.load_full_state_dict(step, full)
    reloaded = all(torch.equal(st.shards[f].param, before[f]) for f in local)
    released = all(st.named[f].untyped_storage().nbytes() == 0 for f in local)
    return {"losses": losses, "full": full, "module_sd": module_sd, "local": local,
            "reloaded": reloaded, "released": released, "full3": full3}


def _resumed_run(rank: int, world: int, cfg: RunConfig, path: str, other: list, full3: dict) -> dict:
    model, step = _make(cfg, cfg.seed + 7)  # other initial weights: all must come from the checkpoint
    piper.load(step, path)  # before the first call: deferred into it, after the layers are split
    out = {"resumed": _train(step, model, cfg, rank, world, range(3, 6)), "full": piper.full_state_dict(step)}
    # full tensors loaded before the first call go into the module, and are split from there at that call
    torch._dynamo.reset()
    model, step = _make(cfg, cfg.seed + 13)
    piper.load_full_state_dict(step, full3)
    out["from_full"] = _train(step, model, cfg, rank, world, range(3, 4))
    # the checkpoint is per parameter, full shapes: a layout without tensor parallelism loads it
    torch._dynamo.reset()
    model, step = _make(dataclasses.replace(cfg, directives=other), cfg.seed + 11)
    piper.load(step, path)
    out["other_layout"] = _train(step, model, cfg, rank, world, range(3, 6))
    return out


def _check_chunks(path: str, zero: bool) -> None:
    """Every tensor of the checkpoint is stored as boxes that cover it exactly once (the data-parallel
    replicas' identical boxes deduplicated); without ZeRO every split tensor (weight, exp_avg, exp_avg_sq)
    is 2 ranks' x blocks boxes along its split dimension."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, meta in md.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        seen = torch.zeros(meta.size, dtype=torch.int32)
        for c in meta.chunks:
            box = seen
            for d, (o, n) in enumerate(zip(c.offsets, c.sizes)):
                box = box.narrow(d, o, n)
            box += 1
        assert bool((seen == 1).all()), (key, meta.chunks)
    if zero:
        return
    for f, (dim, blocks) in SPLIT.items():
        for key in (f"model.{f}", f"optim.state.{f}.exp_avg", f"optim.state.{f}.exp_avg_sq"):
            chunks, full = md[key].chunks, md[key].size
            assert len(chunks) == 2 * blocks, (key, chunks)
            assert all(c.sizes[dim] == full[dim] // (2 * blocks) for c in chunks), (key, chunks)


def _check(cfg: RunConfig, world: int, tmp_path, other: list) -> None:
    path = str(tmp_path / "ckpt")
    first = run_local(_first_run, world, cfg, path)
    _check_chunks(path, zero=any(d.get("zero", 0) for d in cfg.directives))
    second = run_local(_resumed_run, world, cfg, path, other, first[0]["full3"])
    ref = eager_reference(cfg, world)
    eager = _model(cfg)
    names = list(eager.state_dict())
    assert set(SPLIT) == {f for a in first for f in a["local"]}  # every split layer is trained by some rank
    for rank, (a, b) in enumerate(zip(first, second)):
        for f, shape in a["local"].items():  # this rank trains half of every split tensor it trains
            dim = SPLIT[f][0]
            full = list(eager.get_parameter(f).shape)
            assert list(shape) == full[:dim] + [full[dim] // 2] + full[dim + 1:], (rank, f, shape)
        assert b["from_full"] == a["losses"][3:4], (rank, b["from_full"])  # the same weights: the same loss
        check_sharded_resume(rank, a, b, names, ref)
    # an eager model loads the checkpoint directly (every layer assembled from the ranks' boxes)
    sd = {"model": eager.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    eager.load_state_dict(sd["model"])
    ref3 = eager_reference(dataclasses.replace(cfg, steps=3), world)
    for (name, p), q in zip(eager.named_parameters(), ref3["params"]):
        torch.testing.assert_close(p.detach(), q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_resume_tp2_adamw(tmp_path):
    """Loads into plain data parallelism over the same two ranks (both get the same batch: the same math)."""
    _check(_cfg([piper.split(2), piper.shard_tensor(TP)]), 2, tmp_path, other=[piper.split(2), piper.replicate()])


def test_resume_pp2_x_tp2_adamw(tmp_path):
    """Stages on [0, 1] and [2, 3], each a tensor-parallel pair, the embedding tied to the LM head across
    stages; loads into the same pipeline with the pairs as data-parallel replicas instead."""
    groups = [[0, 1], [2, 3]]
    pp = [*piper.pipeline(2, ranks=groups), piper.split(4), *piper.schedules.one_f_one_b(2, 4)]
    _check(_cfg([*pp, piper.shard_tensor(TP, devices=groups)], stages=2), 4, tmp_path,
           other=[*pp, piper.replicate({"PP": "*"})])


def test_resume_dp2_x_tp2_adamw(tmp_path):
    """Loads into ZeRO-1 data parallelism over the four ranks."""
    d = [piper.split(2), piper.replicate(), piper.shard_tensor(TP, devices=[[0, 1], [2, 3]])]
    _check(_cfg(d), 4, tmp_path, other=[piper.split(2), piper.replicate(zero=1, bucket_mb=0.01)])


def test_resume_dp2_x_tp2_zero1_adamw(tmp_path):
    """ZeRO-1 within the data-parallel subgroups [0, 2] and [1, 3]: a shard's flat range of a rank's piece
    becomes boxes of the full tensor, cut where the piece's fused q/k/v blocks meet; loads into the same
    tensor parallelism without ZeRO. Two optimizer groups (``parity.two_groups``): the shards' runs of each
    group hold tensor-parallel pieces."""
    tp = piper.shard_tensor(TP, devices=[[0, 1], [2, 3]])
    cfg = dataclasses.replace(_cfg([piper.split(2), piper.replicate(zero=1, bucket_mb=0.01), tp]), param_groups=True)
    _check(cfg, 4, tmp_path, other=[piper.split(2), piper.replicate(), tp])
