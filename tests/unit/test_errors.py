"""Errors that name the cause, in one process: planning for no ranks, planning in a loop, and what a
failed communication wait is called."""
from __future__ import annotations

import pytest
import torch

import piper_compile as piper
from piper_compile.errors import PiperDirectiveError
from piper_compile.runtime.groups import describe_failure
from piper_compile.testing.models import build_model


def _mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model = build_model("mlp")
    model.annotate_stages(2)
    return model, model.make_batch(4, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("world_size", [0, -2])
def test_plan_for_no_ranks_is_a_directive_error(world_size: int) -> None:
    """Before: ``piper: internal: the lowered DAG breaks an invariant: F.PP0.mb0 is not placed``."""
    model, batch = _mlp()
    with pytest.raises(PiperDirectiveError) as info:
        piper.plan(model, *batch, directives=[piper.replicate()], world_size=world_size)
    msg = str(info.value)
    assert msg.startswith("piper: ") and "internal" not in msg, msg
    assert f"world_size must be a whole number of ranks, at least 1; got {world_size}" in msg, msg
    assert "Fix: pass world_size=N" in msg, msg


def test_plan_in_a_loop_leaves_the_users_recompile_budget() -> None:
    """Before: the 9th ``piper.plan`` raised Dynamo's ``FailOnRecompileLimitHit`` (each plan added a cache
    entry to ``forward``'s code), and the user's own compile of the model after 8 plans hit the limit."""
    model, batch = _mlp()
    texts = {piper.plan(model, *batch, directives=[*piper.pipeline(2), piper.split(2)], world_size=2).text()
             for _ in range(12)}
    assert len(texts) == 1
    assert "forward" not in model.__dict__  # the planning copy of forward is gone
    loss = torch.compile(model, backend="eager", fullgraph=True)(*batch)  # the user's own compile still fits
    torch.testing.assert_close(loss, model(*batch))


def test_peer_closed_is_not_called_a_timeout() -> None:
    line = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:41391. This is typically caused by a remote worker crashing. Check the logs of the remote "
            "worker before reporting an error.")
    text = describe_failure(RuntimeError(line + "\nException raised from ..."), 0.04, 10, [1])
    assert text.startswith("failed after 0.04s: peer rank 1 closed the connection (it crashed or exited)"), text
    assert f"(RuntimeError: {line})" in text and "within" not in text, text  # the whole first line, only it
    assert "rank 1's log" in text


def test_a_timeout_is_called_one() -> None:
    text = describe_failure(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms "
                                         "for recv operation to complete"), 3.0, 3, [0, 2, 3])
    assert text.startswith("did not complete within 3s (RuntimeError: [../gloo"), text
    assert "a rank of [0, 2, 3] is stuck" in text and "options['timeout']" in text, text
    assert describe_failure(None, 3.0, 3, [1]).startswith("did not complete within 3s: peer rank 1 is stuck")
