"""Planning without processes: ``piper.plan`` and ``python -m piper_compile explain``."""
from __future__ import annotations

import pytest
import torch

import piper_compile as piper
from piper_compile.cli import main
from piper_compile.ir.dag import Kind, parse_dag
from piper_compile.sim.simulate import simulate_plan
from piper_compile.testing.models import build_model


def test_plan_pp2_dp2_programs_and_text_round_trip():
    model = build_model("gpt", layers=2)
    model.annotate_stages(2)
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    directives = [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.replicate({"PP": "*"}), piper.split(2),
                  *piper.schedules.one_f_one_b(2, 2)]
    result = piper.plan(model, *batch, directives=directives, world_size=4)
    assert len(result.programs) == 4
    first = [i.short() for i in result.programs[0].instrs if i.node.kind is Kind.COMPUTE]
    assert first == ["F0.mb0", "F0.mb1", "B0.mb0", "B0.mb1"]  # 1F1B warm-up of 1 on stage 0 of 2
    last = [i.short() for i in result.programs[1].instrs if i.node.kind is Kind.COMPUTE]
    assert last == ["F1.mb0", "B1.mb0", "F1.mb1", "B1.mb1"]
    again = parse_dag(result.dag.to_text())
    assert again.to_text() == result.dag.to_text()
    # deterministic: planning twice gives the same DAG
    torch._dynamo.reset()
    assert piper.plan(model, *batch, directives=directives, world_size=4).dag.to_text() == result.dag.to_text()


def test_cli_explain(capsys):
    assert main(["explain", "--model", "mlp", "--stages", "2", "--dp", "3", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 0: ") and "# 6 ranks in 2 classes" in out and "verified" in out
    assert "(the same program, own peers, on 2 more ranks: 2, 4)" in out  # one program per class
    assert "(the same program, own peers, on 2 more ranks: 3, 5)" in out and "\nrank 3: " not in out
    assert "# predicted step" in out and "bubble" in out and "peak memory per rank" in out


def test_cli_simulate_writes_trace_and_grid(capsys, tmp_path):
    trace, grid = tmp_path / "t.json", tmp_path / "g.svg"
    assert main(["simulate", "--model", "mlp", "--stages", "2", "--microbatches", "4", "--trace", str(trace),
                 "--grid", str(grid)]) == 0
    out = capsys.readouterr().out
    assert not out.startswith("rank 0:") and "# predicted step" in out
    import json

    assert json.loads(trace.read_text())["traceEvents"]
    assert grid.read_text().lstrip().startswith("<svg") or "<svg" in grid.read_text()[:200]


def test_cli_reports_piper_errors(capsys, tmp_path):
    bad = tmp_path / "d.json"
    bad.write_text('[{"op": "place", "filter": {"PP": 0}, "devices": [5]}]')
    assert main(["explain", "--model", "mlp", "--stages", "2", "--world-size", "2", "--directives", str(bad)]) == 2
    assert "outside the world" in capsys.readouterr().err


class _AutoTagged(torch.nn.Module):
    """Tags regions inside forward with auto-indexed ``annotate("PP")`` blocks."""

    def __init__(self, mixed: bool = False) -> None:
        super().__init__()
        self.mixed = mixed
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with piper.annotate("PP"):
            x = torch.tanh(self.a(x))
        with piper.annotate("PP"):
            x = torch.tanh(self.b(x))
        if self.mixed:
            with piper.annotate(PP=5):
                x = x * 2
        return torch.nn.functional.mse_loss(self.c(x), y)


def test_auto_indexed_annotations_become_stages():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    result = piper.plan(_AutoTagged(), x, y, directives=[*piper.pipeline(2), piper.split(2)], world_size=2)
    regions = {i.node.tag("PP") for p in result.programs for i in p.instrs if i.node.kind is Kind.COMPUTE}
    assert regions == {0, 1}
    # the untagged head + loss join the latest tagged input's region: the last stage
    owners = {i.node.op.segment for i in result.programs[1].instrs if i.node.kind is Kind.COMPUTE}
    assert owners == {"F.PP1", "B.PP1"}


def test_mixing_auto_and_explicit_indices_is_rejected():
    with pytest.raises(piper.PiperCaptureError, match="both auto-indexed"):
        piper.plan(_AutoTagged(mixed=True), torch.randn(4, 8), torch.randn(4, 8), directives=[], world_size=1)


def test_plan_a_large_model_with_fake_parameters():
    """Parameters created under FakeTensorMode take no memory: a 1.2B-parameter GPT plans for PP4."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        model = build_model("gpt", dim=4096, layers=4, vocab=32000, seq=64)
        batch = model.make_batch(4, torch.Generator().manual_seed(0))
    assert isinstance(model.wte.weight, FakeTensor)
    assert sum(p.numel() for p in model.parameters()) > 0.9e9
    model.annotate_stages(4)
    result = piper.plan(model, *batch, directives=[*piper.pipeline(4), piper.split(2),
                                                    *piper.schedules.one_f_one_b(4, 2)], world_size=4)
    computes = [i.short() for i in result.programs[3].instrs if i.node.kind is Kind.COMPUTE]
    assert computes == ["F3.mb0", "B3.mb0", "F3.mb1", "B3.mb1"]


def test_cli_explain_zero3_plans_gathers_and_predicts_sharded_memory(capsys):
    """--zero 3 over PP2 x DP2: reduce-scatters and per-step gathers in the programs; the simulator's
    parameter bytes per rank are about half of what the same plan without ZeRO keeps."""
    args = ["explain", "--model", "mlp", "--stages", "2", "--dp", "2", "--microbatches", "2", "--bucket-mb", "0.001"]
    assert main(args + ["--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "RS.b0@dp" in out and "AG.b0>" in out and "UPD" in out
    model = build_model("mlp", dim=32, depth=4)
    model.annotate_stages(2)
    batch = model.make_batch(8, torch.Generator().manual_seed(0))
    d = [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(2), *piper.schedules.one_f_one_b(2, 2)]
    opt = {"optimizer": torch.optim.AdamW}
    plain = simulate_plan(piper.plan(model, *batch, directives=d + [piper.replicate({"PP": "*"})], world_size=4))
    zero3 = simulate_plan(piper.plan(model, *batch, directives=d + [piper.replicate({"PP": "*"}, zero=3)],
                                     world_size=4, options=opt))
    assert zero3.param_bytes[0] <= plain.param_bytes[0] // 2 + 64 and zero3.grad_bytes[0] == 0
    assert zero3.peak_gathered_bytes[0] > 0 and plain.peak_gathered_bytes[0] == 0


@pytest.mark.slow
def test_explain_plans_and_verifies_16384_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """README's claim: PP8 x DP2048 (16,384 ranks) planned, verified and simulated in one process, without
    launching anything (fake process group, meta tensors), one program per class of ranks."""
    assert main(["explain", "--model", "gpt", "--stages", "8", "--dp", "2048", "--microbatches", "16",
                 "--batch", "16", "--ranks", "0", "16383"]) == 0
    out = capsys.readouterr().out
    assert "# 16384 ranks in 8 classes" in out and "verified in" in out and "predicted step" in out, out[-2000:]
    first, last = (next(ln for ln in out.splitlines() if ln.startswith(f"rank {r}: ")) for r in (0, 16383))
    assert first.count(" F0.mb") == 16 and first.rstrip().endswith("UPD"), first[:200]  # stage 0, 16 micro-batches
    assert last.count(" B7.mb") == 16 and "AR.b0@dp" in last, last[:200]  # stage 7, its data-parallel reduction
