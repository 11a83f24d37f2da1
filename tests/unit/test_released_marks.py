"""``runtime/released.py``: a parameter or buffer piper released (no storage between steps) is marked, so
that reading it is a ``piper:`` error naming it, not a read of freed memory (a segfault on CPU)."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from piper_compile.errors import PiperError
from piper_compile.runtime import released
from piper_compile.runtime.zero import ensure_storage, free_storage


def _released_linear() -> nn.Linear:
    lin = nn.Linear(3, 4)
    free_storage(lin.weight)
    return lin


def test_a_marked_parameter_keeps_its_metadata_and_refuses_its_values():
    lin = _released_linear()
    bias = lin.bias.detach().clone()
    marked = released.mark({"fc.weight": lin.weight, "fc.bias": lin.bias})
    assert marked == [lin.weight]  # the bias has storage: left alone
    w = lin.weight
    assert isinstance(w, nn.Parameter) and released.is_marked(w) and not released.is_marked(lin.bias)
    assert (w.shape, w.numel(), w.dtype, w.device, w.requires_grad, w.grad, w.is_leaf) == (
        torch.Size([4, 3]), 12, torch.float32, torch.device("cpu"), True, None, True)
    assert sum(p.numel() for p in lin.parameters()) == 16 and len({w, lin.bias}) == 2
    assert w.untyped_storage().nbytes() == 0 and w.data_ptr() == 0  # its empty storage reads nothing
    assert "fc.weight" in repr(w) and "fc.weight" in f"{w}"
    w.grad = None
    for read in (lambda: w.sum(), lambda: torch.equal(w, torch.zeros(4, 3)), lambda: torch.zeros(4, 3).lerp_(w, 0.1),
                 lambda: w.detach(), lambda: w.data, lambda: lin(torch.ones(3)), lambda: copy.deepcopy(lin),
                 lambda: torch.save(lin, io.BytesIO()), lambda: w.add_(1), lambda: lin.to(torch.float64)):
        with pytest.raises(PiperError, match=r"piper: 'fc.weight' has no storage on this rank between steps .*"
                                             r"model.state_dict\(\)"):
            read()
    assert torch.equal(lin.bias.detach(), bias)
    released.unmark(marked)
    assert type(w) is nn.Parameter and w.untyped_storage().nbytes() == 0


def test_buffers_and_subclasses_and_the_storage_helpers():
    buf = torch.ones(5)
    free_storage(buf)

    class Mine(nn.Parameter):
        pass

    mine = Mine(torch.ones(2))
    free_storage(mine)
    assert released.mark({"running_mean": buf, "mine": mine, "empty": nn.Parameter(torch.ones(0))}) == [buf]
    assert type(buf) is released.ReleasedBuffer and type(mine) is Mine
    with pytest.raises(PiperError, match="'running_mean'"):
        buf.mean()
    assert ensure_storage(buf) and type(buf) is torch.Tensor  # piper's own helpers take the plain class back
    buf.fill_(2.0)
    released.mark({"running_mean": buf})
    assert type(buf) is torch.Tensor  # it has storage now: not marked
    free_storage(buf)
    released.mark({"running_mean": buf})
    free_storage(buf)  # a marked tensor released again
    assert type(buf) is torch.Tensor and buf.untyped_storage().nbytes() == 0


def test_state_dict_hooks_mark_again_only_what_they_unmarked():
    """Around model.state_dict() the hooks take the marks off and put them back; inside a public function
    that took them off itself (registry.plain_tensors), the post-hook leaves them off for it to restore."""
    from piper_compile.checkpoint import hooks
    from piper_compile.runtime.state import TrainState

    w = nn.Parameter(torch.ones(3))
    st = TrainState([w], None)
    st.named, st.released, st.marks_on = {"w": w}, {"w"}, True
    free_storage(w)
    st.mark_released()
    assert released.is_marked(w)
    hooks._unmark(st)
    assert not released.is_marked(w)
    hooks._mark(st)
    assert released.is_marked(w)  # the pair restores the mark
    assert st.unmark_released()  # a public function takes the marks off first ...
    hooks._unmark(st)
    hooks._mark(st)
    assert not released.is_marked(w)  # ... and the hooks inside it leave them off
    st.mark_released()
    assert released.is_marked(w)
