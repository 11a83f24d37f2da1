"""Every rank runs the same step: a cheap agreement check at the start of each collective call.

A compiled step call is collective over the world: every rank must call the same program (training or
forward-only) of the same model, the same number of times, in the same order. If one rank skips a call
or makes another one (rank 0 alone evaluating under ``torch.no_grad()``), the collectives of the two
programs pair up with each other and every later number is wrong. So each call posts one row per rank
-- (model, program fingerprint, call index, local batch, argument count, forward-only, batch contents) -- and one
all-reduce of the whole table (every rank writes only its own row, so the sum is an all-gather) on a
gloo group of its own (host tensors, also under NCCL). The table comes back before the call's first
communication, first wait and first loss seed, so a mismatch raises on every rank, naming what each
rank called, before any traffic of the two programs is paired.

The same table carries the local batch sizes, which makes uneven batches exact: each replica's losses
and gradients are weighted by its share of the global batch (``Weights``), so the step's loss and
gradients are those of the mean over the concatenated global batch, as in single-process training.

The ranks of one replica (pipeline stages, a tensor-parallel group) must pass the same batch: stage 0 reads
the tokens and the last stage the labels, so different batches of equal size (a ``DistributedSampler`` over
the whole world) would pair one rank's inputs with another's labels -- a plausible, wrong loss. Where a
replica spans several ranks, each row carries a fingerprint of the batch's contents (``batch_fingerprint``)
and ranks of one replica that disagree raise on every rank.

``piper.local()`` marks calls that run on this rank alone (forward-only programs whose only traffic is
the loss all-reduce: pure data parallelism without ZeRO-3): no check, no communication, the loss of the
local batch.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from piper_compile.errors import PiperRuntimeError

_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("piper_local", default=False)


@contextlib.contextmanager
def local() -> Iterator[None]:
    """Calls of a piper step inside this block run on this rank alone, forward-only: no communication and
    no call check, returning the mean loss of this rank's batch (e.g. evaluation on rank 0 only). Only
    for programs whose forward needs no communication besides the loss all-reduce (pure data parallel,
    ZeRO 0-2); wrap the call in ``torch.no_grad()``."""
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)


def local_calls() -> bool:
    """Whether the current call is inside ``piper.local()``."""
    return _LOCAL.get()


def fingerprint(text: str) -> int:
    """A 63-bit id of a plan's text (equal on every rank that planned the same strategy)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


NO_ITEMS, ALL_ITEMS, SOME_ITEMS = 0, 1, 2  # the loss is a sample mean / an item mean, every label kept / not


@dataclass(frozen=True)
class CallRecord:
    """What one rank is calling."""

    model: int  # the model's creation index in this process
    program: int  # fingerprint of the plan
    call: int  # collective calls of this model so far
    batch: int  # this rank's local batch (leading size of its batched inputs)
    nargs: int  # tensors and ints the compiled step was called with
    forward_only: bool
    data: int = 0  # fingerprint of the inputs' contents (0: not compared; see ``batch_fingerprint``)
    items: float = 0.0  # the loss's total item weight in this rank's batch (``capture/items.py``)
    item_mode: int = NO_ITEMS

    def row(self) -> list[int]:
        bits = int(torch.tensor([self.items], dtype=torch.float64).view(torch.int64)[0])
        return [self.model, self.program, self.call, self.batch, self.nargs, int(self.forward_only), self.data,
                bits, self.item_mode]

    @classmethod
    def from_row(cls, row: list[int]) -> "CallRecord":
        items = float(torch.tensor([row[7]], dtype=torch.int64).view(torch.float64)[0])
        return cls(row[0], row[1], row[2], row[3], row[4], bool(row[5]), row[6], items, row[8])

    def same_call(self, other: "CallRecord") -> bool:
        """The same program of the same model at the same call (the argument count may differ: Dynamo can
        pass a different number of size symbols for other batch sizes; a different graph is a different plan)."""
        return (self.model, self.program, self.call, self.forward_only) == \
            (other.model, other.program, other.call, other.forward_only)

    def describe(self) -> str:
        kind = "a forward-only (torch.no_grad) step" if self.forward_only else "a training step"
        return (f"{kind} of model #{self.model}, its call #{self.call} (plan {self.program:016x}, local batch "
                f"{self.batch}, {self.nargs} arguments)")


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SAMPLES = 1024  # elements of each input weighted by position (catches rows in another order)


def _sums(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of a tensor's bits: of every element, and of up to ``_SAMPLES`` elements spread over
    it, each weighted by its position. Equal contents give equal sums on any device."""
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif flat.is_floating_point():
        flat = flat.view(_INT_OF_SIZE[flat.element_size()])
    flat = flat.to(torch.int64)
    stride = max(1, flat.numel() // _SAMPLES)
    sample = flat[::stride][:_SAMPLES]
    weights = torch.arange(1, sample.numel() + 1, dtype=torch.int64, device=flat.device)
    return torch.stack([flat.sum(), (sample * weights).sum()])


def batch_fingerprint(tensors: list[torch.Tensor]) -> int:
    """A nonzero 63-bit fingerprint of the inputs' shapes, dtypes and contents (one host sync). Two
    ranks given different samples of equal shape differ here."""
    parts = [repr([(tuple(t.shape), str(t.dtype)) for t in tensors])]
    live = [_sums(t) for t in tensors if t.numel()]
    if live:
        parts.append(repr(torch.stack([x.cpu() for x in live]).tolist()))
    return fingerprint("|".join(parts)) or 1


def shares_batches(layout: "CallLayout") -> bool:
    """Whether some replica spans several ranks (whose batches must then be equal)."""
    return len(set(layout.replica)) < len(layout.replica)


@dataclass(frozen=True)
class CallLayout:
    """What the check needs to know about a plan: micro-batches, who holds the loss, tensor-parallel
    width, and which ranks see the same batch (the stages and tensor-parallel ranks of one replica)."""

    microbatches: int
    holders: tuple[int, ...]  # ranks whose segments compute the loss
    tp: int  # ranks of one replica among the holders (tensor parallelism)
    replica: tuple[int, ...]  # replica id per rank


@dataclass(frozen=True)
class Weights:
    """How this rank's micro-batch losses count in the step's loss: each is seeded with ``seed`` in the
    backward, and their sum divided by ``loss_divisor`` is this rank's share of the loss all-reduce."""

    seed: float
    loss_divisor: float
    seeds: tuple[float, ...] = ()  # per micro-batch, for a loss that is a mean over items (``items_weights``)
    tp: int = 1

    def seed_of(self, mb: int | None) -> float:
        """The backward seed of micro-batch ``mb``'s loss."""
        return self.seeds[mb or 0] if self.seeds else self.seed

    def loss_weight(self, mb: int | None) -> float | None:
        """What micro-batch ``mb``'s loss is multiplied by as it is added to this rank's share (None: added
        as it is, the sum divided by ``loss_divisor``). A micro-batch without items weighs 0 and is left
        out: its own mean is 0/0."""
        return self.seeds[mb or 0] / self.tp if self.seeds else None


def items_weights(layout: CallLayout, items: list[float], counts: tuple[float, ...]) -> Weights:
    """A loss that is a mean over items (``capture/items.py``): micro-batch ``k`` of this rank, holding
    ``counts[k]`` of the global batch's ``C`` items, is seeded with ``counts[k] / C`` (each replica's
    total counted once, though its tensor-parallel ranks all hold the loss; ``counts[k]`` is 1 for an
    empty piece of a hand-written masked mean, which divides by 1: ``capture/items.MicroCounts.seeded``)."""
    total = sum(items[h] for h in layout.holders) / layout.tp
    seeds = tuple(c / total if total else float("nan") for c in counts)
    return Weights(seeds[0] if seeds else 0.0, 1.0, seeds, layout.tp)  # no counts: this rank holds no loss


def _items_apart(rows: list[CallRecord], holders: tuple[int, ...]) -> bool:
    """Whether the loss's items are not proportional to the samples: some rank dropped labels, or the
    holders' samples carry different numbers of them (replicas padded to different sequence lengths)."""
    if any(rows[h].item_mode == SOME_ITEMS for h in holders):
        return True
    held = [rows[h] for h in holders if rows[h].item_mode == ALL_ITEMS and rows[h].batch > 0]
    return any(r.items * held[0].batch != held[0].items * r.batch for r in held[1:])


def weights_for(layout: CallLayout, batches: list[int], rank: int) -> Weights:
    """Sample-count weights: a replica with ``b`` of the global batch's ``B`` samples seeds each of its
    ``M`` micro-batch means with ``b / (M * B)``; equal batches give exactly ``1 / (M * replicas)``."""
    m, holders = layout.microbatches, layout.holders
    sizes = [batches[h] for h in holders]
    if len(set(sizes)) == 1:  # the even case, written as before so results stay bitwise
        return Weights(1.0 / (m * (len(holders) // layout.tp)), float(m * len(holders)))
    total = sum(sizes)
    b = batches[rank]
    return Weights(b * layout.tp / (m * total), m * total / b)


def _check_group(timeout_s: float) -> Any:
    """The world's gloo group for call checks (made once per world, at the first collective call, before
    any other piper group: so every rank makes it first, whatever program it is about to run)."""
    from piper_compile.runtime.groups import check_group  # names a rank that never arrives

    return check_group(timeout_s)


class CallCheck:
    """The check of one call: started at the call, resolved (waited for and validated) at the first
    point that needs it. ``resolve`` returns this rank's ``Weights`` or raises on every rank."""

    def __init__(self, record: CallRecord, layout: CallLayout, rank: int, world: int, timeout_s: float,
                 counts: tuple[float, ...] = (), additive: bool = False) -> None:
        self.record, self.layout, self.rank, self.world = record, layout, rank, world
        self.counts = counts  # this rank's micro-batches' item weights (a loss that is a mean over items)
        self.additive = additive  # the loss is a sum over the batch: its pieces add up unweighted
        self.timeout_s = timeout_s
        self._weights: Weights | None = None
        self.batches: list[int] = []  # every rank's local batch (after resolve)
        self.table = torch.zeros(world, len(record.row()), dtype=torch.int64)
        self.table[rank] = torch.tensor(record.row(), dtype=torch.int64)
        self.started = time.perf_counter()
        self.work = None
        if world > 1 and dist.get_backend() == "fake":  # a planning world of one real process: it agrees
            self.table[:] = self.table[rank]
        elif world > 1:
            self.work = dist.all_reduce(self.table, group=_check_group(timeout_s), async_op=True)

    @classmethod
    def alone(cls, record: CallRecord, microbatches: int, counts: tuple[float, ...] = (),
              additive: bool = False) -> "CallCheck":
        """The check of a call this rank makes alone (world 1, or ``piper.local()``): local validation only."""
        return cls(record, CallLayout(microbatches, (0,), 1, (0,)), 0, 1, 0.0, counts, additive)

    def resolve(self) -> Weights:
        if self._weights is None:
            if self.work is not None:
                self._wait()
            rows = [CallRecord.from_row(r) for r in self.table.tolist()]
            validate(rows, self.layout)
            self.batches = [r.batch for r in rows]
            if self.additive:  # each tensor-parallel holder of a replica has its whole sum
                self._weights = Weights(1.0, float(self.layout.tp))
            elif _items_apart(rows, self.layout.holders):
                self._weights = items_weights(self.layout, [r.items for r in rows], self.counts)
            else:
                self._weights = weights_for(self.layout, self.batches, self.rank)
        return self._weights

    def global_batch(self) -> int:
        """The step's samples over every replica (after ``resolve``): the loss holders' local batches,
        each replica counted once (its tensor-parallel ranks see the same rows)."""
        self.resolve()
        return sum(self.batches[h] for h in self.layout.holders) // self.layout.tp

    def _wait(self) -> None:
        """Wait for the table. Only a check still open after ``_SLOW_S`` costs anything more: this rank
        then notes in the store that it is here, so that on a timeout the ranks that never joined this
        call are named (the ones without a note)."""
        work, self.work = self.work, None
        deadline = self.started + _SLOW_S
        while not work.is_completed() and time.perf_counter() < deadline:
            time.sleep(1e-4)
        store = None
        if not work.is_completed():
            store = dist.distributed_c10d._get_default_store()
            store.set(self._here(self.rank), "1")
        left = max(self.timeout_s - (time.perf_counter() - self.started), 0.1)
        from piper_compile.runtime.groups import settle

        try:
            ok = work.wait(timeout=timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError on timeout or a closed peer
            settle(work)
            raise self._stuck(e, store) from None
        if ok is False:
            settle(work)
            raise self._stuck(None, store)

    def _here(self, rank: int) -> str:
        return f"piper/check/{self.record.model}/{self.record.call}/{int(self.record.forward_only)}/{rank}"

    def _absent(self, store: Any) -> list[int]:
        """Ranks that left no note for this call (they never made it), or [] if the store cannot say."""
        try:
            return [r for r in range(self.world) if r != self.rank and not store.check([self._here(r)])]
        except Exception:  # noqa: BLE001 - the store's host is gone too
            return []

    def _stuck(self, cause: Exception | None, store: Any) -> PiperRuntimeError:
        from piper_compile.runtime.groups import describe_failure, peer_closed

        waited = time.perf_counter() - self.started
        absent = self._absent(store) if store is not None and not peer_closed(cause) else []
        peers = absent or [r for r in range(self.world) if r != self.rank]
        what = describe_failure(cause, waited, self.timeout_s, peers)
        who = (f" rank(s) {absent} never made this call." if absent else "")
        return PiperRuntimeError(
            f"piper: rank {self.rank}: the call check of {self.record.describe()} {what}.{who} Every rank must "
            "call a piper step (training or forward-only) the same number of times in the same order; to "
            "evaluate on some ranks only, call the step inside piper.local() under torch.no_grad() (pure data "
            "parallel), or call it on every rank.")


_SLOW_S = 1.0  # a check open this long notes its rank in the store (see CallCheck._wait)
FAILED = -1  # the program field of a rank that could not capture or plan its call


def post_failure(rank: int, world: int, batch: int, nargs: int, forward_only: bool, timeout_s: float) -> None:
    """A rank whose call failed before it could plan posts its row anyway (program ``FAILED``), so the
    other ranks raise at once instead of waiting for it; best effort, the rank then raises its own error."""
    if world <= 1 or not dist.is_initialized() or dist.get_backend() == "fake":
        return
    check = CallCheck(CallRecord(-1, FAILED, -1, batch, nargs, forward_only), CallLayout(1, (0,), 1, (0,) * world),
                      rank, world, timeout_s)
    try:
        check._wait()
    except PiperRuntimeError:
        pass


def validate(rows: list[CallRecord], layout: CallLayout) -> None:
    """Raise (on every rank: every rank sees the same table) unless every rank makes the same call with
    a batch the plan can run: non-empty, divisible into the micro-batches, equal within a replica."""
    failed = [rank for rank, r in enumerate(rows) if r.program == FAILED]
    if failed:
        raise PiperRuntimeError(
            f"piper: rank{'s' if len(failed) > 1 else ''} {failed if len(failed) > 1 else failed[0]} could not start "
            "this call: it raised an error while capturing or planning the step (that rank's own error says "
            "why; every other rank raises this)")
    first = rows[0]
    if not all(r.same_call(first) for r in rows):
        groups: dict[str, list[int]] = defaultdict(list)
        for rank, r in enumerate(rows):
            groups[r.describe()].append(rank)
        what = "; ".join(f"rank{'s' if len(v) > 1 else ''} {v if len(v) > 1 else v[0]}: {k}" for k, v in groups.items())
        if len({(r.model, r.call, r.forward_only) for r in rows}) == 1:  # one call, planned apart
            raise PiperRuntimeError(
                f"piper: the ranks made the same call but planned different programs for it (every rank raises "
                f"this): {what}. Their inputs differ in a way that makes Dynamo trace another graph -- a "
                "different sequence length or dtype, or a float argument -- or their directives or options differ. "
                "Give every rank inputs of one shape (pad every batch to one length) and the same options.")
        raise PiperRuntimeError(
            f"piper: the ranks are making different calls (every rank raises this): {what}. Every rank must "
            "make the same piper calls in the same order: a step call (training, or forward-only under "
            "torch.no_grad()) is collective over the world. To evaluate on some ranks only, call the step "
            "inside piper.local() under torch.no_grad() (pure data parallel), or call it on every rank.")
    m = layout.microbatches
    bad = [(rank, r.batch) for rank, r in enumerate(rows) if r.batch <= 0 or r.batch % m]
    if bad:
        raise PiperRuntimeError(
            f"piper: local batch sizes {', '.join(f'{b} on rank {k}' for k, b in bad)} cannot be split into "
            f"{m} micro-batches (every rank raises this). Pass each rank a non-empty batch that is a multiple "
            f"of {m}: drop or pad the last partial batch, or split it differently across replicas.")
    by_replica: dict[int, set[int]] = defaultdict(set)
    for rank, r in enumerate(rows):
        by_replica[layout.replica[rank]].add(rank)
    for ranks in by_replica.values():
        sizes = {rows[k].batch for k in ranks}
        if len(sizes) > 1:
            raise PiperRuntimeError(
                f"piper: ranks {sorted(ranks)} hold one replica of the model (pipeline stages or a tensor-parallel "
                f"group) and must get the same local batch, but got {[rows[k].batch for k in sorted(ranks)]} "
                "(every rank raises this). Pass every rank of a replica the same batch.")
    _same_contents(rows, sorted(by_replica.values(), key=min))


def _same_contents(rows: list[CallRecord], replicas_: list[set[int]]) -> None:
    """Ranks of one replica passed the same samples (where their rows carry a fingerprint)."""
    for ranks in replicas_:
        prints = {rows[k].data for k in ranks}
        if len(ranks) < 2 or 0 in prints or len(prints) == 1:
            continue
        groups = ", ".join(f"ranks {sorted(g)}" if len(g) > 1 else f"rank {min(g)}" for g in replicas_)
        raise PiperRuntimeError(
            f"piper: ranks {sorted(ranks)} hold one replica of the model (pipeline stages or a tensor-parallel "
            "group) and must get the same batch, but were given different contents of the same size (every rank "
            "raises this): the first stage would read one rank's inputs and the last stage another's labels. "
            f"This plan has {len(replicas_)} data-parallel replica(s): {groups}. Shard the data over the "
            "replicas only (e.g. DistributedSampler(num_replicas=<replicas>, rank=<this rank's replica index>), "
            "not over the world) and give every rank of a replica the same batch, with the same seed for any "
            "random augmentation.")


def replicas(world: int, pairs: list[tuple[int, int]]) -> tuple[int, ...]:
    """Replica id per rank: ranks joined by ``pairs`` (point-to-point peers, tensor-parallel partners)
    see the same batch; the id is the smallest rank of the component."""
    parent = list(range(world))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return tuple(find(r) for r in range(world))


def call_layout(dag: Any, world: int) -> CallLayout:
    """The ``CallLayout`` of a lowered DAG."""
    from piper_compile.ir.dag import Kind

    pairs: list[tuple[int, int]] = []
    for n in dag.of_kind(Kind.SEND):
        pairs += list(zip(n.devices, n.op.dst))
    for n in dag.of_kind(Kind.COMPUTE):
        for g in n.attr("tp_groups") or ():
            pairs += [(g[0], r) for r in g[1:]]
    holders = dag.meta.loss_group
    return CallLayout(dag.meta.split or 1, holders, dag.meta.tp_size, replicas(world, pairs))
