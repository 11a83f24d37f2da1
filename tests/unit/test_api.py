"""Single-process API behaviour: entry point, call semantics, optimizer access, LR schedulers."""
from __future__ import annotations

import copy
import functools
import subprocess
import sys
import textwrap

import pytest
import torch

import piper_compile as piper
from piper_compile.testing.models import build_model


def _compile(model, **options):
    options.setdefault("codegen", "eager")
    return torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options=options)


@pytest.mark.slow  # 6-26 s: keeps the fast subset under 5 min
def test_entry_point_works_without_importing_piper_first():
    code = textwrap.dedent("""
        import torch
        m = torch.nn.Linear(4, 1)
        step = torch.compile(lambda x: m(x).square().mean(), backend="piper", options={"codegen": "eager"})
        loss = step(torch.randn(8, 4))
        assert loss.ndim == 0 and m.weight.grad is not None
        import sys; assert "piper_compile" in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_call_semantics_grads_backward_noop_and_no_grad():
    model = build_model("mlp")
    ref = copy.deepcopy(model)
    step = _compile(model, directives=[piper.split(2)])
    x, y = model.make_batch(8, torch.Generator().manual_seed(0))
    loss = step(x, y)
    loss.backward()  # accepted, does nothing more
    ref_loss = ref(x, y)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    # a second call accumulates into .grad, as a second loss.backward() would
    step(x, y)
    ref(x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    before = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        eval_loss = step(x, y)
    assert not eval_loss.requires_grad
    torch.testing.assert_close(eval_loss, ref(x, y).detach(), rtol=1e-6, atol=1e-6)
    for p, b in zip(model.parameters(), before):  # forward only: gradients untouched
        assert torch.equal(p.grad, b)


def test_optimizer_accessor_and_lr_scheduler_match_eager():
    model = build_model("mlp")
    ref = copy.deepcopy(model)
    factory = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    step = _compile(model, optimizer=factory)
    opt = piper.optimizer(step)  # before the first call: created from the compile options
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = factory(ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for s in range(3):
        x, y = model.make_batch(8, torch.Generator().manual_seed(s))
        loss = step(x, y)
        sched.step()
        ref_loss = ref(x, y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_sched.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-7)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_optimizer_accessor_without_optimizer_is_a_clear_error():
    model = build_model("mlp")
    step = _compile(model)
    with pytest.raises(piper.PiperError, match="no optimizer"):
        piper.optimizer(step)


def test_explain_lists_program():
    model = build_model("mlp")
    step = _compile(model, directives=[piper.split(2)])
    step(*model.make_batch(4, torch.Generator().manual_seed(0)))
    text = piper.explain(step)
    assert text.startswith("rank 0: F.mb0  F.mb1  B.mb0  B.mb1  UPD")


def test_inductor_failure_falls_back_to_eager_with_a_warning(monkeypatch):
    from piper_compile.codegen.compile import CompiledSegment, forget_compiled

    def broken(self, gm, args, same):
        raise AssertionError("simulated Inductor bug")

    monkeypatch.setattr(CompiledSegment, "_inductor", broken)
    forget_compiled()  # an earlier test may have compiled the same graph in this process
    model = build_model("mlp")
    ref = copy.deepcopy(model)
    step = _compile(model, codegen="inductor", directives=[piper.split(2)])
    x, y = model.make_batch(8, torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="piper: Inductor could not compile segment F.all"):
        loss = step(x, y)
    torch.testing.assert_close(loss.detach(), ref(x, y).detach(), rtol=1e-6, atol=1e-6)
    assert all(c.fallback for c in piper.compiled_steps(step)[0].compiled.values())


@pytest.mark.parametrize("how", ["lowering", "data_dependent"])
def test_an_inductor_fallback_names_the_op_and_the_source_line(monkeypatch, how):
    """Before: only the exception's first line; the op and where it came from in the model were left to guess."""
    from torch._inductor.exc import InductorError, LoweringException
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from piper_compile.codegen.compile import CompiledSegment, forget_compiled

    tanh = torch.ops.aten.tanh.default

    def broken(self, gm, args, same):
        if how == "lowering":  # as Inductor reports a lowering that failed
            raise InductorError(LoweringException(RuntimeError("no lowering"), tanh, [], {}), None)
        raise DataDependentOutputException(tanh)

    monkeypatch.setattr(CompiledSegment, "_inductor", broken)
    forget_compiled()  # an earlier test may have compiled the same graph in this process
    model = build_model("mlp")
    step = _compile(model, codegen="inductor")
    with pytest.warns(UserWarning, match=r"segment F.all .*at aten\.tanh\.default, from .*models\.py:\d+ in forward: "
                                         r"x = torch\.tanh\(layer\(x\)\)"):
        step(*model.make_batch(4, torch.Generator().manual_seed(0)))
    seg = piper.compiled_steps(step)[0].compiled["F.all"]
    assert seg.fallback_op == "aten.tanh.default" and "models.py" in seg.fallback_source
    assert piper.stats(step).fallbacks == len(piper.compiled_steps(step)[0].compiled)


def test_optimizer_uses_the_fused_implementation_unless_the_user_chose_one():
    from piper_compile.runtime.optimizer import build_optimizer

    params = [torch.nn.Parameter(torch.randn(4, 4))]
    assert build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-3), params).defaults["fused"] is True
    chosen = build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-3, foreach=True), params)
    assert chosen.defaults["foreach"] is True and not chosen.defaults["fused"]
    assert not build_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3), params).defaults["fused"]
    assert isinstance(build_optimizer(functools.partial(torch.optim.RMSprop, lr=1e-3), params), torch.optim.RMSprop)
    doubles = [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))]  # fused supports these too
    assert build_optimizer(functools.partial(torch.optim.Adam, lr=1e-3), doubles).defaults["fused"] is True


def test_fused_adamw_training_matches_eager_per_tensor_adamw():
    model = build_model("mlp")
    ref = copy.deepcopy(model)
    step = _compile(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    assert piper.optimizer(step).defaults["fused"] is True
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)  # the default: a loop over tensors
    for s in range(4):
        x, y = model.make_batch(8, torch.Generator().manual_seed(s))
        step(x, y)
        ref_opt.zero_grad()
        ref(x, y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _Small(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.a, self.scale = torch.nn.Linear(8, 4), scale

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.a(x) * self.scale, y)


def test_a_process_compiles_more_models_of_one_class_than_dynamos_limit(tmp_path):
    """A sweep compiling a class's models one after another: Dynamo keeps at most ``recompile_limit`` (8)
    entries per code object and every ``piper.compile`` adds one, so the 9th model raised
    ``FailOnRecompileLimitHit`` (alike models or not). Each model's forward now has a code object of its
    own. Each trains as eager, and a compiled model still deep-copies and saves as before."""
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    n = torch._dynamo.config.recompile_limit + 3
    for i in range(n):
        torch.manual_seed(i)
        model = _Small(1.0 + 0.1 * (i % 2))
        ref = copy.deepcopy(model)
        step = piper.compile(model, directives=[piper.split(2)], codegen="eager",
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        got = [step(x, y).item() for _ in range(2)]
        opt, want = torch.optim.SGD(ref.parameters(), lr=0.1), []
        for _ in range(2):
            opt.zero_grad()
            loss = ref(x, y)
            loss.backward()
            opt.step()
            want.append(loss.item())
        assert got == pytest.approx(want, rel=1e-6), i
    twin = copy.deepcopy(model)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for other in (twin, loaded):
        assert torch.equal(other(x, y), model(x, y))
        assert other.forward.__self__ is other  # bound to itself, not to the model it came from
