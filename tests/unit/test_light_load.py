"""A warm run loads compiled pieces without importing Inductor's compiler (``codegen/light_load.py``):
wrapper modules read ``extern_kernels`` and ``align`` from where they are cheap (the very same objects),
and the cache hit's read of ``GraphLowering.save_output_code`` finds a stand-in only where the real
module was never imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from piper_compile.codegen import light_load


def test_the_torch_kernels_are_inductors_own_objects():
    from torch._inductor.select_algorithm import extern_kernels as inductors

    registered = [name for name in light_load.TORCH_KERNELS if hasattr(inductors, name)]
    assert {"mm", "addmm", "bmm", "baddbmm"} <= set(registered)
    for name in registered:
        assert getattr(light_load.extern_kernels, name) is getattr(inductors, name), name


def test_other_kernels_come_from_inductors_namespace():
    from torch._inductor.select_algorithm import extern_kernels as inductors

    others = [name for name in vars(inductors) if name not in light_load.TORCH_KERNELS]
    assert others  # e.g. Inductor's own bias_addmm
    for name in others:
        assert getattr(light_load.extern_kernels, name) is getattr(inductors, name), name
    with pytest.raises(AttributeError):
        light_load.extern_kernels.no_such_kernel  # noqa: B018 - the lookup is the test


def test_the_rewritten_imports_name_the_same_objects():
    import torch._inductor.codegen.memory_planning as memory_planning
    import torch._inductor.utils as inductor_utils

    assert memory_planning._align is inductor_utils._align
    source = "\n".join(["import torch", *light_load._HEAVY_IMPORTS, "x = 1", "y = 2"])
    light = light_load.light_source(source)
    assert "select_algorithm" not in light and "memory_planning" not in light
    assert light.splitlines()[0] == "import torch" and light.endswith("x = 1\ny = 2")
    scope: dict = {}
    exec(compile(light, "<light>", "exec"), scope)
    assert scope["align"] is memory_planning._align and scope["extern_kernels"] is light_load.extern_kernels
    assert "select_algorithm" not in light_load.light_source("z = 3\n" + source)  # anywhere among the first lines


def test_a_module_loads_through_the_light_reader(tmp_path):
    path = tmp_path / "wrapper.py"
    path.write_text("\n".join([*light_load._HEAVY_IMPORTS, "def call(a, b):", "    return extern_kernels.mm(a, b)"]))
    calls: list[str] = []

    def inductors(key: str, p: str, set_sys_modules: bool = True):  # only for what the light reader cannot read
        calls.append(p)
        raise SyntaxError(f"Inductor's reader reports {p}")

    load = light_load.light_reload(inductors)
    mod = load("ckey", str(path), set_sys_modules=False)
    a = torch.randn(3, 4)
    assert torch.equal(mod.call(a, a.T), a @ a.T)
    assert mod.key == "ckey" and mod.__file__ == str(path) and calls == []
    assert mod.__name__ not in sys.modules
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    with pytest.raises(SyntaxError, match="Inductor's reader"):  # a module it cannot compile goes to Inductor's reader, which reports it
        load("bkey", str(broken))
    assert calls == [str(broken)]


def test_the_stand_in_lives_only_while_loading(monkeypatch):
    import torch._inductor.graph as real

    with light_load.no_compiler_import():  # imported already: nothing changes
        assert sys.modules["torch._inductor.graph"] is real
    monkeypatch.delitem(sys.modules, "torch._inductor.graph")
    with light_load.no_compiler_import():
        from torch._inductor.graph import GraphLowering

        assert GraphLowering.save_output_code is None and GraphLowering is not real.GraphLowering
    assert "torch._inductor.graph" not in sys.modules
    with pytest.raises(RuntimeError), light_load.no_compiler_import():
        raise RuntimeError("a failed load")
    assert "torch._inductor.graph" not in sys.modules


_FLAGS = textwrap.dedent("""
    import json, sys
    import torch._inductor as inductor
    from piper_compile.codegen import light_load
    assert "torch._inductor.debug" not in sys.modules
    light_load._debug_flags()
    stand_in = inductor.debug
    out = {"reads": {k: getattr(stand_in, k) for k in light_load.DEBUG_FLAGS}, "imported": "torch._inductor.debug" in sys.modules}
    from torch._inductor import debug as held  # a holder of the stand-in sees the real module's values later
    import torch._inductor.debug as real
    out["defaults"] = {k: getattr(real, k) for k in light_load.DEBUG_FLAGS}
    out["replaced"] = inductor.debug is real and held is stand_in
    real.RECORD_GRAPH_EXECUTION = True
    held.GRAPH_EXECUTION_ORDER = []
    out["through"] = [held.RECORD_GRAPH_EXECUTION, real.GRAPH_EXECUTION_ORDER, held.DebugContext is real.DebugContext]
    print(json.dumps(out))
""")


@pytest.mark.slow  # a child process; keeps the fast subset under 5 min
def test_the_debug_flags_stand_in_reads_as_the_real_module_until_it_is_imported():
    out = subprocess.run([sys.executable, "-c", _FLAGS], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["reads"] == got["defaults"] == {"RECORD_GRAPH_EXECUTION": False, "GRAPH_EXECUTION_ORDER": None,
                                                "GRAPH_COMPILE_IDS": None}
    assert not got["imported"] and got["replaced"]
    assert got["through"] == [True, [], True]


_RUN = textwrap.dedent("""
    import functools, json, sys
    import torch
    import piper_compile as piper
    from piper_compile.testing.models import build_model
    model = build_model("gpt", 0, layers=2)
    step = piper.compile(model, directives=[piper.split(2)], optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    losses = [step(*model.make_batch(4, torch.Generator().manual_seed(s))).item() for s in range(2)]
    stats = piper.stats(step)
    heavy = [m for m in ("torch._inductor.graph", "torch._inductor.select_algorithm", "torch._inductor.lowering",
                         "torch._inductor.debug", "torch._inductor.scheduler")
             if m in sys.modules]
    params = [p.detach().double().sum().item() for p in model.parameters()]
    print(json.dumps({"losses": losses, "params": params, "heavy": heavy, "fast": stats.fast_loads,
                      "misses": stats.cache_misses, "hits": stats.cache_hits}))
""")


def _process(cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PIPER_FAST_LOAD": "on", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_warm_process_never_imports_inductors_compiler(tmp_path):
    cold = _process(str(tmp_path))
    assert cold["misses"] >= 2 and "torch._inductor.lowering" in cold["heavy"]
    warm = _process(str(tmp_path))
    assert warm["fast"] == cold["misses"] and warm["misses"] == 0, warm
    assert warm["heavy"] == [], warm["heavy"]
    assert (warm["losses"], warm["params"]) == (cold["losses"], cold["params"])  # bitwise: the same code ran


def test_a_wrapper_is_installed_once_and_only_where_torch_has_the_function():
    from types import SimpleNamespace

    from piper_compile.codegen.hooks import wrap_once

    def base(x: int) -> int:
        return x + 1

    def twice(f):
        return lambda x: 2 * f(x)

    owner = SimpleNamespace(f=base)
    wrap_once(owner, "f", twice)
    installed = owner.f
    assert installed(1) == 4 and installed.__wrapped__ is base and installed.piper_wrapper is twice
    wrap_once(owner, "f", twice)
    assert owner.f is installed  # once
    wrap_once(owner, "missing", twice)
    assert not hasattr(owner, "missing")  # another torch: left as it is
    wrap_once("no_such_module_here", "f", twice)  # no module: nothing
