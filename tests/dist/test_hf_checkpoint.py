"""Hugging Face checkpoints straight into the sharded layout (``checkpoint/hf.py``): a tiny transformers model
saved with ``save_pretrained`` (several safetensors files and their index) loads into a model built on the
meta device (``options["init"] = "checkpoint"``: each rank allocates only its pieces) under PP2 x DP2
ZeRO-3 (Llama) and EP2 (Qwen3-MoE, per-expert tensors into stacked expert pieces); each rank reads only
its share of the files' bytes; training matches eager training of the same model; the trained model saved
with ``piper.save(..., format="hf")`` loads into a plain ``from_pretrained`` model with equal tensors."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.nn.hf import hf_state_dict, init_fn
from piper_compile.testing import hf as H
from piper_compile.testing.launch import run_local

pytestmark = pytest.mark.slow


@dataclasses.dataclass
class Job:
    family: str  # "llama" | "qwen3_moe"
    directives: list[Any]
    src: str
    out: str
    stages: int = 1
    steps: int = 3
    local_batch: int = 4
    dp: int = 2


def _model(job: Job, meta: bool) -> torch.nn.Module:
    with torch.device("meta") if meta else torch.device("cpu"):
        if job.family == "llama":
            return H.LlamaLoss(seed=None if meta else 0)
        return H.Qwen3MoeLoss(seed=None if meta else 0)


def _batch(model: torch.nn.Module, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return H.make_batch(n, torch.Generator().manual_seed(100 + step), vocab=model.vocab, seq=model.seq)


def _worker(rank: int, world: int, job: Job) -> dict[str, Any]:
    model = _model(job, meta=True)
    if job.stages > 1:
        model.annotate_stages(job.stages)
    step = piper.compile(model, directives=job.directives, codegen="eager", init="checkpoint",
                         init_fn=init_fn(model), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    piper.load(step, job.src)
    replica = next((d["devices"].index(rank) for d in job.directives if isinstance(d, dict) and d.get("op") == "place"
                    and rank in d["devices"]), rank)
    losses = []
    for s in range(job.steps):
        x, y = _batch(model, s, job.local_batch * job.dp)
        rows = slice(replica * job.local_batch, (replica + 1) * job.local_batch)
        losses.append(step(x[rows], y[rows]).item())
    piper.save(step, job.out, format="hf")
    st = piper.compiled_steps(step)[0].state
    mem = piper.memory_report(step)
    return {"losses": losses, "read": st.load_bytes, "params": mem.predicted.params, "held": mem.measured.params}


def _reference(job: Job) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(job, meta=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for s in range(job.steps):
        x, y = _batch(model, s, job.local_batch * job.dp)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, hf_state_dict(model.model)


def _saved(job: Job, tmp: Any) -> None:
    src = _model(job, meta=False).model
    if job.family == "qwen3_moe":  # transformers' own (unadapted) layout: one tensor per expert
        src = H.build_qwen3_moe(seed=0, adapt=False)
    src.save_pretrained(job.src, safe_serialization=True, max_shard_size="60KB")
    assert os.path.exists(os.path.join(job.src, "model.safetensors.index.json"))


def _check(job: Job, world: int, loaded_cls: Any) -> list[dict[str, Any]]:
    results = run_local(_worker, world, job)
    ref_losses, ref = _reference(job)
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, rank=rank: f"rank {rank}: {m}")
        assert r["held"] == r["params"], (rank, r)  # only its pieces were ever allocated
        assert 0.98 * r["params"] <= r["read"] <= r["params"], (rank, r["read"], r["params"])
    back = loaded_cls.from_pretrained(job.out).state_dict()
    assert set(back) == set(ref), sorted(set(back) ^ set(ref))
    for k, v in ref.items():
        torch.testing.assert_close(back[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    return results


def test_llama_pp2_x_dp2_zero3_loads_its_share_and_saves_back(tmp_path):
    from transformers import LlamaForCausalLM

    job = Job("llama", [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(2),
                        *piper.schedules.one_f_one_b(2, 2), piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.01)],
              str(tmp_path / "src"), str(tmp_path / "out"), stages=2)
    _saved(job, tmp_path)
    res = _check(job, 4, LlamaForCausalLM)
    whole = sum(p.numel() * 4 for p in _model(job, meta=False).parameters())
    assert sum(r["read"] for r in res) <= 1.01 * whole  # the four ranks together read the files once


def test_qwen3_moe_ep2_reads_only_its_experts_and_saves_back(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    job = Job("qwen3_moe", [piper.split(2), piper.replicate(), piper.shard({"EP": "*"})],
              str(tmp_path / "src"), str(tmp_path / "out"))
    _saved(job, tmp_path)
    res = _check(job, 2, Qwen3MoeForCausalLM)
    model = _model(job, meta=False)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down"))
    whole = sum(p.numel() * 4 for p in model.parameters())
    for r in res:  # every non-expert tensor, half of the experts
        assert r["read"] == whole - experts // 2, (r["read"], whole, experts)


def test_a_checkpoint_of_another_model_is_named():
    """Runs in one process: the key check happens when piper.load is called."""
    import tempfile

    from piper_compile.errors import PiperError

    with tempfile.TemporaryDirectory() as d:
        H.build_llama(seed=0, num_hidden_layers=2).save_pretrained(d, safe_serialization=True)
        model = H.LlamaLoss(seed=0)  # 4 layers
        step = piper.compile(model, directives=[], codegen="eager")
        with pytest.raises(PiperError, match=r"does not match the model: missing model\.layers\.2\."):
            piper.load(step, d)
        res = piper.load(step, d, strict=False)
        assert "model.layers.3.mlp.up_proj.weight" in res.missing_keys
