"""The GPT's tied embedding / LM head under pipelining against eager (real gloo ranks, AdamW, 5 steps):
each holder stage accumulates its own part of the gradient over the micro-batches and the parts are
exchanged once per step (``capture/grad_parts.py``, ``passes/lower.py``), alone and with the stages
replicated under ZeRO-3. The memory report's measured figures stay within 10% of the prediction, which
counts a sent value live until its send completes."""
from __future__ import annotations

import pytest

import piper_compile as piper
from piper_compile.testing.parity import RunConfig, run_parity

pytestmark = pytest.mark.slow
S = piper.schedules
ADAMW = ("AdamW", {"lr": 1e-2, "weight_decay": 0.01})
P_TOL = dict(rtol=1e-4, atol=5e-4)  # AdamW on ~0 gradients: summation order noise (see test_zero)
M = 4


def _part_traffic(program: str, fqn: str = "wte.weight") -> tuple[int, int]:
    """(part sends or receives, finished-gradient sends or receives) of the tied weight ``fqn`` in one
    rank's program text."""
    steps = [ln.split()[1] for ln in program.splitlines()[1:]]  # "  <pos> <instruction> <stream> ..."
    return (sum(s.startswith((f"SEND.part:{fqn}", f"RECV.part:{fqn}")) for s in steps),
            sum(s.startswith((f"SEND.grad:{fqn}", f"RECV.grad:{fqn}")) for s in steps))


def _check(res: list[dict], stages: int) -> None:
    for rank, r in enumerate(res):
        parts, final = _part_traffic(r["program"])
        assert parts == 1 and final == 1, (rank, parts, final)  # once per step on both holders
        m = r["memory"]
        assert abs(m.predicted.peak_activations - m.measured.peak_activations) <= 0.1 * m.measured.peak_activations
    # activations and their gradients between the stages, the part and the sum: nothing else
    assert res[stages - 1]["p2p"] == 2 * M + 2


def test_pp2_tied_gpt():
    res = run_parity(RunConfig(model="gpt", stages=2, local_batch=8, steps=5, optimizer=ADAMW,
                               directives=[*piper.pipeline(2), piper.split(M), *S.one_f_one_b(2, M)]), 2, **P_TOL)
    _check(res, 2)


def test_pp2_x_dp2_zero3_tied_gpt():
    d = [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.split(M), *S.one_f_one_b(2, M),
         piper.replicate({"PP": "*"}, zero=3, bucket_mb=0.01)]
    res = run_parity(RunConfig(model="gpt", stages=2, local_batch=8, steps=5, optimizer=ADAMW, directives=d), 4,
                     **P_TOL)
    _check(res, 2)
    assert "AR.t0@dp" in res[0]["program"]  # the completing stage reduces the summed tied gradient


def test_pp3_one_weight_held_by_three_stages():
    """One Linear used by every stage: the two holders that finish first each send their part once per
    step, the last one adds both in, and the finished gradient goes back to each of them."""
    res = run_parity(RunConfig(model="tied_mlp", stages=3, local_batch=8, steps=5, optimizer=ADAMW,
                               directives=[*piper.pipeline(3), piper.split(M), *S.one_f_one_b(3, M)]), 3, **P_TOL)
    traffic = [(_part_traffic(r["program"], "layers.0.weight"), _part_traffic(r["program"], "layers.0.bias"))
               for r in res]
    for rank, (w, b) in enumerate(traffic):
        assert w == b, (rank, traffic)  # the bias is shared with the weight: the same exchange
    parts = [w[0] for w, _ in traffic]
    finals = [w[1] for w, _ in traffic]
    assert sorted(parts) == [1, 1, 2] and sorted(finals) == [1, 1, 2], traffic
    assert parts.index(2) == finals.index(2), traffic  # the rank that receives the parts sends the sum back
