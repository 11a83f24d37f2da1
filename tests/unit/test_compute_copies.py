"""Mixed precision's compute copies (runtime/compute_copies.py): made once, kept while the master does not
change, all refreshed in place by one multi-tensor copy after an update, and never handed out stale."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from piper_compile.runtime.compute_copies import ComputeCopies


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_copies_are_kept_then_refreshed_together_in_place():
    masters = {f"w{i}": torch.randn(3, 4 + i) for i in range(5)}
    cc = ComputeCopies()
    first = {f: cc.get(f, m, torch.bfloat16, 0) for f, m in masters.items()}
    assert all(first[f] is cc.get(f, m, torch.bfloat16, 0) for f, m in masters.items())  # kept
    with torch.no_grad():
        for m in masters.values():
            m.add_(1.0)  # the optimizer's in-place update
    with _Ops() as ops:
        again = {f: cc.get(f, m, torch.bfloat16, 1) for f, m in masters.items()}
    assert [n for n in ops.names if "copy" in n or n.startswith("_to_copy")] == ["_foreach_copy_.default"], ops.names
    for f, m in masters.items():
        assert again[f] is first[f] and again[f].dtype == torch.bfloat16  # the same buffer, new values
        torch.testing.assert_close(again[f], m.to(torch.bfloat16), rtol=0, atol=0)


def test_a_master_changed_outside_an_update_or_replaced_is_cast_again():
    w = torch.randn(8)
    cc = ComputeCopies()
    c0 = cc.get("w", w, torch.bfloat16, 0)
    with torch.no_grad():
        w.mul_(2.0)  # a checkpoint load or a ZeRO gather into the master: its version moves
    torch.testing.assert_close(cc.get("w", w, torch.bfloat16, 0), w.to(torch.bfloat16), rtol=0, atol=0)
    other = torch.randn(8)  # another master object under the same name (a re-sharded parameter)
    got = cc.get("w", other, torch.bfloat16, 0)
    torch.testing.assert_close(got, other.to(torch.bfloat16), rtol=0, atol=0)
    assert c0.data_ptr() != 0 and len(cc.held()) == 1


def test_a_released_master_is_not_read():
    w = torch.randn(16)
    cc = ComputeCopies()
    cc.get("w", w, torch.bfloat16, 0)
    keep = torch.randn(4)
    cc.get("k", keep, torch.bfloat16, 0)
    w.untyped_storage().resize_(0)  # ZeRO-3 released it between steps
    got = cc.get("k", keep, torch.bfloat16, 1)  # the refresh skips w (no storage) instead of reading it
    torch.testing.assert_close(got, keep.to(torch.bfloat16), rtol=0, atol=0)


def test_a_step_that_updated_leaves_its_copies_fresh_for_the_next():
    """The executor refreshes the copies at the end of a step that updated (the host is then ahead of the
    device), so the next step's first read finds them current instead of launching the copy itself."""
    import functools

    import piper_compile as piper
    from piper_compile.testing.models import build_model

    model = build_model("mlp", 0)
    step = piper.compile(model, directives=[piper.split(2)], codegen="eager", mixed_precision={"param_dtype": "bf16"},
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    for _ in range(2):
        step(*batch)
        state = piper.compiled_steps(step)[0].state
        copies = state._copies._copies
        assert copies and all(c.key[0] == state.updates for c in copies.values())
        for c in copies.values():
            torch.testing.assert_close(c.copy, c.source.detach().to(torch.bfloat16), rtol=0, atol=0)
