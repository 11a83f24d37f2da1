"""piper.stats(step): per-step metrics (metrics.py) on one rank: the FLOP count from the captured graph
against the analytic count of a GPT, throughput in tokens, MFU against a peak, the time split, the log line."""
from __future__ import annotations

import functools
import logging

import pytest
import torch

import piper_compile as piper
from piper_compile.errors import PiperError
from piper_compile.options import Options
from piper_compile.testing.models import build_model

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CFG = {"vocab": 256, "seq": 64, "dim": 128, "heads": 4, "layers": 2}


def _analytic_gpt_flops(model: torch.nn.Module, tokens: int) -> tuple[float, float]:
    """(6 N tokens + attention, the same with N = only the matmul weights): each matmul weight costs 2
    FLOPs per token forward, 4 backward (input and weight gradients); attention (QK^T and PV, 2 T d each
    per token and layer forward, not discounted for the causal mask) 3x that for training."""
    c = model.cfg
    attention = 12 * c.layers * c.seq * c.dim * tokens
    n_all = sum(p.numel() for p in model.parameters())
    n_matmul = c.layers * 12 * c.dim**2 + c.vocab * c.dim  # qkv, proj, fc, out; the tied head
    return 6 * n_all * tokens + attention, 6 * n_matmul * tokens + attention


def test_flops_of_the_captured_gpt_match_the_analytic_count():
    model = build_model("gpt", 0, **CFG)
    step = piper.compile(model, directives=[piper.split(2)], codegen="eager", optimizer=ADAMW)
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    for _ in range(2):
        step(*batch)
    m = piper.stats(step)
    tokens = 4 * CFG["seq"]
    rough, exact = _analytic_gpt_flops(model, tokens)
    assert abs(m.flops - rough) <= 0.05 * rough, (m.flops, rough)
    assert m.flops == exact  # every matmul of the joint graph, and nothing else, counted once
    assert m.samples == 4 and m.tokens == tokens and m.tokens_per_s == pytest.approx(tokens / m.step_time_s)
    assert m.step_time_s > 0 and 0 < m.compute_s <= m.step_time_s and m.update_s > 0
    assert m.exposed_comm_s == 0 and m.wait_s == 0  # one rank: nothing to wait for
    assert m.peak_source == "measured CPU matmul" and m.peak_tflops > 0 and 0 < m.mfu < 1.5
    assert m.peak_memory_bytes > 0 and "MFU" in m.line() and "tok/s" in m.line()


def test_samples_without_token_ids_and_peak_override(monkeypatch):
    monkeypatch.setenv("PIPER_PEAK_TFLOPS", "100")
    model = build_model("mlp", 0)
    step = piper.compile(model, codegen="eager", optimizer=ADAMW)
    step(*model.make_batch(8, torch.Generator().manual_seed(0)))
    m = piper.stats(step)
    assert m.tokens == 0 and m.samples == 8 and "samples/s" in m.line()
    assert (m.peak_tflops, m.peak_source) == (100.0, "PIPER_PEAK_TFLOPS")
    # 4 Linear(32, 32): forward, input and weight gradients, except the input gradient of the first
    assert m.flops == (3 * 4 - 1) * 2 * 8 * 32 * 32


def test_log_stats_writes_one_info_line_every_n_steps(caplog):
    model = build_model("mlp", 0)
    step = piper.compile(model, codegen="eager", optimizer=ADAMW, log_stats=2)
    batch = model.make_batch(8, torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="piper_compile.stats"):
        for _ in range(4):
            step(*batch)
    lines = [r.getMessage() for r in caplog.records if r.name == "piper_compile.stats"]
    assert len(lines) == 2 and all("MFU" in x and "samples/s" in x for x in lines), lines
    assert lines[0].startswith("piper rank 0 step 2:")
    with pytest.raises(PiperError, match="log_stats"):
        Options.parse({"log_stats": -1})


def test_a_recompile_is_said_once_and_counted():
    """A guard that fails (an attribute the forward branches on) recompiles the step: one warning naming
    the guard, counted by piper.stats; switching to torch.no_grad calls is not reported."""
    import warnings

    import torch.nn.functional as F
    from torch import nn

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.double = nn.Linear(8, 8), False

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return F.mse_loss(h * 2 if self.double else h, y)

    model = Branchy()
    step = piper.compile(model, codegen="eager", optimizer=ADAMW)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(x, y)
        model.double = True
        step(x, y)
        with torch.no_grad():
            step(x, y)
    said = [str(w.message) for w in caught if "compiles the piper step again" in str(w.message)]
    assert len(said) == 1 and "self.double" in said[0], said
    m = piper.stats(step)
    assert m.recompiles == 1 and m.compiled_segments >= 2 and m.fallbacks == 0
    # stats, memory_report and trained_parameters describe the variant that trained last
    first, second = [cs for cs in piper.compiled_steps(step) if False in cs.plans]
    assert piper.steps.trained_step(step) is second
    model.double = False
    step(x, y)
    assert piper.steps.trained_step(step) is first


def test_a_recompile_that_traces_the_same_graph_reuses_the_step():
    """A library that settles a config attribute inside the first call (transformers' config.problem_type)
    makes Dynamo's guard on it fail once; the graph it traces again is the same, so piper reuses its
    capture, plan and compiled segments: one line says so, stats count it, training goes on exactly."""
    import warnings

    import torch.nn.functional as F
    from torch import nn

    class Config:  # as transformers' PretrainedConfig: a plain object
        problem_type = None

    class Settles(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.config = Config()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if self.config.problem_type is None:
                self.config.problem_type = "regression"
            return F.mse_loss(self.fc(x), y)

    torch.manual_seed(0)
    model, ref = Settles(), Settles()
    ref.load_state_dict(model.state_dict())
    step = piper.compile(model, codegen="eager", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(s)), torch.randn(4, 8)
            loss = step(x, y)
            opt.zero_grad()
            want = ref(x, y)
            want.backward()
            opt.step()
            torch.testing.assert_close(loss, want.detach())
    said = [str(w.message) for w in caught if "compiles the piper step again" in str(w.message)]
    assert len(said) == 1 and "problem_type" in said[0] and "reuses its capture" in said[0], said
    assert len(piper.compiled_steps(step)) == 1 and piper.stats(step).recompiles == 1


@pytest.mark.slow
def test_vit_with_labels_does_not_capture_again_at_step_two():
    """transformers' ViTForImageClassification sets config.problem_type at the first call with labels:
    Dynamo recompiles once, piper reuses its step (it captured, planned and compiled again before)."""
    import warnings

    from piper_compile.testing.hf import HFLoss

    model = HFLoss("vit", hf_loss=True, seed=0)
    step = piper.compile(model, codegen="eager", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(2):
            step(*model.make_batch(4, torch.Generator().manual_seed(s)))
    said = [str(w.message) for w in caught if "compiles the piper step again" in str(w.message)]
    assert len(said) == 1 and "problem_type" in said[0] and "reuses" in said[0], said
    assert len(piper.compiled_steps(step)) == 1 and model.model.config.problem_type == "single_label_classification"


class _TimedEvent:
    """Stands in for ``torch.cuda.Event`` (no CUDA here): records a time, cannot be pickled."""

    def __init__(self, ms: float) -> None:
        self.ms, self.synced = ms, False

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: "_TimedEvent") -> float:
        return end.ms - self.ms

    def __reduce__(self):
        raise TypeError("cannot pickle 'Event' object")


def test_step_stats_with_device_events_pickle_with_the_device_time():
    """A rank's StepStats travel to the launcher (run_local pickles them): the CUDA events are read into
    ``device_s`` first (the GPU check failed with "cannot pickle 'Event' object")."""
    import io

    from piper_compile.runtime.step import StepStats

    start, end = _TimedEvent(10.0), _TimedEvent(35.0)
    stats = StepStats(seconds=0.5, events=(start, end))
    buf = io.BytesIO()
    torch.save(stats, buf)
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert end.synced and back.events is None and back.device_s == pytest.approx(0.025)
    assert back.device_seconds() == pytest.approx(0.025) and back.seconds == 0.5
    assert StepStats(seconds=0.5).device_seconds() is None
