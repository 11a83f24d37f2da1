"""Golden pass tests: each DAG pass run on a DAG read from text, its output compared with the recorded text.

A case names a small model, the directives, and the pass under test. Its file in ``golden/`` holds the
DAG the passes before it produce (``--- in``) and the DAG that pass makes of it (``--- out``). The test
checks both: the pipeline still produces the recorded input, and the pass, run on that input *parsed
from the file*, prints exactly the recorded output. A change that alters a plan shows as a readable
text diff; after checking it, rewrite the files with ``pytest tests/unit/test_pass_golden.py
--update-golden``. The goldens are for the pinned torch (``.ci/run``): capture names come from it.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import piper_compile as piper
from piper_compile.api import capture_step
from piper_compile.directives.spec import parse_directives
from piper_compile.ir.dag import TrainingDAG, parse_dag
from piper_compile.passes.context import PassContext
from piper_compile.passes.driver import pass_steps
from piper_compile.testing.models import build_model

GOLDEN = Path(__file__).parent / "golden"
TP = {"blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
SGD = functools.partial(torch.optim.SGD, lr=0.1)  # ZeRO-1/3 shard optimizer state: piper runs it
PP2 = [piper.place({"PP": 0}, [0]), piper.place({"PP": 1}, [1])]

# name -> (model, model kwargs, world, directives, the pass under test)
CASES: dict[str, tuple[str, dict[str, Any], int, list[Any], str]] = {
    "place": ("mlp", {"depth": 2, "stages": 2}, 2, PP2, "place#1"),
    "split": ("mlp", {"depth": 2, "stages": 2}, 2, [*PP2, piper.split(2)], "split#2"),
    "replicate_zero0": ("mlp", {"depth": 1}, 2, [piper.replicate()], "insert_grad_sync"),
    "replicate_zero1": ("mlp", {"depth": 1}, 2, [piper.replicate(zero=1)], "insert_grad_sync"),
    "replicate_zero3": ("mlp", {"depth": 1}, 2, [piper.replicate(zero=3)], "insert_param_gather"),
    "shard": ("moe", {"dim": 4, "hidden": 8, "experts": 2, "top_k": 1}, 2,
              [piper.replicate(), piper.shard({"EP": 0})], "lower_expert_parallel"),
    "shard_tensor": ("gpt", {"layers": 1, "dim": 8, "heads": 2, "vocab": 16, "seq": 4}, 2,
                     [piper.shard_tensor(TP)], "lower_tensor_parallel"),
    "order_overlap_slot": ("mlp", {"depth": 2, "stages": 2}, 2,
                           [*PP2, piper.split(2),
                            piper.order([{"PP": 0, "MB": 0, "PASS": "F"}],
                                        [{"PP": 0, "MB": 1, "PASS": "F"}, {"PP": 0, "MB": 0, "PASS": "B"}],
                                        [{"PP": 0, "MB": 1, "PASS": "B"}])], "order#3"),
    "lower_p2p": ("mlp", {"depth": 2, "stages": 2}, 2, [*PP2], "insert_p2p"),
    "lower_loss": ("mlp", {"depth": 2, "stages": 2}, 2, [*PP2], "insert_loss_reduce"),
}


@functools.lru_cache(maxsize=None)
def _captured(name: str) -> tuple[TrainingDAG, PassContext]:
    model_name, kwargs, world, directives, _ = CASES[name]
    kwargs = dict(kwargs)
    stages = kwargs.pop("stages", None)
    model = build_model(model_name, 0, **kwargs)
    if stages:
        model.annotate_stages(stages)  # type: ignore[operator]
    batch = model.make_batch(4, torch.Generator().manual_seed(0))  # type: ignore[operator]
    step = capture_step(model, *batch, directives=directives, world_size=world, options={"codegen": "eager", "optimizer": SGD})
    return step.initial_dag(False)


def _run(name: str) -> tuple[str, str, Any]:
    """(the text the passes before the one under test produce, that pass's step)"""
    dag, ctx = _captured(name)
    dag = dag.copy()
    target = CASES[name][4]
    for step_name, step in pass_steps(parse_directives(CASES[name][3]), ctx):
        if step_name == target:
            return dag.to_text(), step(dag.copy()).to_text(), step
        dag = step(dag)
    raise AssertionError(f"no pass {target} in case {name}")


def _read(path: Path) -> tuple[str, str]:
    text = path.read_text()
    head, rest = text.split("--- in\n", 1)
    in_text, out_text = rest.split("--- out\n", 1)
    return in_text, out_text


def _write(path: Path, name: str, in_text: str, out_text: str) -> None:
    model, kwargs, world, directives, target = CASES[name]
    head = (f"# golden pass test {name}: pass {target}\n# model {model} {json.dumps(kwargs)}, world {world}\n"
            f"# directives {json.dumps(directives)}\n")
    path.write_text(f"{head}--- in\n{in_text}--- out\n{out_text}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_pass_on_text_gives_the_recorded_text(name: str, request: pytest.FixtureRequest) -> None:
    in_now, out_now, step = _run(name)
    path = GOLDEN / f"{name}.txt"
    if request.config.getoption("--update-golden"):
        GOLDEN.mkdir(exist_ok=True)
        _write(path, name, in_now, out_now)
    in_text, out_text = _read(path)
    assert in_now == in_text, f"the passes before {CASES[name][4]} no longer produce {path.name}'s input"
    out = step(parse_dag(in_text)).to_text()
    assert out == out_text, f"{CASES[name][4]} on {path.name}'s input no longer gives its output"
    assert out == out_now  # a parsed DAG plans exactly like the one the passes built


def test_every_golden_file_has_a_case() -> None:
    assert {p.stem for p in GOLDEN.glob("*.txt")} == set(CASES)


@pytest.mark.parametrize("name", ["shard", "shard_tensor", "order_overlap_slot", "replicate_zero3"])
def test_every_pass_runs_on_a_dag_read_from_text(name: str) -> None:
    """Not just the pass under test: every step of the case's pipeline gives the same DAG whether it
    gets the previous step's DAG or that DAG printed and parsed back."""
    dag, ctx = _captured(name)
    dag = dag.copy()
    for step_name, step in pass_steps(parse_directives(CASES[name][3]), ctx):
        from_text = step(parse_dag(dag.to_text())).to_text()
        dag = step(dag)
        assert from_text == dag.to_text(), step_name


def test_segment_passes_are_named_timed_and_dumped(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The joint graph is cut by named segment passes (capture/cut_passes.py) under the driver's rules:
    timed in order, the pieces dumped after each with PIPER_DEBUG (a split-backward schedule's BI/BW
    pieces appear after split_backward), and an optional one skippable by name."""
    model = build_model("mlp", 0, depth=2)
    model.annotate_stages(2)  # type: ignore[operator]
    batch = model.make_batch(4, torch.Generator().manual_seed(0))  # type: ignore[operator]
    directives = [*piper.pipeline(2), piper.split(2), *piper.schedules.zb_h1(2, 2)]
    monkeypatch.setenv("PIPER_DEBUG", "1")
    step = capture_step(model, *batch, directives=directives, world_size=2, options={"codegen": "eager"})
    step.initial_dag(False)
    assert list(step.graph_timings) == ["specialize_floats", "shard_linears", "sequence_parallel",  # graph passes (no-ops here)
                                        "regions", "split_backward", "bucket_chunks", "cut_pieces", "remat",
                                        "checkpoint"]
    err = capsys.readouterr().err
    after_split = err.split("segment pieces after split_backward", 1)[1].split("--- piper", 1)[0]
    assert "  BI {'PP': 0}" in after_split and "  BW {'PP': 0}" in after_split, after_split
    assert {s.pass_ for s in step.segments.values()} == {"F", "BI", "BW"}
    monkeypatch.setenv("PIPER_SKIP_PASSES", "split_backward")
    monkeypatch.delenv("PIPER_DEBUG")
    torch._dynamo.reset()
    plain = capture_step(model, *batch, directives=[*piper.pipeline(2), piper.split(2)], world_size=2)
    plain.initial_dag(False)
    assert "split_backward" not in plain.graph_timings and {s.pass_ for s in plain.segments.values()} == {"F", "B"}
