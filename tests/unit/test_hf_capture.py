"""transformers models compiled as a new user would: what Dynamo meets inside their ``forward``."""
from __future__ import annotations

import copy

import pytest
import torch

import piper_compile as piper

pytest.importorskip("transformers")
from piper_compile.testing.hf import HFLoss  # noqa: E402


def test_the_skipped_once_loggers_leave_dynamos_config_record_sortable():
    """Dynamo skips transformers' ``warning_once`` / ``info_once`` (piper adds them), while a copy of its
    config -- torch 2.11 sorts every set of it for each compile's metrics record -- holds sortable entries
    only. Before, after transformers' import, each compile logged "Unexpected exception logging compilation
    metrics ... '<' not supported between instances of 'functools._lru_cache_wrapper'" and the compiled
    model stayed alive."""
    import logging

    import transformers  # noqa: F401 - adds the once-loggers to logging.Logger

    skipped = torch._dynamo.config.ignore_logging_functions
    assert logging.Logger.warning_once in skipped and logging.Logger.info_once in skipped
    assert {logging.Logger.warning_once, logging.Logger.info_once} <= set(iter(skipped))  # what Dynamo iterates
    sorted(torch._dynamo.config.get_config_copy()["ignore_logging_functions"])


@pytest.mark.slow  # slow: keeps the fast subset under 5 min
def test_gpt2_with_labels_compiles_despite_warning_once():
    """GPT-2 called with ``labels=`` logs through transformers' ``logger.warning_once`` inside ``forward``;
    Dynamo used to stop there (``Unsupported: logging.Logger method not supported``). piper has Dynamo skip
    transformers' once-only logging methods; the step trains as eager does."""
    model = HFLoss("gpt2", seed=0, hf_loss=True)
    ref = copy.deepcopy(model)
    x, y = model.make_batch(4, torch.Generator().manual_seed(0))
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"codegen": "eager", "directives": [piper.split(2)]})
    loss = step(x, y)
    want = ref(x[:2], y[:2]) / 2 + ref(x[2:], y[2:]) / 2
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # ~7 s: plans a transformers model twice; the full suite runs it
def test_values_made_before_the_layers_join_the_first_stage_that_uses_them():
    """Gemma 2/3 with a sliding-window layer 0 and a full-attention layer 1 build layer 1's mask first, from
    ``cache_position = arange(seq)``, which layer 0 reads too. By "first tagged user" the arange joined
    stage 1 and stage 0 read it from there: ``RegionCycleError: segments F.PP0 <- F.PP1 <- F.PP0``. A
    value with no tagged input now joins the earliest stage among its users'."""
    model = HFLoss("gemma2", seed=0)
    model.annotate_stages(2)
    x, y = model.make_batch(4, torch.Generator().manual_seed(0))
    dirs = [*piper.pipeline(2), piper.split(2), *piper.schedules.one_f_one_b(2, 2)]
    p = piper.plan(model, x, y, directives=dirs, world_size=2)
    stage0 = {v for s in p.segments.values() if dict(s.region) == {"PP": 0} for v in s.outputs}
    stage1_reads = {v for s in p.segments.values() if dict(s.region) == {"PP": 1} for v in s.inputs}
    assert "arange" in stage0 and "arange" in stage1_reads
