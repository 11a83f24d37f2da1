"""``piper.local()`` calls: a forward-only step on one rank alone, with no communication (see
``runtime/consistency.local_calls``). What such a call may run, and when it is refused."""
from __future__ import annotations

from piper_compile.errors import PiperError
from piper_compile.ir.ops import LossReduce
from piper_compile.plan.program import Program


def check_local_call(train: bool, broadcast_done: bool) -> None:
    """A local call must be forward-only, and come after the model's first collective call."""
    if train:
        raise PiperError("piper: piper.local() runs forward-only calls on this rank alone; wrap the call in "
                         "torch.no_grad() (a training step is collective over the world)")
    if not broadcast_done:
        raise PiperError("piper: piper.local(): the model has not made a collective call yet (its first call "
                         "makes every replica start from rank 0's weights); call the step on every rank first")


def alone(program: Program) -> Program:
    """``program`` (a forward-only one) without its loss all-reduce; refused where it communicates
    otherwise (pipeline stages, ZeRO-3 gathers, expert or tensor parallelism)."""
    traffic = [i for i in program.instrs if i.node.kind.is_comm and not isinstance(i.node.op, LossReduce)]
    if traffic:
        raise PiperError(f"piper: piper.local(): this step's forward-only program communicates ({traffic[0].short()} "
                         f"on rank {program.rank}: pipeline stages, ZeRO-3 gathers, expert or tensor "
                         "parallelism), so it cannot run on one rank alone. Call it under torch.no_grad() "
                         "on every rank instead")
    return Program(program.rank, [i for i in program.instrs if not isinstance(i.node.op, LossReduce)])
