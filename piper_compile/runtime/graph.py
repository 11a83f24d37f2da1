"""``options["cuda_graph"]``: a rank's whole training step replayed as one CUDA graph.

piper knows the whole step before it runs -- every segment, the optimizer update, the compute copies'
refresh -- so on one GPU it can record all of it once with ``torch.cuda.graph`` and replay it: the host
then issues one launch per step instead of one per kernel. A micro-batched step on a fast GPU is bound
by the host issuing its kernels (the 350M bench GPT on an H200: the device idle 12 of 96 ms, thousands
of launches); a replay is not.

The first ``WARMUP`` training calls run as usual on a side stream (they compile, create the optimizer's
state and the libraries' workspaces, as CUDA graphs need); the next one records the step and replays it
(the recording itself computes nothing); later calls copy their batch into the recorded inputs and
replay. Whatever the recording baked in is checked before each replay and the step recorded again when
it changed: the batch's shapes, the storage and version counters of the parameters and the optimizer
state (a checkpoint load that replaced or wrote them), and the optimizer's hyperparameters (a step with a
new learning rate records again, so a schedule that changes it every step gains nothing). The loss
returned is a copy (the recorded one is overwritten by the next replay). A step that cannot be recorded
(an op that waits for the device, such as data-dependent expert routing) runs as usual, with a warning
naming why.

Only where nothing else can change a replayed step: one rank (a world of one process), a piper optimizer
(one with a ``capturable`` flag takes its capturable path from the recording on), no fp16 loss scaling
(its skip decision is the host's). A replayed step's ``piper.stats`` are the recorded step's accounting.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from piper_compile.errors import PiperError

WARMUP = 2  # training calls run as usual before the step is recorded


def refuse(device: torch.device, world: int, has_optimizer: bool, scaling: bool) -> None:
    """A ``piper:`` error when ``options["cuda_graph"]`` cannot replay this step exactly."""
    why = ("it needs piper's optimizer (options['optimizer']): the update must be part of the recorded step"
           if not has_optimizer else
           "fp16 loss scaling decides on the host whether a step is skipped; use bf16 (no scaling)"
           if scaling else
           f"it records one process's step; this run has {world} ranks (their communication is not recorded)"
           if world > 1 else
           f"it needs the model on a CUDA device; its parameters are on {device.type}"
           if device.type != "cuda" else None)
    if why:
        raise PiperError(f"piper: options['cuda_graph'] replays the whole training step as one CUDA graph, and {why}; "
                         "or leave the option off")


class StepGraph:
    """The recorded training step of one executor (see the module's text). ``batched``: positions of
    the call's arguments that are the batch (copied into the recorded inputs before each replay); the
    other tensors (parameters, buffers) must stay where they were recorded."""

    def __init__(self, executor: Any, batched: frozenset[int]) -> None:
        self.ex, self.batched = executor, batched
        self.calls = 0
        self.stream = torch.cuda.Stream(device=executor.state.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool: Any = None
        self.static: list[Any] = []
        self.loss: torch.Tensor | None = None
        self.updates = 0  # optimizer updates one recorded step makes (State.updates counts them on replay)
        self.key: tuple[Any, ...] | None = None
        self.failed: str | None = None  # why the step could not be recorded: it then runs as usual
        self.recorded = 0  # times the step was recorded (a new batch shape, hyperparameters, storage)

    def run(self, args: list[Any], check: Any) -> torch.Tensor:
        """The step on ``args``: as usual, recorded, or replayed."""
        if self.failed is not None:
            return self.ex.run(args, check)
        self.calls += 1
        if self.calls <= WARMUP:
            return self._on_side_stream(args, check)
        if self.graph is None or self._key(args, check) != self.key:
            return self._record(args, check)
        for i in self.batched:
            self.static[i].copy_(args[i])
        self.graph.replay()
        self.ex.state.updates += self.updates
        assert self.loss is not None
        return self.loss.clone()

    def _on_side_stream(self, args: list[Any], check: Any) -> torch.Tensor:
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            loss = self.ex.run(args, check)
        main.wait_stream(self.stream)
        return loss

    def _key(self, args: list[Any], check: Any) -> tuple[Any, ...]:
        """What a recording bakes in: the batch's layout, the other tensors' storage and version, the
        optimizer's hyperparameters and its state's storage and version, the loss seeds (a loss that is a
        mean over items seeds each micro-batch by its items: ``capture/items.py``). A replay bumps no version (only
        an op called from Python does), so a changed version is a write from outside the recorded step --
        a checkpoint load into the parameters -- after which the compute copies the recording reads would
        be stale: the step is recorded again (its first read of each copy then refreshes it)."""
        opt = self.ex.state.get_optimizer()
        batch = tuple((tuple(args[i].shape), tuple(args[i].stride()), args[i].dtype) for i in sorted(self.batched))
        fixed = tuple((a.data_ptr(), a._version) for i, a in enumerate(args)
                      if i not in self.batched and isinstance(a, torch.Tensor))
        hyper = tuple(tuple(sorted((k, v.data_ptr() if isinstance(v, torch.Tensor) else repr(v))
                                   for k, v in g.items() if k != "params")) for g in opt.param_groups)
        state = tuple((t.data_ptr(), t._version) for s in opt.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
        weights = check.resolve()
        return batch, fixed, hyper, state, (weights.seed, weights.seeds)

    def _record(self, args: list[Any], check: Any) -> torch.Tensor:
        """Record the step on copies of the batch, then replay it once (the recording computes nothing)."""
        _capturable(self.ex.state.get_optimizer())
        self.static = [a.clone() if i in self.batched else a for i, a in enumerate(args)]
        torch.cuda.synchronize(self.stream.device)
        graph, before = torch.cuda.CUDAGraph(), self.ex.state.updates
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                loss = self.ex.run(list(self.static), check)
        except Exception as e:  # noqa: BLE001 - the step still runs, as usual
            self.ex.state.updates = before
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            self.graph = self.loss = None
            self.static = []
            warnings.warn(f"piper: options['cuda_graph']: the step could not be recorded as a CUDA graph "
                          f"({self.failed}); it runs as usual from now on", stacklevel=4)
            torch.cuda.synchronize(self.stream.device)
            return self.ex.run(args, check)
        self.updates = self.ex.state.updates - before  # counted by the recording: the replay below makes them
        # the key after the recording: its in-place ops bumped the versions (replays will not)
        self.graph, self.loss, self.key, self.pool = graph, loss, self._key(args, check), graph.pool()
        self.recorded += 1
        graph.replay()
        return loss.clone()


def _capturable(opt: Any) -> None:
    """Make ``opt``'s update recordable. torch checks ``capturable`` while recording, where an optimizer
    has the flag: a fused one keeps its step counts on the device already, any other gets them moved
    there (what building it with ``capturable=True`` does) and takes its capturable path from now on.
    An optimizer without the flag (SGD) has no host state to bake in."""
    for g in opt.param_groups:
        if "capturable" not in g or g["capturable"]:
            continue
        if not g.get("fused"):
            for p in g["params"]:
                st = opt.state.get(p, {})
                if isinstance(st.get("step"), torch.Tensor) and st["step"].device != p.device:
                    st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
                elif "step" in st and not isinstance(st["step"], torch.Tensor):
                    raise PiperError(f"piper: options['cuda_graph'] records the optimizer's update, and "
                                     f"{type(opt).__name__} counts its steps on the host; build it with "
                                     f"capturable=True or fused=True")
        g["capturable"] = True
