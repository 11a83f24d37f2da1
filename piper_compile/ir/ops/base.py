"""The base of typed DAG operations.

Every node of the training DAG carries one ``Op``: a frozen, slotted record of what the step *is*
(a compiled segment, a send, a gradient reduction of bucket b at ZeRO level 2, ...). Each operation's
module holds all of its rules, as methods of its class:

- text: ``short`` (program listings), the record's fields (the DAG's text form, ``ir/ops/__init__``);
- plan: ``queue`` (the verifier's and simulator's FIFO), ``members`` (the ranks a rank runs it with),
  ``process_groups`` (the groups the runtime creates for it), ``jumpable`` (whether a reorder-window
  filler may run before it), ``accumulates`` (gradients / loss it adds into);
- simulation: ``duration`` (which cost-model primitive prices it, with what bytes) and ``allocates``
  (the values it makes live, for the memory model);
- runtime: ``compute`` (COMPUTE ops: outputs from inputs) or ``start`` (everything else: issue the
  communication or run the update), called by the executor with its per-step state.

So the runtime, the verifier, the simulator and the reorderer dispatch on the op; a new kind of step is
one new class in one module plus its registration in ``ir/ops/__init__.py``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ClassVar

from piper_compile.ir.kind import Kind
from piper_compile.ir.ranks import compact

if TYPE_CHECKING:  # only for annotations: ir does not import the plan, the simulator or the runtime
    from piper_compile.ir.dag import Node
    from piper_compile.plan.program import Instr
    from piper_compile.sim.cost import CostModel
    from piper_compile.sim.shapes import Sizes

QueueKey = tuple[int, str, int]  # (rank, process group, peer or -1): one FIFO of the execution model
GroupKey = tuple[str, tuple[int, ...]]  # (stream, sorted ranks): one process group


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """What one DAG node does. Subclasses are frozen slotted dataclasses; ``NAME`` is the op's key in
    the DAG's text form."""

    NAME: ClassVar[str] = "op"

    @property
    def kind(self) -> Kind:  # pragma: no cover - every op says
        raise NotImplementedError

    # -- text -------------------------------------------------------------------------------------
    def short(self, node: "Node", peer: int | None) -> str:
        """The label in per-rank program listings (``F1.mb3``, ``SEND.x->r2``, ``AR.b0@dp``)."""
        return node.name

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # -- plan ---------------------------------------------------------------------------------------
    def members(self, node: "Node", rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` runs this collective with (its own subgroup where the op has subgroups)."""
        return node.devices

    def queue(self, node: "Node", rank: int, peer: int | None) -> QueueKey:
        """The FIFO this (asynchronous) instruction of ``rank`` joins: one per process group."""
        return (rank, f"{node.stream}@{_ranks_label(self.members(node, rank))}", -1)

    def process_groups(self, node: "Node", world: int) -> list[GroupKey]:
        """Process groups the runtime needs for this op (created in the same order on every rank)."""
        return []

    jumpable: ClassVar[bool] = False  # a reorder-window filler may run before it

    def accumulates(self) -> frozenset[str]:
        """Gradients (by parameter) and the loss (``LOSS``) this step adds into."""
        return frozenset()

    def grad_outputs(self) -> tuple[tuple[str, str], ...]:
        """(value, parameter) of every gradient this step produces (accumulated into the rank's buffers)."""
        return ()

    # -- simulation -----------------------------------------------------------------------------------
    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        return 0.0

    def allocates(self, node: "Node", sizes: "Sizes") -> list[tuple[str, int, bool]]:
        """(value, bytes, is a gathered parameter) of every value this step makes live."""
        return []

    # -- runtime --------------------------------------------------------------------------------------
    def transient(self, node: "Node", sizes: "Sizes", fused: frozenset[str] = frozenset()) -> int:
        """Bytes this step holds only while it runs, beyond its inputs and outputs (the memory plan);
        ``fused``: the gradient values written into their buffers by the step itself, not kept."""
        return 0

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:  # pragma: no cover - every non-compute op says
        raise NotImplementedError(f"piper: internal: no runtime for {type(self).__name__}")


_LABELS: dict[int, tuple[tuple[int, ...], str]] = {}  # id of a member tuple -> (that tuple, its label)


def _ranks_label(members: tuple[int, ...]) -> str:
    """``0-16376:8``: a group's ranks in order, written once per group (groups of thousands of ranks), found
    by the tuple's identity (hashing thousands of ranks per instruction costs more than the rest)."""
    found = _LABELS.get(id(members))
    if found is None or found[0] is not members:
        if len(_LABELS) > 4096:
            _LABELS.clear()
        found = _LABELS[id(members)] = (members, _label(tuple(members)))
    return found[1]


@functools.lru_cache(maxsize=1024)
def _label(members: tuple[int, ...]) -> str:
    return compact(tuple(sorted(members)))


LOSS = "<loss>"  # the accumulation into the step's loss, beside gradient names in ``accumulates``


class Collective(Op):
    """Ops that every member issues on its stream's group (SPMD over ``node.devices``)."""

    __slots__ = ()

    def process_groups(self, node: "Node", world: int) -> list[GroupKey]:
        return [(node.stream, tuple(sorted(g))) for g in (getattr(self, "subgroups", None) or (node.devices,))]

    def members(self, node: "Node", rank: int) -> tuple[int, ...]:
        for g in getattr(self, "subgroups", None) or ():
            if rank in g:
                return tuple(g)
        return node.devices
