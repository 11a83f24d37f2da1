"""Numerics oracle: train a strategy on local gloo processes and compare with an eager
single-process run on the same global batch (losses every step, parameters at the end)."""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from piper_compile.precision import Precision
from piper_compile.testing.models import build_model


@dataclass
class RunConfig:
    model: str = "mlp"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    stages: int = 1  # annotate the model with PP=0..stages-1 when > 1
    directives: list[Any] = field(default_factory=list)
    steps: int = 3
    local_batch: int = 8
    optimizer: tuple[str, dict[str, Any]] | None = ("SGD", {"lr": 0.05, "momentum": 0.9})
    user_optimizer: bool = False  # no piper optimizer: the test steps its own on param.grad
    param_groups: bool = False  # two optimizer groups, as LLM recipes make them (``two_groups``)
    codegen: str = "eager"
    seed: int = 0
    no_grad_eval: bool = False  # also run one forward-only call under torch.no_grad() after training
    device: str = "cpu"  # "cuda": rank r trains on GPU r over NCCL
    shared_gpu: bool = False  # with device "cuda": every rank on GPU 0, over gloo (runtime/comm.py stages)
    scheduler: tuple[str, dict[str, Any]] | None = None  # torch.optim.lr_scheduler class name and kwargs
    clip_grad_norm: float | None = None
    tp: int = 1  # tensor-parallel group size: consecutive ranks of a group share one replica's batch
    batches: tuple[int, ...] | None = None  # per-replica local batch sizes (uneven); default local_batch each
    mixed_precision: Any = None  # options["mixed_precision"]; the reference computes in the same dtypes
    loss_scaling: Any = None  # options["loss_scaling"] (fp16); the reference steps a torch.amp.GradScaler
    poison: tuple[int, int] | None = None  # (step, row): that global batch row's first input is inf
    meta: bool = False  # build on the meta device: ranks init their pieces (options["init"]); the reference
    # is piper.materialize of the same meta model
    ignored_labels: bool = False  # padded language-model labels: each row keeps a different number of its
    # leading labels, the rest are -100 (the loss is a mean over the labels kept: capture/items.py); at
    # step 1 the global batch's rows 2 and 3 keep none (a micro-batch of 2 rows without items)

    def backend(self) -> str:
        """The process group backend of a run: NCCL for one GPU per rank, else gloo."""
        return "nccl" if self.device == "cuda" and not self.shared_gpu else "gloo"

    def pieces(self, world: int) -> int:
        """How many micro-batches the global batch is cut into (replicas x the ``split`` count)."""
        m = next((d["num_microbatches"] for d in self.directives if isinstance(d, dict) and d.get("op") == "split"), 1)
        return self.dp_degree(world) * m

    def precision(self) -> Precision:
        return Precision.parse(self.mixed_precision, self.optimizer is not None, self.loss_scaling)

    def replica_of(self, rank: int, world: int) -> int:
        for d in self.directives:
            if isinstance(d, dict) and d.get("op") == "place" and rank in d["devices"]:
                return d["devices"].index(rank) // self.tp
        return rank // self.tp

    def dp_degree(self, world: int) -> int:
        return len({self.replica_of(r, world) for r in range(world)})

    def replica_batches(self, world: int) -> list[int]:
        """Local batch size of each data-parallel replica."""
        return list(self.batches) if self.batches is not None else [self.local_batch] * self.dp_degree(world)

    def local_slice(self, rank: int, world: int) -> slice:
        """This rank's rows of the global batch (its replica's)."""
        sizes, rep = self.replica_batches(world), self.replica_of(rank, world)
        return slice(sum(sizes[:rep]), sum(sizes[:rep + 1]))

    def make_scheduler(self, opt: torch.optim.Optimizer) -> Any:
        if self.scheduler is None:
            return None
        name, kw = self.scheduler
        return getattr(torch.optim.lr_scheduler, name)(opt, **kw)

    def make_optimizer(self) -> Any:
        if self.optimizer is None:
            return None
        name, kw = self.optimizer
        if self.param_groups:
            return functools.partial(two_groups, getattr(torch.optim, name), kw)
        return functools.partial(getattr(torch.optim, name), **kw)


def two_groups(cls: type, kw: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    """``cls`` over two parameter groups, as LLM recipes make them: matrices with ``kw``; biases, norms
    and other vectors without weight decay and at half the learning rate."""
    params = list(params)
    vectors = {"lr": kw.get("lr", 1e-3) / 2, **({"weight_decay": 0.0} if "weight_decay" in kw else {})}
    return cls([{"params": [p for p in params if p.dim() >= 2]},
                {"params": [p for p in params if p.dim() < 2], **vectors}], **kw)


def _device(cfg: RunConfig) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def _model(cfg: RunConfig) -> nn.Module:
    if cfg.meta:  # the single-device reference of a meta model: the values piper's ranks init
        from piper_compile.init.replay import materialize

        return materialize(_meta_model(cfg), _device(cfg), seed=cfg.seed)
    return build_model(cfg.model, cfg.seed, **cfg.model_kwargs).to(_device(cfg))


def _meta_model(cfg: RunConfig) -> nn.Module:
    with torch.device("meta"):
        return build_model(cfg.model, cfg.seed, **cfg.model_kwargs)


def _global_batch(model: nn.Module, cfg: RunConfig, step: int, n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + cfg.seed * 100 + step)
    batch = tuple(t.to(_device(cfg)) for t in model.make_batch(n, gen))  # type: ignore[operator]
    if cfg.poison is not None and cfg.poison[0] == step:  # an overflow in one replica's rows
        batch[0][cfg.poison[1]] = float("inf")
    if cfg.ignored_labels:
        labels = batch[-1].clone()
        seq = labels.shape[1]
        for r in range(n):
            keep = 0 if step == 1 and r in (2, 3) else 1 + (5 * r + 3 * step) % seq
            labels[r, keep:] = -100
        batch = (*batch[:-1], labels)
    return batch


def build_step(cfg: RunConfig) -> tuple[nn.Module, Any]:
    """This rank's model and its piper step, compiled with the run's options."""
    import piper_compile as piper

    model = _meta_model(cfg) if cfg.meta else _model(cfg)
    if cfg.stages > 1:
        model.annotate_stages(cfg.stages)  # type: ignore[operator]
    piper_opt = None if cfg.user_optimizer else cfg.make_optimizer()
    options = {"directives": cfg.directives, "optimizer": piper_opt, "codegen": cfg.codegen}
    if cfg.clip_grad_norm is not None:
        options["clip_grad_norm"] = cfg.clip_grad_norm
    if cfg.mixed_precision is not None:
        options["mixed_precision"] = cfg.mixed_precision
    if cfg.loss_scaling is not None:
        options["loss_scaling"] = cfg.loss_scaling
    if cfg.meta:
        options["init_seed"] = cfg.seed
    if cfg.mixed_precision is None and not cfg.meta:
        step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True, options=options)
    else:  # mixed precision re-traces the model, a meta one gets stand-ins: piper.compile links the step to it
        step = piper.compile(model, **options)
    return model, step


def piper_worker(rank: int, world: int, cfg: RunConfig) -> dict[str, Any]:
    """One rank of a piper run; returns losses, the parameters it owns (by position) and counters."""
    import piper_compile as piper

    model, step = build_step(cfg)
    user_opt = cfg.make_optimizer()(model.parameters()) if cfg.user_optimizer else None
    sched = cfg.make_scheduler(piper.optimizer(step)) if cfg.scheduler else None
    total, rows = sum(cfg.replica_batches(world)), cfg.local_slice(rank, world)
    losses, scales = [], []
    for s in range(cfg.steps):
        batch = _global_batch(model, cfg, s, total)
        local = tuple(t[rows] for t in batch)
        loss = step(*local)
        loss.backward()  # accepted and does nothing more
        losses.append(loss.item())
        scaler = piper.loss_scaler(step)
        if scaler is not None:
            scales.append(scaler.scale)
        if user_opt is not None:
            user_opt.step()
            user_opt.zero_grad()
        if sched is not None:
            sched.step()
    eval_loss = None
    if cfg.no_grad_eval:
        batch = _global_batch(model, cfg, cfg.steps, total)
        local = tuple(t[rows] for t in batch)
        with torch.no_grad():
            eval_loss = step(*local).item()
    cs = piper.compiled_steps(step)[0]
    program = cs.plans[False].programs[rank]
    values = piper.trained_parameters(step)  # ZeRO shards gathered
    by_id = {id(p): f for f, p in cs.joint.params.items()}
    params = list(model.parameters())
    owned = {k: values[by_id[id(p)]].cpu() for k, p in enumerate(params) if by_id.get(id(p)) in values}
    stats = piper.last_stats(step)
    return {"losses": losses, "scales": scales, "params": owned, "eval_loss": eval_loss, "program": program.to_text(),
            "collectives": dict(stats.collectives), "p2p": stats.p2p, "stats": stats, "metrics": piper.stats(step),
            "memory": piper.memory_report(step) if not cfg.user_optimizer else None,
            "fallbacks": sorted(n for n, c in cs.compiled.items() if c.fallback), "tp_partial": sorted(cs.tp_partial)}


class ComputeCopy:
    """Eager mixed precision as piper defines it (``precision.py``), written once for every test: the
    model holds the fp32 master weights the optimizer steps; each step a copy of its floating parameters
    in ``param_dtype`` computes the loss (inputs cast too) and its gradients come back into the master
    parameters' ``.grad`` in fp32. ``chunks``: the global batch is cut as piper cuts it (one piece per
    replica and micro-batch, ``RunConfig.pieces``), each piece's backward seeded with its share of the
    mean in the compute dtype and its gradients summed in fp32 per replica, the ``replicas`` sums then
    added in ``reduce_dtype``, so that bf16 rounding happens where it happens in piper. Without a policy: the model itself, plain ``loss.backward()``.
    ``untie``: each use of a shared parameter gets its own gradient in the copy, summed into the master's
    in fp32 per replica (first use first) -- piper's tied weight across stages, whose parts each stage
    accumulates itself (``capture/grad_parts.py``)."""

    def __init__(self, model: nn.Module, precision: Precision, chunks: int = 1, replicas: int = 1,
                 untie: bool = False, items: bool = False) -> None:
        self.master, self.precision, self.chunks, self.replicas = model, precision, chunks, replicas
        self.items = items  # the loss is a mean over the labels not -100: pieces weigh their labels kept
        self.copy = copy.deepcopy(model) if precision.active else model
        if precision.active:
            if untie:
                _untie(self.copy)
            for p in self.copy.parameters():
                p.data = p.data.to(precision.compute(p))
        index = {id(p): i for i, p in enumerate(model.parameters())}
        of_name = {n: index[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        self.index = [of_name[n] for n, _ in self.copy.named_parameters()]  # master of each copy parameter

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        masters = list(self.master.parameters())
        return [(c, masters[i]) for c, i in zip(self.copy.parameters(), self.index)]

    def evaluate(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The loss of a forward-only call (under no_grad), computed as a training step computes it."""
        if not self.precision.active:
            return self.master(*batch)
        with torch.no_grad():
            for c, m in self._pairs():
                c.copy_(m)
        loss = self.copy(*(self.precision.cast_input(t) for t in batch))
        return loss.to(self.precision.loss_dtype(loss.dtype))

    def loss_and_grads(self, batch: tuple[torch.Tensor, ...], scale: float = 1.0) -> torch.Tensor:
        """The loss, and gradients (times ``scale``: fp16 loss scaling seeds each backward with it) in
        the master parameters' ``.grad``."""
        if not self.precision.active:
            loss = self.master(*batch)
            loss.backward()
            return loss
        with torch.no_grad():
            for c, m in self._pairs():
                c.copy_(m)
        total = torch.zeros((), dtype=torch.float64, device=batch[0].device)
        n = batch[0].shape[0]
        per_replica: list[list[torch.Tensor | None]] = []
        for k, rows in enumerate(torch.arange(n).chunk(self.chunks)):  # as piper splits: replicas, micro-batches
            if k % (self.chunks // self.replicas) == 0:
                per_replica.append([None] * len(self.index))
            for c in self.copy.parameters():
                c.grad = None
            loss = self.copy(*(self.precision.cast_input(t[rows]) for t in batch))
            weight = len(rows) / n  # the micro-batch's share of the global mean, seeded in the compute dtype
            if self.items:
                kept = batch[-1] != -100
                weight = float(kept[rows].sum()) / float(kept.sum())
            loss.backward(torch.full((), weight * scale, dtype=loss.dtype, device=loss.device))
            if weight:  # a piece without items: its own mean is 0/0 and weighs nothing
                total += weight * loss.detach().double()
            acc = per_replica[-1]
            for j, (c, m) in enumerate(self._pairs()):  # summed in fp32
                if c.grad is not None:
                    acc[j] = c.grad.to(m.dtype) if acc[j] is None else acc[j].add_(c.grad)
        for i, m in enumerate(self.master.parameters()):  # the replicas' sums reduced in reduce_dtype
            parts = [_sum([r[j] for j, k in enumerate(self.index) if k == i]) for r in per_replica]
            parts = [p for p in parts if p is not None]
            if parts:
                red = self.precision.reduce(m.dtype)
                m.grad = functools.reduce(torch.add, [g.to(red) for g in parts]).to(m.dtype)
        return total.to(self.precision.loss_dtype(loss.dtype))


def _sum(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The sum of the gradients given (in order), None if none is."""
    given = [p for p in parts if p is not None]
    return functools.reduce(torch.add, given) if given else None


def _untie(model: nn.Module) -> None:
    """Every further use of a shared parameter becomes a parameter of its own (a copy)."""
    seen: set[int] = set()
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) in seen:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, nn.Parameter(p.detach().clone()))
        seen.add(id(p))


def _ends_apart(cfg: RunConfig) -> bool:
    """Whether the first and the last stage are placed on different ranks (a tied weight's gradient then
    comes in one part per stage)."""
    from piper_compile.directives.spec import filter_matches

    places = [d for d in cfg.directives if isinstance(d, dict) and d.get("op") == "place"]

    def devices(stage: int) -> tuple[int, ...] | None:
        found = None
        for d in places:
            if filter_matches(d["filter"], {"PP": stage}):
                found = tuple(d["devices"])
        return found
    return cfg.stages > 1 and devices(0) != devices(cfg.stages - 1)


def eager_reference(cfg: RunConfig, world: int) -> dict[str, Any]:
    """Single-process eager training on the concatenation of all replicas' batches."""
    model = _model(cfg)
    opt = cfg.make_optimizer()(model.parameters())
    sched = cfg.make_scheduler(opt)
    total = sum(cfg.replica_batches(world))
    losses, norms, scales = [], [], []
    compute = ComputeCopy(model, cfg.precision(), cfg.pieces(world), cfg.dp_degree(world), _ends_apart(cfg),
                          cfg.ignored_labels)
    scaler = _grad_scaler(cfg)
    for s in range(cfg.steps):
        batch = _global_batch(model, cfg, s, total)
        opt.zero_grad()
        loss = compute.loss_and_grads(batch, scaler.get_scale() if scaler is not None else 1.0)
        if scaler is not None:
            scaler.unscale_(opt)
        if cfg.clip_grad_norm is not None:  # the norm before clipping (tests check that clipping happened)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)))
        if scaler is not None:
            scaler.step(opt)  # skipped when a gradient is inf/NaN
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    eval_loss = None
    if cfg.no_grad_eval:
        with torch.no_grad():
            eval_loss = compute.evaluate(_global_batch(model, cfg, cfg.steps, total)).item()
    return {"losses": losses, "params": [p.detach().cpu().clone() for p in model.parameters()],
            "eval_loss": eval_loss, "grad_norms": norms, "scales": scales}


def _grad_scaler(cfg: RunConfig) -> torch.amp.GradScaler | None:
    """fp16 loss scaling on eager: torch's own GradScaler, with the run's settings."""
    sc = cfg.precision().scaling
    if sc is None:
        return None
    scaler = torch.amp.GradScaler(_device(cfg).type, init_scale=sc.init_scale, growth_factor=sc.growth_factor,
                                  backoff_factor=sc.backoff_factor, growth_interval=sc.growth_interval)
    scaler.scale(torch.zeros((), device=_device(cfg)))  # it makes its scale tensor at the first scale()
    return scaler


def assert_parity(results: list[dict[str, Any]], ref: dict[str, Any], rtol: float = 1e-5, atol: float = 1e-6,
                  loss_tol: float = 1e-5) -> None:
    """Every rank's losses match the reference (relative ``loss_tol``); every parameter is owned by some
    rank and matches within ``rtol``/``atol``."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=loss_tol, atol=loss_tol,
                                   msg=lambda m, rank=rank: f"rank {rank} losses differ: {m}")
        if ref["eval_loss"] is not None:
            torch.testing.assert_close(r["eval_loss"], ref["eval_loss"], rtol=loss_tol, atol=loss_tol)
    covered = set()
    for rank, r in enumerate(results):
        for k, p in r["params"].items():
            covered.add(k)
            torch.testing.assert_close(p, ref["params"][k], rtol=rtol, atol=atol,
                                       msg=lambda m, rank=rank, k=k: f"rank {rank} parameter #{k} differs: {m}")
    missing = set(range(len(ref["params"]))) - covered
    assert not missing, f"parameters {sorted(missing)} were updated by no rank"


def run_parity(cfg: RunConfig, world: int, rtol: float = 1e-5, atol: float = 1e-6) -> list[dict[str, Any]]:
    from piper_compile.testing.launch import run_local

    results = run_local(piper_worker, world, cfg, backend=cfg.backend()) if world > 1 else [piper_worker(0, 1, cfg)]
    assert_parity(results, eager_reference(cfg, world), rtol, atol)
    return results


def update_error(params: dict[int, torch.Tensor], ref: list[torch.Tensor], init: list[torch.Tensor]) -> float:
    """Relative L2 distance of the parameter updates (after - before) of ``params`` (by position) from
    those of ``ref``, over the parameters ``params`` holds."""
    num = sum(float(((params[k] - init[k]) - (ref[k] - init[k])).norm() ** 2) for k in params)
    den = sum(float((ref[k] - init[k]).norm() ** 2) for k in params)
    return (num / max(den, 1e-30)) ** 0.5


def run_mixed_parity(cfg: RunConfig, world: int, max_err: float = 2e-5, closer: float = 1e-3,
                     loss_tol: float = 1e-5, within_noise: float | None = None) -> list[dict[str, Any]]:
    """A mixed-precision run against the eager reference computing in the same dtypes (``ComputeCopy``).

    Why these tolerances: the reference rounds to bf16 where piper does (per micro-batch, per replica,
    in the reduction), so the two differ only by fp32 summation order (~1e-7), which a bf16 compute copy
    can round to one bf16 step in a few elements. Against one whole-batch bf16 step or fp32 training
    the distance is 2-10% (bf16 keeps 8 significant bits, and AdamW turns that noise into sign flips on
    near-zero gradients). So: losses agree within ``loss_tol``; parameter updates (after - before,
    relative L2) are within ``max_err`` of the reference's and ``closer`` times nearer to it than to fp32
    training (a run that silently computed in fp32, or reduced in fp32 when asked for bf16, fails);
    master weights stay fp32. Inductor's bf16 kernels keep fused intermediates in fp32 where eager rounds
    them, so its updates lie between the reference's and fp32 training's, nearer one or the other by the
    device's kernels (CPU: 0.046 and 0.080; an H200: 0.078 and 0.078): ``within_noise`` = k then bounds
    them by the dtype's own noise on this model and device, d = the distance between the bf16
    reference's updates and fp32 training's (CPU 0.077): within k * d of the reference, and at least d / 2
    from fp32 training (a run that computed in fp32 is ~1e-6 from it)."""
    from piper_compile.testing.launch import run_local

    results = run_local(piper_worker, world, cfg, backend=cfg.backend()) if world > 1 else [piper_worker(0, 1, cfg)]
    ref = eager_reference(cfg, world)
    ref32 = eager_reference(dataclasses.replace(cfg, mixed_precision=None, loss_scaling=None, poison=None), world)
    init = [p.detach().cpu() for p in _model(cfg).parameters()]
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=loss_tol, atol=0.0,
                                   equal_nan=True, msg=lambda m, rank=rank: f"rank {rank} losses differ: {m}")
        assert r["scales"] == ref["scales"], f"rank {rank}: loss scales {r['scales']} vs GradScaler's {ref['scales']}"
        assert all(p.dtype == init[k].dtype for k, p in r["params"].items()), f"rank {rank}: master weights changed dtype"
        err, err32 = update_error(r["params"], ref["params"], init), update_error(r["params"], ref32["params"], init)
        if within_noise is None:
            assert err <= max_err and err <= closer * err32, (
                f"rank {rank}: parameter updates {err:.4f} from the mixed-precision reference (bound {max_err}) "
                f"and {err32:.4f} from fp32 training (must be at least {1 / closer:.2f}x farther)")
        else:
            _within_noise(rank, err, err32, update_error(dict(enumerate(ref["params"])), ref32["params"], init),
                          within_noise)
        r["update_error"], r["update_error_fp32"] = err, err32
    covered = {k for r in results for k in r["params"]}
    assert covered == set(range(len(init))), f"parameters {sorted(set(range(len(init))) - covered)} were updated by no rank"
    return results


def _within_noise(rank: int, err: float, err32: float, noise: float, k: float) -> None:
    """``run_mixed_parity(within_noise=k)``: updates ``err`` from the reference within ``k`` times the
    dtype's noise (the reference's distance from fp32 training) and ``err32`` from fp32 training at least
    half of it."""
    assert err <= k * noise and err32 >= noise / 2, (
        f"rank {rank}: parameter updates {err:.4f} from the mixed-precision reference and {err32:.4f} from fp32 "
        f"training, where the reference is {noise:.4f} from fp32 training (bounds: at most {k} times that from "
        f"the reference, at least half of it from fp32 training)")
