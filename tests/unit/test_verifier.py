"""The plan verifier on hand-made per-rank programs: exchanges, deadlocks, unmatched P2P, collective order."""
from __future__ import annotations

import re

import pytest

from piper_compile import PiperPlanError
from piper_compile.ir.dag import Node, TrainingDAG, make_tags
from piper_compile.ir.ops import GradReduce, Recv, Segment, Send
from piper_compile.plan.program import Instr, Program, build_programs
from piper_compile.plan.verifier import VerifyResult, verify_programs


# -- helpers ---------------------------------------------------------------------------------------
def compute(name: str, rank: int, pass_: str = "F", region: str = "0", mb: int = 0,
            waits: tuple[str, ...] = ()) -> Instr:
    node = Node(name, Segment(name, region), make_tags({"PASS": pass_, "MB": mb}), (rank,), "compute")
    return Instr(node, None, waits)


def send(msg: str, rank: int, peer: int, stream: str = "pp") -> Instr:
    node = Node(f"SEND.{msg}", Send(msg, (peer,)), (), (rank,), stream)
    return Instr(node, peer)


def recv(msg: str, rank: int, peer: int, stream: str = "pp") -> Instr:
    node = Node(f"RECV.{msg}", Recv(msg, (peer,)), (), (rank,), stream)
    return Instr(node, peer)


def coll(name: str, devices: tuple[int, ...], stream: str = "dp") -> Instr:
    return Instr(Node(name, GradReduce(name, ()), (), devices, stream))


def two_stage_programs(stream_fwd: str = "pp", stream_bwd: str = "pp") -> list[Program]:
    """Rank 0 runs stage 0 (F, send activation, receive its gradient, B); rank 1 runs stage 1."""
    r0 = [compute("F.PP0", 0, "F", "0"), send("x>r1", 0, 1, stream_fwd), recv("g>r0", 0, 1, stream_bwd),
          compute("B.PP0", 0, "B", "0", waits=("RECV.g>r0",))]
    r1 = [recv("x>r1", 1, 0, stream_fwd), compute("F.PP1", 1, "F", "1", waits=("RECV.x>r1",)),
          compute("B.PP1", 1, "B", "1"), send("g>r0", 1, 0, stream_bwd)]
    return [Program(0, r0), Program(1, r1)]


# -- valid plans -----------------------------------------------------------------------------------
@pytest.mark.parametrize("streams", [("pp", "pp"), ("pp_fwd", "pp_bwd")])
def test_valid_two_rank_exchange_verifies(streams: tuple[str, str]) -> None:
    res = verify_programs(two_stage_programs(*streams))
    assert isinstance(res, VerifyResult) and res.steps >= 1


def test_empty_and_compute_only_programs_verify() -> None:
    assert verify_programs([Program(0), Program(1)]).steps >= 1
    verify_programs([Program(0, [compute("a", 0), compute("b", 0)])])


def test_two_microbatch_pipeline_with_grad_all_reduce_and_loss() -> None:
    r0 = [compute("F0.mb0", 0, "F", "0", 0), send("x0", 0, 1), compute("F0.mb1", 0, "F", "0", 1), send("x1", 0, 1),
          recv("g0", 0, 1), recv("g1", 0, 1), compute("B0.mb0", 0, "B", "0", 0, waits=("RECV.g0",)),
          compute("B0.mb1", 0, "B", "0", 1, waits=("RECV.g1",)), coll("AR.loss", (0, 1), "loss")]
    r1 = [recv("x0", 1, 0), recv("x1", 1, 0), compute("F1.mb0", 1, "F", "1", 0, waits=("RECV.x0",)),
          compute("B1.mb0", 1, "B", "1", 0), send("g0", 1, 0), compute("F1.mb1", 1, "F", "1", 1, waits=("RECV.x1",)),
          compute("B1.mb1", 1, "B", "1", 1), send("g1", 1, 0), coll("AR.loss", (0, 1), "loss")]
    verify_programs([Program(0, r0), Program(1, r1)])


def test_sends_in_both_directions_on_different_streams_verify() -> None:
    r0 = [send("a", 0, 1, "s1"), recv("b", 0, 1, "s2")]
    r1 = [send("b", 1, 0, "s2"), recv("a", 1, 0, "s1")]
    verify_programs([Program(0, r0), Program(1, r1)])


def test_collectives_in_same_order_on_subgroups_verify() -> None:
    progs = [Program(0, [coll("A", (0, 1)), coll("B", (0, 1, 2))]),
             Program(1, [coll("A", (0, 1)), coll("B", (0, 1, 2))]),
             Program(2, [coll("B", (0, 1, 2))])]
    verify_programs(progs)


def test_build_programs_from_a_hand_made_dag_verify() -> None:
    """The per-rank program builder + verifier on a two-stage DAG with SEND/RECV pairs."""
    dag = TrainingDAG()
    f0 = dag.add(Node("F.PP0", Segment("F.PP0", "0"), make_tags({"PP": 0, "PASS": "F"}), (0,), inputs=("input:x",),
                      outputs=("h",)))
    dag.add(Node("SEND.h>r1", Send("h>r1", (1,)), f0.tags, (0,), "pp_fwd", ("h",), ()))
    dag.add(Node("RECV.h>r1", Recv("h>r1", (0,)), f0.tags, (1,), "pp_fwd", (), ("h>r1",)))
    f1 = dag.add(Node("F.PP1", Segment("F.PP1", "1"), make_tags({"PP": 1, "PASS": "F"}), (1,), inputs=("h>r1",),
                      outputs=("loss", "dh")))
    dag.add(Node("SEND.dh>r0", Send("dh>r0", (0,)), f1.tags, (1,), "pp_bwd", ("dh",), ()))
    dag.add(Node("RECV.dh>r0", Recv("dh>r0", (1,)), f1.tags, (0,), "pp_bwd", (), ("dh>r0",)))
    dag.add(Node("B.PP0", Segment("B.PP0", "0"), make_tags({"PP": 0, "PASS": "B"}), (0,), inputs=("dh>r0", "h")))
    programs = build_programs(dag, 2)
    assert [i.name for i in programs[1].instrs] == ["RECV.h>r1", "F.PP1", "SEND.dh>r0"]
    b0 = next(i for i in programs[0].instrs if i.name == "B.PP0")
    assert b0.waits == ("RECV.dh>r0",)
    peers = {(p.rank, i.name): i.peer for p in programs for i in p.instrs}
    assert peers[(0, "SEND.h>r1")] == 1 and peers[(1, "RECV.h>r1")] == 0
    assert peers[(1, "SEND.dh>r0")] == 0 and peers[(0, "RECV.dh>r0")] == 1
    assert peers[(0, "F.PP0")] is None
    verify_programs(programs)
    text = "\n".join(p.to_text() for p in programs)
    assert "SEND.h->r1" in text and "RECV.h<-r0" in text


# -- deadlocks -------------------------------------------------------------------------------------
def test_recv_before_send_on_both_ranks_deadlocks_with_grid() -> None:
    r0 = [recv("g>r0", 0, 1), compute("B.PP0", 0, "B", "0", waits=("RECV.g>r0",)), send("x>r1", 0, 1)]
    r1 = [recv("x>r1", 1, 0), compute("F.PP1", 1, "F", "1", waits=("RECV.x>r1",)), send("g>r0", 1, 0)]
    with pytest.raises(PiperPlanError) as ei:
        verify_programs([Program(0, r0), Program(1, r1)])
    msg = str(ei.value)
    assert msg.startswith("piper:") and "deadlock" in msg and "Fix:" in msg
    # the rank x step grid: a header row, one row per rank, the stuck compute marked >...<
    assert re.search(r"^rank \|", msg, re.M)
    row0 = next(line for line in msg.splitlines() if re.match(r"\s*0 \|", line))
    row1 = next(line for line in msg.splitlines() if re.match(r"\s*1 \|", line))
    assert ">B0.mb0<" in row0 and ">F1.mb0<" in row1
    assert "RECV.g<-r1" in row0 and "RECV.x<-r0" in row1
    # and a line per stuck rank naming what it waits for
    assert re.search(r"^rank 0: B0\.mb0 waits for RECV\.g>r0", msg, re.M)
    assert re.search(r"^rank 1: F1\.mb0 waits for RECV\.x>r1", msg, re.M)


def test_send_before_recv_on_both_ranks_same_stream_verifies() -> None:
    """The two directions of a rank pair are separate queues (separate process groups at run time), so
    both ranks may send first."""
    r0 = [send("a", 0, 1), recv("b", 0, 1)]
    r1 = [send("b", 1, 0), recv("a", 1, 0)]
    verify_programs([Program(0, r0), Program(1, r1)])
    assert r0[0].group_name(0) != r0[1].group_name(0)
    assert r0[0].group_name(0) == r1[1].group_name(1)  # a SEND and its RECV share a group


def test_messages_to_different_peers_do_not_queue_behind_each_other() -> None:
    """Rank 1 posts its RECV of ``a`` only after ``c`` arrives from rank 2, which needs ``b`` first; ``b``
    is sent after ``a`` on the same stream but to another peer, so it must not wait behind ``a``."""
    r0 = [send("a", 0, 1), send("b", 0, 2)]
    r1 = [recv("c", 1, 2), compute("use_c", 1, waits=("RECV.c",)), recv("a", 1, 0)]
    r2 = [recv("b", 2, 0), compute("use_b", 2, waits=("RECV.b",)), send("c", 2, 1)]
    verify_programs([Program(0, r0), Program(1, r1), Program(2, r2)])


def test_second_message_needed_first_deadlocks() -> None:
    """Messages of one channel complete in order: a receiver that blocks on the second message before
    posting the receive of the first one never gets it."""
    r0 = [send("m0", 0, 1), send("m1", 0, 1)]
    r1 = [recv("m1", 1, 0), compute("F1", 1, "F", "1", waits=("RECV.m1",)), recv("m0", 1, 0)]
    with pytest.raises(PiperPlanError, match="deadlock") as ei:
        verify_programs([Program(0, r0), Program(1, r1)])
    msg = str(ei.value)
    assert ">F1.mb0<" in msg
    assert "never matched" in msg  # rank 0 finished issuing, its first SEND is still queued


def test_recv_order_mismatch_on_one_stream_deadlocks() -> None:
    r0 = [send("m0", 0, 1), send("m1", 0, 1)]
    r1 = [recv("m1", 1, 0), recv("m0", 1, 0)]
    with pytest.raises(PiperPlanError, match="deadlock"):
        verify_programs([Program(0, r0), Program(1, r1)])


def test_collective_missing_on_one_member_deadlocks() -> None:
    progs = [Program(0, [coll("AR.x", (0, 1))]), Program(1, [compute("F", 1)])]
    with pytest.raises(PiperPlanError, match="deadlock") as ei:
        verify_programs(progs)
    assert ">AR.x@dp<" in str(ei.value)


def test_wait_on_an_instruction_that_never_runs_deadlocks() -> None:
    progs = [Program(0, [compute("F", 0, waits=("RECV.nothing",))])]
    with pytest.raises(PiperPlanError, match="deadlock") as ei:
        verify_programs(progs)
    assert ">F0.mb0<" in str(ei.value) and "RECV.nothing" in str(ei.value)


def test_send_and_recv_on_different_streams_do_not_match() -> None:
    progs = [Program(0, [send("a", 0, 1, "s1")]), Program(1, [recv("a", 1, 0, "s2")])]
    with pytest.raises(PiperPlanError, match="deadlock"):
        verify_programs(progs)


# -- unmatched P2P -----------------------------------------------------------------------------------
def test_unmatched_send_raises() -> None:
    progs = [Program(0, [compute("F", 0), send("x>r1", 0, 1)]), Program(1, [compute("G", 1)])]
    with pytest.raises(PiperPlanError) as ei:
        verify_programs(progs)
    msg = str(ei.value)
    assert msg.startswith("piper:") and "unmatched send" in msg
    assert "rank 0" in msg and "rank 1" in msg and "x>r1" in msg


def test_unmatched_recv_raises() -> None:
    progs = [Program(0, [compute("F", 0)]), Program(1, [recv("x>r1", 1, 0)])]
    with pytest.raises(PiperPlanError, match="unmatched receive"):
        verify_programs(progs)


def test_send_to_the_wrong_peer_raises() -> None:
    progs = [Program(0, [send("x", 0, 2)]), Program(1, [recv("x", 1, 0)]), Program(2, [])]
    with pytest.raises(PiperPlanError, match="unmatched"):
        verify_programs(progs)


def test_message_name_mismatch_raises() -> None:
    progs = [Program(0, [send("x", 0, 1)]), Program(1, [recv("y", 1, 0)])]
    with pytest.raises(PiperPlanError, match="unmatched"):
        verify_programs(progs)


# -- collective order --------------------------------------------------------------------------------
def test_collectives_in_different_orders_raise() -> None:
    progs = [Program(0, [coll("AR.b0", (0, 1)), coll("AR.b1", (0, 1))]),
             Program(1, [coll("AR.b1", (0, 1)), coll("AR.b0", (0, 1))])]
    with pytest.raises(PiperPlanError) as ei:
        verify_programs(progs)
    msg = str(ei.value)
    assert msg.startswith("piper:") and "different orders" in msg
    assert "AR.b0" in msg and "AR.b1" in msg and "'dp'" in msg


def test_collectives_in_different_orders_on_different_streams_verify() -> None:
    progs = [Program(0, [coll("AR.b0", (0, 1), "s0"), coll("AR.b1", (0, 1), "s1")]),
             Program(1, [coll("AR.b1", (0, 1), "s1"), coll("AR.b0", (0, 1), "s0")])]
    verify_programs(progs)


def test_overlapping_groups_on_one_stream_are_not_misordered() -> None:
    # rank 1 first joins Y with rank 2, then X with rank 0: a valid FIFO order on every rank.
    progs = [Program(0, [coll("X", (0, 1))]),
             Program(1, [coll("Y", (1, 2)), coll("X", (0, 1))]),
             Program(2, [coll("Y", (1, 2))])]
    verify_programs(progs)


def test_deadlock_grid_cells_stay_apart() -> None:
    r0 = [send("m0", 0, 1), send("m1", 0, 1)]
    r1 = [recv("m1", 1, 0), compute("F1", 1, "F", "1", waits=("RECV.m1",)), recv("m0", 1, 0)]
    with pytest.raises(PiperPlanError) as ei:
        verify_programs([Program(0, r0), Program(1, r1)])
    assert "<SEND" not in str(ei.value)
