"""The garbage-collector window of a step's first call (``gcwindow.py``): objects from before are out of
the collector's reach inside it and back after it, garbage made inside is still collected, and it never
undoes a freeze it did not make."""
from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

import piper_compile as piper
from piper_compile import gcwindow
from piper_compile.compiled_step import CompiledStep
from piper_compile.testing.models import build_model


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _no_foreign_freeze():
    gc.unfreeze()  # a clean collector for each test
    yield
    gc.unfreeze()


def test_the_window_freezes_what_was_alive_and_puts_it_back():
    before = gc.get_threshold()
    with gcwindow.young_only() as open_:
        assert open_ and gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == max(before[0], gcwindow._YOUNG) and gc.get_threshold()[1:] == before[1:]
        with gcwindow.young_only() as inner:  # nested: the outer window is left as it is
            assert not inner
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_garbage_made_inside_the_window_is_still_collected_by_itself():
    """No explicit collection: the window's own young collections find the cycle (a window that turned
    the collector off would keep it)."""
    with gcwindow.young_only():
        ref = weakref.ref(_Cycle())
        assert ref() is not None
        kept = [[] for _ in range(30 * gcwindow._YOUNG)]  # tracked allocations: young collections run
        assert ref() is None
        del kept


def test_garbage_from_before_is_collected_after_the_window():
    ref = weakref.ref(_Cycle())
    with gcwindow.young_only():
        gc.collect()
        assert ref() is not None  # frozen: not walked inside the window
    gc.collect()
    assert ref() is None


def test_a_freeze_made_by_someone_else_is_kept():
    """The count of frozen objects may drop while the test runs (a frozen object freed), so the check
    follows one object: frozen objects are in no generation gc.get_objects() walks."""
    sentinel = [object()]
    gc.freeze()
    assert not any(o is sentinel for o in gc.get_objects())
    with gcwindow.young_only() as open_:
        assert not open_
    assert gc.get_freeze_count() > 0
    assert not any(o is sentinel for o in gc.get_objects()), "the window unfroze someone else's freeze"


@pytest.mark.parametrize("why", ["knob", "disabled"])
def test_no_window_with_the_knob_off_or_the_collector_off(monkeypatch, why):
    if why == "knob":
        monkeypatch.setenv("PIPER_GC_WINDOW", "0")
    else:
        gc.disable()
    try:
        with gcwindow.young_only() as open_:
            assert not open_ and gc.get_freeze_count() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("entry", ["piper.compile", pytest.param("torch.compile", marks=pytest.mark.slow)])  # slow: keeps the fast subset under 5 min
def test_a_step_s_first_call_in_each_grad_mode_runs_in_the_window(monkeypatch, entry):
    """Under piper.compile the window opens before Dynamo's trace; under torch.compile(backend="piper")
    at the step's first call (capture, planning, loading code). Later calls run without one."""
    seen: list[bool] = []
    enter = CompiledStep._enter

    def spy(self, args):
        seen.append(gcwindow._open[0])
        return enter(self, args)

    monkeypatch.setattr(CompiledStep, "_enter", spy)
    model = build_model("gpt", 0, layers=2, dim=32, heads=2)
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    options = {"optimizer": functools.partial(torch.optim.SGD, lr=0.1), "codegen": "eager"}
    if entry == "piper.compile":
        step = piper.compile(model, **options)
    else:
        step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options={"directives": [], **options})
    for _ in range(2):
        step(*batch)
    with torch.no_grad():  # a forward-only plan: its first call is a first call too
        step(*batch)
        step(*batch)
    assert seen == [True, False, True, False] and gc.get_freeze_count() == 0
