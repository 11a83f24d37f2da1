"""Where ``autoplan`` cuts a model into pipeline stages: the model's repeated blocks (its longest
``nn.ModuleList`` of one block class), each block's FLOPs for one forward + backward counted by
``torch.utils.flop_counter.FlopCounterMode``, and contiguous groups of blocks whose costs (the layers
before the blocks counted on the first stage, those after them -- head, loss -- on the last) are as
even as a contiguous split allows. Tags are put on the blocks only while a candidate is captured
(``tagged``) and the model is left as it was found."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from piper_compile.capture.annotate import annotate
from piper_compile.capture.made import Tagged, user_class
from piper_compile.errors import PiperError


@dataclass(frozen=True)
class BlockCosts:
    """The model's block list and the FLOPs of one training step on the example batch."""

    path: str  # the ModuleList's name in the model, e.g. "blocks"
    blocks: tuple[nn.Module, ...]
    flops: tuple[int, ...]  # per block, forward + backward
    before: int  # FLOPs of the layers that run before the blocks (embeddings): the first stage's
    after: int  # FLOPs of the layers after them (final norm, head, loss): the last stage's

    def split(self, stages: int) -> tuple[int, ...]:
        """The stage of each block: contiguous groups, the most expensive stage as cheap as possible."""
        return balanced_split(list(self.flops), stages, self.before, self.after)

    def stage_flops(self, stages: int) -> list[int]:
        out = [0] * stages
        for f, s in zip(self.flops, self.split(stages)):
            out[s] += f
        out[0] += self.before
        out[-1] += self.after
        return out


def find_blocks(model: nn.Module) -> tuple[str, tuple[nn.Module, ...]]:
    """The longest ``nn.ModuleList`` (or ``nn.Sequential``) of modules of one class: the repeated layers
    a pipeline is cut between."""
    best: tuple[str, tuple[nn.Module, ...]] = ("", ())
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > len(best[1]):
            kids = tuple(mod)
            if len({user_class(type(k)) for k in kids}) == 1:
                best = (name, kids)
    if len(best[1]) < 2:
        raise PiperError(f"piper: autoplan: {type(model).__name__} has no list of repeated blocks (an nn.ModuleList "
                         "of 2 or more modules of one class) to cut into pipeline stages; build the layers as an "
                         "nn.ModuleList, or plan pipelines yourself with piper.plan")
    return best


def block_costs(model: nn.Module, example: tuple[Any, ...]) -> BlockCosts:
    """Count each block's FLOPs (forward + backward on ``example``) without touching ``.grad`` (a model of
    fake parameters, as ``python -m piper_compile autoplan`` builds, is run in its fake mode)."""
    path, blocks = find_blocks(model)
    names = [f"{path}.{i}" for i in range(len(blocks))]
    counter = FlopCounterMode(display=False)
    fake = next((p.fake_mode for p in model.parameters() if isinstance(p, FakeTensor)), None)
    if fake is None and any(p.untyped_storage().nbytes() == 0 < p.numel() for p in model.parameters()):
        fake = FakeTensorMode(allow_non_fake_inputs=True)  # a meta model's storage-less stand-ins
    with fake if fake is not None else contextlib.nullcontext(), counter:  # a model of fake parameters
        loss = model(*example)
        params = [p for p in model.parameters() if p.requires_grad]
        if loss.requires_grad:
            torch.autograd.grad(loss, params, allow_unused=True)
    counts = {k.split(".", 1)[1] if "." in k else "": sum(v.values()) for k, v in counter.get_flop_counts().items()}
    total = counter.get_total_flops()
    flops = tuple(int(counts.get(n, 0)) for n in names)
    rest = total - sum(flops)
    before = _before_blocks(model, path, counts)
    return BlockCosts(path, blocks, flops, min(before, rest), max(rest - before, 0))


def _before_blocks(model: nn.Module, path: str, counts: dict[str, int]) -> int:
    """FLOPs of the model's top-level children registered before the block list (embeddings)."""
    top = path.split(".")[0]
    total = 0
    for name, _ in model.named_children():
        if name == top:
            break
        total += int(counts.get(name, 0))
    return total


def balanced_split(costs: list[int], stages: int, before: int = 0, after: int = 0) -> tuple[int, ...]:
    """Contiguous split of ``costs`` into ``stages`` non-empty groups minimising the largest group's cost
    (``before`` added to the first group, ``after`` to the last). Returns each item's group."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise PiperError(f"piper: autoplan: {stages} stages do not fit {n} blocks; use at most {n} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least max cost of splitting the first i items into s groups; cut[s][i]: the last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                group = prefix[i] - prefix[j] + (before if j == 0 else 0) + (after if i == n else 0)
                value = max(best[s - 1][j], group)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    out = [0] * n
    i = n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        for k in range(j, i):
            out[k] = s - 1
        i = j
    return tuple(out)


@contextlib.contextmanager
def tagged(tags: list[tuple[nn.Module, dict[str, int]]]) -> Iterator[None]:
    """Annotate each module with its tags for the duration (capture reads them); afterwards every
    module has its own class and tags back."""
    saved = [(m, m.__class__, dict(m._piper_tags) if isinstance(m, Tagged) else None) for m, _ in tags]
    try:
        for m, t in tags:
            annotate(m, **t)
        yield
    finally:
        for m, cls, old in saved:
            m.__class__ = cls
            if old is None:
                m.__dict__.pop("_piper_tags", None)
            else:
                m._piper_tags = old
