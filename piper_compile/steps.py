"""From the step a user holds (the module ``torch.compile(model, backend="piper")`` returns, or
``piper.compile``'s) to what piper keeps for it: the model, its training state (``runtime/registry.py``)
and the compiled variants (``compiled_step.CompiledStep``: training and forward-only). The user-facing helpers
(``api``, ``checkpoint``, ``memory``, ``metrics``) all find a step's objects here."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from piper_compile.errors import PiperError
from piper_compile.options import Options
from piper_compile.runtime.registry import state_of_module

if TYPE_CHECKING:
    from piper_compile.compiled_step import CompiledStep


def module_of(step: Any) -> nn.Module:
    """The model ``step`` compiles (torch.compile's wrapper unwrapped); a clear error for anything else."""
    mod = getattr(step, "_orig_mod", step)
    if not isinstance(mod, nn.Module):
        raise PiperError(f"piper: expected the module returned by torch.compile(model, backend='piper'), got "
                         f"{type(step).__name__}")
    return mod


def _find_options(obj: Any, depth: int = 0, seen: set[int] | None = None) -> dict[str, Any] | None:
    """The ``options`` dict given to torch.compile, found in Dynamo's wrapper chain (version-robust BFS)."""
    seen = seen if seen is not None else set()
    if obj is None or id(obj) in seen or depth > 8:
        return None
    seen.add(id(obj))
    kwargs = getattr(obj, "kwargs", None)
    if isinstance(kwargs, dict) and isinstance(kwargs.get("options"), dict):
        return kwargs["options"]
    for name in ("dynamo_ctx", "callback", "_torchdynamo_orig_backend", "_torchdynamo_orig_callable",
                 "compiler_fn", "_inner_convert", "backend_fn"):
        found = _find_options(getattr(obj, name, None), depth + 1, seen)
        if found is not None:
            return found
    return None


def training_state(step: Any, create: bool) -> Any:
    """The training state of the module ``step`` compiles (``runtime/registry.py``); made before the first
    call when ``create`` (its optimizer factory read from the options given to torch.compile)."""
    module = module_of(step)
    st = state_of_module(module)
    if st is not None or not create:
        return st
    linked = getattr(step, "_piper_link", None)  # piper.compile keeps the options; torch.compile hides them
    if linked is None:
        _refuse_meta(module)
    raw = linked.options if linked is not None else _find_options(step)
    return state_of_module(module, Options.parse(raw).optimizer if raw is not None else None, create=True)


def _refuse_meta(module: nn.Module) -> None:
    """A model built on the meta device compiled by plain ``torch.compile``: its first call would fail inside
    Dynamo (which traces it before any backend sees it) with a device error; say so, and what works."""
    from piper_compile.init.record import meta_tensors

    name = next((n for n, _ in meta_tensors(module)), None)
    if name is not None:
        raise PiperError(
            f"piper: {type(module).__name__} has tensors on the meta device (e.g. {name}); "
            "torch.compile(model, backend='piper') cannot run it: Dynamo traces the model before piper sees it "
            "and fails on the meta/real device mix. Compile it with piper.compile(model, directives=..., "
            "optimizer=...), which gives each rank storage for its own pieces only")


def compiled_steps(step: Any) -> list[CompiledStep]:
    """The compiled programs of ``step`` (train and forward-only variants), after its first call."""
    st = training_state(step, create=False)
    if st is None:
        raise PiperError("piper: this step has not run yet; call it once first")
    return list(st.steps)


def trained_step(step: Any) -> CompiledStep:
    """The training variant of ``step`` that trained last (after a recompile, the new one: what
    ``piper.stats``, ``memory_report`` and ``trained_parameters`` describe is what runs now)."""
    trained = [cs for cs in compiled_steps(step) if False in cs.plans]
    if not trained:
        raise PiperError("piper: the step has not trained yet")
    return max(trained, key=lambda cs: cs.last_trained)
