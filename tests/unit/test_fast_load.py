"""A warm run loads each compiled segment piece straight from the FX-graph-cache entry recorded for it
(``codegen/artifacts.py``), without re-tracing or re-hashing it, and computes bitwise what compiling it
did; whatever goes wrong on the way (no record, a record naming a missing entry, the knob off) falls back
to the full path."""
from __future__ import annotations

import functools
import glob
import os
import shutil

import pytest
import torch
from torch import fx

import piper_compile as piper
from piper_compile.codegen import artifacts
from piper_compile.codegen.compile import forget_compiled
from piper_compile.testing.models import build_model

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _run(steps: int = 2) -> tuple[list[float], list[torch.Tensor], object]:
    """Train a fresh 2-layer GPT as a new process would (nothing compiled in this one yet)."""
    forget_compiled()
    torch._dynamo.reset()
    model = build_model("gpt", 0, layers=2)
    step = piper.compile(model, directives=[piper.split(2)], optimizer=SGD)
    losses = [step(*model.make_batch(4, torch.Generator().manual_seed(s))).item() for s in range(steps)]
    return losses, [p.detach().clone() for p in model.parameters()], piper.stats(step)


def _same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.slow
def test_a_warm_run_loads_every_piece_straight_and_matches_bitwise(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIPER_FAST_LOAD", "on")
    cold = _run()
    graphs = cold[2].cache_misses + cold[2].cache_hits
    assert cold[2].fast_loads == 0 and graphs >= 2
    records = glob.glob(str(tmp_path / "piper-artifacts" / "*"))
    assert len(records) == graphs, (records, cold[2])

    warm = _run()
    assert (warm[2].fast_loads, warm[2].cache_hits, warm[2].cache_misses) == (graphs, graphs, 0), warm[2]
    _same(cold, warm)

    # every record names an entry Inductor no longer has: each piece is compiled again, as without records
    for d in glob.glob(str(tmp_path / "fxgraph" / "*")):
        shutil.rmtree(d)
    gone = _run()
    assert gone[2].fast_loads == 0 and gone[2].cache_misses == graphs, gone[2]
    _same(cold, gone)

    # a damaged record: the full path finds the entry by hashing the re-traced piece
    for r in records:
        with open(r, "w") as fh:
            fh.write("not-a-key")
    damaged = _run()
    assert damaged[2].fast_loads == 0 and damaged[2].cache_hits == graphs, damaged[2]
    _same(cold, damaged)
    assert all(open(r).read() != "not-a-key" for r in records)  # written again from the full path
    assert _run()[2].fast_loads == graphs

    monkeypatch.setenv("PIPER_FAST_LOAD", "off")
    off = _run()
    assert off[2].fast_loads == 0 and off[2].cache_hits == graphs, off[2]
    _same(cold, off)


def test_the_key_follows_structure_inputs_settings_and_autocast():
    base = artifacts.key("s", (((4, 8), (8, 1), torch.float32, "cpu"),), "cfg")
    assert base == artifacts.key("s", (((4, 8), (8, 1), torch.float32, "cpu"),), "cfg")
    assert base != artifacts.key("t", (((4, 8), (8, 1), torch.float32, "cpu"),), "cfg")
    assert base != artifacts.key("s", (((4, 8), (1, 4), torch.float32, "cpu"),), "cfg")
    assert base != artifacts.key("s", (((4, 8), (8, 1), torch.bfloat16, "cpu"),), "cfg")
    assert base != artifacts.key("s", (((4, 8), (8, 1), torch.float32, "cpu"),), "cfg2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert base != artifacts.key("s", (((4, 8), (8, 1), torch.float32, "cpu"),), "cfg")


def test_the_key_follows_what_inductors_own_key_reads_of_the_process():
    import torch._inductor.config as inductor_config

    sig = (((4, 8), (8, 1), torch.float32, "cpu"),)
    base = artifacts.key("s", sig, "cfg")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # Inductor's C++ kernels specialize on it
        assert artifacts.key("s", sig, "cfg") != base
    finally:
        torch.set_num_threads(threads)
    dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)  # factory ops without a dtype lower with it
        assert artifacts.key("s", sig, "cfg") != base
    finally:
        torch.set_default_dtype(dtype)
    with inductor_config.patch({"post_grad_custom_post_pass": lambda g: None}):
        assert artifacts.key("s", sig, "cfg") is None  # a custom pass: no key piper can compute
    assert artifacts.key("s", sig, "cfg") == base


class _Compiled:
    _fx_graph_cache_key = "fabc"


def test_the_torch_sources_walk_lists_each_source_by_path_size_and_time_in_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.py").write_text("x = 1\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "c.cpp").write_text("int c;\n")
    (tmp_path / "notes.txt").write_text("not a source\n")
    (tmp_path / "link").symlink_to(tmp_path / "b", target_is_directory=True)  # not followed, as os.walk
    lines: list[str] = []
    artifacts._walk(str(tmp_path), ".", lines)
    assert [ln.split(":")[0] for ln in lines] == ["./a.py", "./b/x.py", "./c.cpp"]
    assert lines[1].split(":")[1] == "6"
    (tmp_path / "b" / "x.py").write_text("x = 2\n")  # an edit of the same size: the time tells
    os.utime(tmp_path / "b" / "x.py", ns=(1, 1))
    again: list[str] = []
    artifacts._walk(str(tmp_path), ".", again)
    assert again[0] == lines[0] and again[1] != lines[1] and again[1].endswith(":6:1")


def test_a_piece_holding_constants_is_not_recorded_and_a_missing_record_loads_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    class WithConstant(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("c", torch.ones(3))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x + self.c,)

    held = fx.symbolic_trace(WithConstant())
    assert held.graph.find_nodes(op="get_attr")
    artifacts.remember("k-held", held, _Compiled())
    assert not os.path.exists(tmp_path / "piper-artifacts" / "k-held")
    plain = fx.symbolic_trace(lambda x: (x * 2,))
    artifacts.remember("k-plain", plain, _Compiled())
    assert (tmp_path / "piper-artifacts" / "k-plain").read_text() == "fabc"
    assert artifacts.load("k-missing", []) is None
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(artifacts, "_path", lambda k: str(tmp_path / "a-file" / k))
    artifacts.remember("k-unwritable", plain, _Compiled())  # a cache directory that cannot be written: no record


def test_auto_is_on_from_torch_2_13_and_off_with_cuda_graphs(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("PIPER_FAST_LOAD", "auto")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    assert not artifacts.enabled()
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert artifacts.enabled()
    with inductor_config.patch({"triton.cudagraphs": True}):
        assert not artifacts.enabled()
    assert artifacts.enabled()


def test_the_vec_isa_load_probe_runs_once_per_library(monkeypatch, tmp_path):
    """Inductor's dlopen probe (a child process per vector ISA) is skipped for a library that loaded before;
    a changed library is probed again, and a failed probe is never written down."""
    from piper_compile.codegen import warmup

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    calls: list[str] = []
    outcome = {"ok": True}

    def probe(isa: object, library: str) -> bool:
        calls.append(library)
        return outcome["ok"]

    load = warmup.remembered(probe)
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"x")
    assert load(None, str(lib)) and load(None, str(lib))
    assert len(calls) == 1  # the second process-like call reads the record
    lib.write_bytes(b"xy")  # rebuilt: another size
    assert load(None, str(lib)) and len(calls) == 2
    other = tmp_path / "other.so"
    other.write_bytes(b"z")
    outcome["ok"] = False
    assert not load(None, str(other)) and not load(None, str(other))
    assert len(calls) == 4  # failures run every time
    assert not load(None, str(tmp_path / "missing.so")) and len(calls) == 5


def test_the_probe_record_is_installed_only_where_fast_load_is_on(monkeypatch):
    from torch._inductor.cpu_vec_isa import VecISA

    from piper_compile.codegen import warmup

    if not hasattr(VecISA, "_probe_load"):  # torch 2.11 probes otherwise: nothing to wrap, nothing added
        monkeypatch.setenv("PIPER_FAST_LOAD", "on")
        warmup._remember_probes()
        assert not hasattr(VecISA, "_probe_load")
        return
    original = VecISA._probe_load
    monkeypatch.setattr(VecISA, "_probe_load", getattr(original, "__wrapped__", original))  # as torch has it
    base = VecISA._probe_load
    monkeypatch.setenv("PIPER_FAST_LOAD", "off")
    warmup._remember_probes()
    assert VecISA._probe_load is base
    monkeypatch.setenv("PIPER_FAST_LOAD", "on")
    warmup._remember_probes()
    installed = VecISA._probe_load
    assert installed.piper_wrapper is warmup.remembered and installed.__wrapped__ is base
    warmup._remember_probes()
    assert VecISA._probe_load is installed  # installed once


def test_the_precompiled_header_is_named_once_per_key(monkeypatch, tmp_path):
    """Inductor names its precompiled header by preprocessing it in a ``g++ -E`` child (~0.4 s per process);
    a later process with the same key takes the path written down, while the precompiled header is on disk.
    Another command, or the precompiled header gone, asks Inductor again."""
    from piper_compile.codegen import warmup

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    calls: list[str] = []

    def build(header: str, cmd_line: str, **command: object) -> str:
        calls.append(cmd_line)
        path = tmp_path / f"h{len(calls)}.h"
        path.write_text(f"#include <{header}>\n")
        (tmp_path / f"h{len(calls)}.h.gch").write_bytes(b"pch")
        return str(path)

    class Isa:  # as Inductor's vector ISA objects: a repr naming the object's address
        pass

    header, cmd = "torch/csrc/inductor/cpp_prefix.h", "g++ i -o o -O3"
    first = warmup.remembered_header(build)(header, cmd, min_optimize=False, vec_isa=Isa())
    again = warmup.remembered_header(build)  # a new process: nothing remembered in memory, other objects
    assert again(header, cmd, min_optimize=False, vec_isa=Isa()) == first and len(calls) == 1
    assert again(header, cmd, min_optimize=True, vec_isa=Isa()) != first and len(calls) == 2  # another command
    os.remove(first + ".gch")
    fresh = warmup.remembered_header(build)(header, cmd, min_optimize=False, vec_isa=Isa())
    assert fresh != first and len(calls) == 3  # built again by Inductor, and written down
    assert warmup.remembered_header(build)(header, cmd, min_optimize=False, vec_isa=Isa()) == fresh and len(calls) == 3


@pytest.mark.slow
def test_a_warm_process_does_not_preprocess_the_header(monkeypatch, tmp_path):
    """End to end: after a cold run in this cache directory, a process that has not named the header yet
    (its in-memory caches cleared) loads every piece without running the preprocessor."""
    import torch._inductor.codecache as codecache

    from piper_compile.codegen import warmup

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIPER_FAST_LOAD", "on")
    build = codecache._precompile_header
    build = build.__wrapped__ if getattr(build, "piper_wrapper", None) else build
    monkeypatch.setattr(codecache, "_precompile_header", build)  # as torch has it
    warmup._remember_headers()  # what the first step of a process does (once: this one may have done it)
    assert codecache._precompile_header.piper_wrapper is warmup.remembered_header
    assert codecache._precompile_header.__wrapped__ is build
    build.cache_clear()  # as a new process: no header named, no kernel library loaded
    codecache.CppPythonBindingsCodeCache.cache.clear()
    _run(1)  # cold: compiles, and writes the header's name down
    preprocessed: list[str] = []
    builder = codecache.CppBuilder.build

    def watch(self: object) -> None:
        target = self.get_target_file_path()  # type: ignore[attr-defined]
        if target.endswith(".i"):
            preprocessed.append(target)
        return builder(self)

    build.cache_clear()
    codecache.CppPythonBindingsCodeCache.cache.clear()
    monkeypatch.setattr(codecache, "_precompile_header", warmup.remembered_header(build))  # a new process's
    monkeypatch.setattr(codecache.CppBuilder, "build", watch)
    warm = _run(1)
    assert warm[2].fast_loads >= 2 and warm[2].cache_misses == 0, warm[2]
    assert preprocessed == [], preprocessed
