"""Point-to-point steps: an activation (or its gradient) crossing from one device group to another, a
tied parameter's finished gradient sent to the other groups that hold the parameter (``state``), or
(once per step) a holder's accumulated part of that gradient sent to the holder that completes it
(``RecvPart`` adds it in).

A SEND/RECV pair is SPMD over two groups of equal size: the i-th rank of the sender's group sends to the
i-th rank of the receiver's (``dst``/``src`` give the peers in device order). Each direction of a rank
pair has a process group of its own per stream (``p2p_channel``), so the two directions never queue
behind each other."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from piper_compile.ir.kind import Kind
from piper_compile.ir.ops.base import GroupKey, Op, QueueKey

if TYPE_CHECKING:
    from piper_compile.ir.dag import Node
    from piper_compile.plan.program import Instr
    from piper_compile.sim.cost import CostModel
    from piper_compile.sim.shapes import Sizes


def p2p_channel(stream: str, src: int, dst: int) -> str:
    """The process group of traffic from ``src`` to ``dst`` on ``stream``: one per direction."""
    return f"{stream}:{'up' if src < dst else 'down'}"


class PointToPoint(Op):
    """Shared rules of SEND and RECV (subclasses have ``msg`` and ``state`` fields)."""

    __slots__ = ()

    @property
    def jumpable(self) -> bool:  # type: ignore[override]
        return not getattr(self, "state")  # gradient-state traffic keeps its place

    def channel(self, node: "Node", rank: int, peer: int) -> str:
        src, dst = (rank, peer) if self.kind is Kind.SEND else (peer, rank)
        return p2p_channel(node.stream, src, dst)

    def queue(self, node: "Node", rank: int, peer: int | None) -> QueueKey:
        assert peer is not None
        return (rank, self.channel(node, rank, peer), peer)

    def process_groups(self, node: "Node", world: int) -> list[GroupKey]:
        return [(f"{node.stream}:up", tuple(range(world))), (f"{node.stream}:down", tuple(range(world)))]

    def duration(self, cost: "CostModel", ins: "Instr", rank: int) -> float:
        return cost.p2p_time(ins, rank, getattr(self, "msg"))

    def pairs(self, node: "Node") -> tuple[int, ...]:
        """The peer of each rank of ``node.devices``, in device order (``dst`` or ``src``)."""
        return getattr(self, "dst") if self.kind is Kind.SEND else getattr(self, "src")

    def peer(self, node: "Node", rank: int) -> int:
        return self.pairs(node)[node.devices.index(rank)]

    def short(self, node: "Node", peer: int | None) -> str:
        arrow = "->" if self.kind is Kind.SEND else "<-"
        return f"{node.kind.value}.{getattr(self, 'msg').split('>')[0]}{arrow}r{peer}"


@dataclasses.dataclass(frozen=True, slots=True)
class Send(PointToPoint):
    """Send value ``node.inputs[0]`` (or, with ``state``, the rank's gradient buffer of that parameter)
    to ``dst[i]`` for the i-th rank of the group; ``msg`` names the message its RECV matches."""

    NAME = "send"
    msg: str
    dst: tuple[int, ...]
    mb: int = 0
    state: str | None = None

    @property
    def kind(self) -> Kind:
        return Kind.SEND

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        from piper_compile.runtime import comm

        t = rt.grads.view(self.state) if self.state else rt.get(ins.node.inputs[0])
        rt.issue(ins, pos, comm.isend(t, ins.peer, rt.p2p_group(ins)))
        if not self.state:  # the value stays counted live until the send completes (``Step.free``)
            rt.sent_by[ins.node.inputs[0]] = ins.node.name
        rt.stats.p2p += 1


@dataclasses.dataclass(frozen=True, slots=True)
class Recv(PointToPoint):
    """Receive message ``msg`` from ``src[i]`` into a fresh buffer of ``shape``/``dtype`` (value
    ``node.outputs[0]``), or with ``state`` into the rank's gradient buffer of that parameter."""

    NAME = "recv"
    msg: str
    src: tuple[int, ...]
    shape: tuple[Any, ...] = ()
    dtype: str = ""
    mb: int = 0
    state: str | None = None

    @property
    def kind(self) -> Kind:
        return Kind.RECV

    def allocates(self, node: "Node", sizes: "Sizes") -> list[tuple[str, int, bool]]:
        return [] if self.state else [(v, sizes.messages.get(self.msg, 0), False) for v in node.outputs]

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        import torch

        from piper_compile.runtime import comm

        if self.state:
            buf = rt.grads.view(self.state)
        else:
            shape = [rt.eval(d) for d in self.shape]
            buf = torch.empty(shape, dtype=getattr(torch, self.dtype), device=rt.device)
            rt.put(ins.node.outputs[0], buf)
        rt.issue(ins, pos, comm.irecv(buf, ins.peer, rt.p2p_group(ins)))
        rt.stats.p2p += 1


@dataclasses.dataclass(frozen=True, slots=True)
class RecvPart(Recv):
    """Receive another holder's part of parameter ``state``'s gradient (its micro-batches summed) and add
    it into this rank's gradient when the receive completes (waited for before the gradient is reduced
    or read). Lowering orders it after this rank's own writers of that gradient, so the sum is always
    (own part) + (received part), whatever the timing."""

    NAME = "recv_part"

    def allocates(self, node: "Node", sizes: "Sizes") -> list[tuple[str, int, bool]]:
        """The receive buffer, one gradient's size, held until the step that waits for it (``held:``)."""
        return [(f"held:{node.name}", sizes.params_bytes([self.state]), False)]

    def start(self, rt: Any, ins: "Instr", pos: int) -> None:
        import torch

        from piper_compile.runtime import comm

        assert self.state is not None
        own = rt.grads.view(self.state)
        buf = torch.empty_like(own)
        nbytes = buf.numel() * buf.element_size()
        rt.count_live(nbytes)  # until it is added in, once the receive completes

        def finish() -> None:
            rt.grads.accumulate(self.state, buf)
            rt.count_live(-nbytes)

        rt.issue(ins, pos, comm.irecv(buf, ins.peer, rt.p2p_group(ins)))
        rt.on_finish(ins.node.name, finish)
        rt.stats.p2p += 1
