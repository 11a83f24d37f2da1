"""SPMD symmetry (``plan/symmetry.py``): ranks with the same program up to rank ids are planned, verified and
simulated once per class -- and that changes nothing: every rank's program, the verifier's verdict and the
simulated times and memory equal the rank-by-rank ones, on every strategy family."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import piper_compile as piper
from piper_compile.autoplan.space import Candidate
from piper_compile.errors import PiperPlanError
from piper_compile.ir.dag import Node, TrainingDAG
from piper_compile.ir.ops import Recv, Segment, Send
from piper_compile.memory import plan_memory
from piper_compile.plan.program import Program, build_program
from piper_compile.plan.symmetry import Programs, rank_classes
from piper_compile.plan.verifier import verify_programs
from piper_compile.sim import FlopCost, UniformCost
from piper_compile.sim.simulate import simulate
from piper_compile.testing.models import build_model

TP = {"blocks.*.qkv": "colwise:3", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
FIELDS = ("step_time", "ranks", "busy", "rank_end", "peak_activation_bytes", "param_bytes", "grad_bytes",
          "peak_gathered_bytes", "peak_grad_bytes", "peak_activation_pos", "live_at_peak", "memory_timeline")


@functools.lru_cache(maxsize=4)
def _plan(c: Candidate, model: str = "gpt") -> piper.StaticPlan:
    torch._dynamo.reset()
    m = build_model(model, 0, layers=4, dim=32, seq=16)
    m.annotate_stages(c.stages)  # type: ignore[operator]
    batch = m.make_batch(4 * c.dp, torch.Generator().manual_seed(0))  # type: ignore[operator]
    local = tuple(t[: t.shape[0] // c.dp] for t in batch)
    return piper.plan(m, *local, directives=c.directives(TP), world_size=c.world,
                      options={"optimizer": torch.optim.AdamW})


def _same_as_rank_by_rank(plan: piper.StaticPlan) -> None:
    programs = plan.programs
    assert isinstance(programs, Programs)
    for r in range(len(programs)):  # a rank's program made from its representative's = built for it
        assert programs[r].to_text() == build_program(plan.dag, r, programs.reorder_window).to_text(), r
    assert programs.quotient() is not None, "the quotient should be exact on plans piper builds"
    verify_programs(programs)
    verify_programs(list(programs))
    for cost in (FlopCost(flops_per_s=1e9, bytes_per_s=1e8, latency_s=1e-5), UniformCost(comm=0.5)):
        whole, folded = simulate(list(programs), cost, plan.dag), simulate(programs, cost, plan.dag)
        assert folded.classes == programs.symmetry.classes and not whole.classes
        for f in FIELDS:
            assert getattr(folded, f) == getattr(whole, f), f
    by_class = plan_memory(plan.dag, programs, torch.optim.AdamW)
    by_rank = plan_memory(plan.dag, list(programs), torch.optim.AdamW)
    assert {r: str(m) for r, m in by_class.items()} == {r: str(m) for r, m in by_rank.items()}


@pytest.mark.slow  # ~4 s: keeps the fast subset under 5 min
def test_pp_times_dp_has_one_class_per_stage():
    plan = _plan(Candidate(pp=2, dp=3, schedule="1f1b", microbatches=2, zero=1))
    assert plan.programs.symmetry.classes == {0: (0, 2, 4), 1: (1, 3, 5)}
    _same_as_rank_by_rank(plan)


@pytest.mark.slow
@pytest.mark.parametrize("c", [
    Candidate(pp=2, dp=2, schedule="zbv", microbatches=4, zero=3),
    Candidate(pp=2, dp=2, schedule="dualpipev", microbatches=4, zero=2),
    Candidate(pp=2, dp=2, schedule="interleaved", microbatches=4),
    Candidate(pp=2, dp=2, schedule="zb_h1", microbatches=2, zero=1),
    Candidate(pp=1, dp=4, microbatches=2, zero=3),
    Candidate(pp=2, dp=1, schedule="1f1b", microbatches=2, tp=2),
    Candidate(pp=1, dp=2, microbatches=2, zero=1, tp=2),
], ids=lambda c: c.label())
def test_strategy_families_fold_exactly(c):
    plan = _plan(c)
    # one class per pipeline rank; ZeRO-1 under TP gathers per data-parallel subgroup (steps of their own)
    classes = plan.programs.symmetry.classes
    assert c.pp <= len(classes) <= c.pp * c.tp and len(classes) < c.world, classes  # replicas fold
    _same_as_rank_by_rank(plan)


@pytest.mark.slow
def test_expert_parallel_folds_exactly():
    c = Candidate(pp=1, dp=4, microbatches=2, ep=True)
    torch._dynamo.reset()
    m = build_model("moe", 0)
    batch = m.make_batch(4, torch.Generator().manual_seed(0))  # type: ignore[operator]
    plan = piper.plan(m, *batch, directives=[piper.split(2), piper.replicate(), piper.shard({"EP": 0})],
                      world_size=c.world)
    assert len(plan.programs.symmetry.classes) == 1
    _same_as_rank_by_rank(plan)


@pytest.mark.slow
def test_tied_weight_over_three_replicated_stages_folds_exactly():
    torch._dynamo.reset()
    m = build_model("tied_mlp")
    m.annotate_stages(3)  # type: ignore[operator]
    batch = m.make_batch(8, torch.Generator().manual_seed(0))  # type: ignore[operator]
    directives = [*piper.pipeline(3, ranks=[[0, 3], [1, 4], [2, 5]]), piper.replicate({"PP": "*"}),
                  piper.split(2), *piper.schedules.one_f_one_b(3, 2)]
    plan = piper.plan(m, *batch, directives=directives, world_size=6)
    assert plan.programs.symmetry.classes == {0: (0, 3), 1: (1, 4), 2: (2, 5)}
    _same_as_rank_by_rank(plan)


@pytest.mark.slow  # ~4 s: keeps the fast subset under 5 min
def test_a_deadlock_is_found_on_the_quotient_as_on_every_rank():
    """A representative's program that sends two messages of one channel in the wrong order deadlocks
    every rank of its class (the peer receives them in send order): the quotient reports it as the whole
    world does."""
    plan = _plan(Candidate(pp=2, dp=3, schedule="1f1b", microbatches=2, zero=1))
    programs = Programs(plan.dag, 6, plan.programs.reorder_window, plan.programs.symmetry)
    instrs = list(programs[1].instrs)
    first_send = next(k for k, i in enumerate(instrs) if i.node.kind.value == "SEND")
    instrs.append(instrs.pop(first_send))  # rank 1 sends micro-batch 0's activation gradient last
    programs._made = {1: Program(1, instrs)}  # ranks 3 and 5 are made from it
    assert programs[3].instrs[-1].node is instrs[-1].node and programs.quotient() is not None
    with pytest.raises(PiperPlanError, match="deadlock") as folded:
        verify_programs(programs)
    with pytest.raises(PiperPlanError, match="deadlock"):
        verify_programs(list(programs))
    assert "rank 1:" in str(folded.value)


def _p2p_dag(dst_b: tuple[int, ...]) -> TrainingDAG:
    """Group [0, 1] sends two messages to group [2, 3] on one stream: the first pairwise, the second to
    ``dst_b``."""
    dag = TrainingDAG()
    dag.add(Node("f", Segment("f"), devices=(0, 1), outputs=("x",)))
    dag.add(Node("s1", Send("a", (2, 3)), devices=(0, 1), stream="pp", inputs=("x",)))
    dag.add(Node("r1", Recv("a", (0, 1)), devices=(2, 3), stream="pp", outputs=("a",)))
    src_b = tuple(dst_b.index(r) for r in (2, 3))
    dag.add(Node("s2", Send("b", dst_b), devices=(0, 1), stream="pp", inputs=("x",)))
    dag.add(Node("r2", Recv("b", src_b), devices=(2, 3), stream="pp", outputs=("b",)))
    dag.add(Node("g", Segment("g"), devices=(2, 3), inputs=("a", "b")))
    return dag


def test_pairwise_groups_fold_into_one_class_each():
    """Rank 0 sends both messages to rank 2 and rank 1 both to rank 3: one class per group, and the
    quotient is exact."""
    dag = _p2p_dag((2, 3))
    programs = Programs(dag, 4, 8, rank_classes(dag, 4))
    assert programs.symmetry.classes == {0: (0, 1), 2: (2, 3)}
    assert programs.quotient() is not None
    verify_programs(programs)
    whole, folded = simulate(list(programs), UniformCost(comm=1.0), dag), simulate(programs, UniformCost(comm=1.0), dag)
    assert folded.classes and folded.rank_end == whole.rank_end


def test_a_quotient_that_would_fold_two_channels_is_not_used():
    """Rank 0 sends to ranks 2 and 3, both of one class, on one stream: in a quotient both channels would
    be one queue (to the representative), so the plan is verified and simulated rank by rank."""
    dag = _p2p_dag((3, 2))
    programs = Programs(dag, 4, 8, rank_classes(dag, 4))
    assert programs.symmetry.classes == {0: (0, 1), 2: (2, 3)}
    assert programs.quotient() is None
    verify_programs(programs)  # rank by rank
    res = simulate(programs, UniformCost(comm=1.0), dag)
    assert not res.classes and res.ranks == [0, 1, 2, 3]


@pytest.mark.slow  # 6-26 s: keeps the fast subset under 5 min
def test_a_rank_dependent_cost_model_simulates_every_rank():
    plan = _plan(Candidate(pp=2, dp=3, schedule="1f1b", microbatches=2, zero=1))

    @dataclasses.dataclass
    class SlowRank3(UniformCost):
        def compute_time(self, ins, rank, segment):  # noqa: ANN001, ANN201
            return 10.0 if rank == 3 else 1.0

    res = simulate(plan.programs, SlowRank3(), plan.dag)
    assert not res.classes and res.busy[3] > res.busy[1]


def test_a_large_world_builds_one_program_per_class():
    """PP4 x DP1024: planning, verification, simulation and the memory plan build the 4 representatives'
    programs only, and every rank gets its class's figures."""
    torch._dynamo.reset()
    m = build_model("mlp", 0)
    m.annotate_stages(4)  # type: ignore[operator]
    batch = m.make_batch(8, torch.Generator().manual_seed(0))  # type: ignore[operator]
    c = Candidate(pp=4, dp=1024, schedule="1f1b", microbatches=4, zero=2)
    plan = piper.plan(m, *batch, directives=c.directives(), world_size=c.world,
                      options={"optimizer": torch.optim.AdamW})
    res = simulate(plan.programs, FlopCost(), plan.dag)
    memory = plan.memory
    assert sorted(plan.programs._made) == [0, 1, 2, 3]  # nothing else was built
    assert len(res.ranks) == len(memory) == 4096 and res.classes[3] == tuple(range(3, 4096, 4))
    assert res.busy[4095] == res.busy[3] and memory[4094].figures == memory[2].figures
    assert plan.programs[4093].instrs[0].peer != plan.programs[1].instrs[0].peer  # its own peer


def _reference_classes(dag: TrainingDAG, world: int) -> dict[int, tuple[int, ...]]:
    """Colour refinement written plainly, rank by rank (what ``rank_classes`` computes with tensors)."""
    from collections import Counter

    from piper_compile.ir.ops.p2p import PointToPoint

    groups = list(dict.fromkeys(n.devices for n in dag))
    color = [tuple(g for g, d in enumerate(groups) if r in d) for r in range(world)]
    ties = list(dict.fromkeys((n.kind, n.stream, n.devices, n.op.pairs(n)) for n in dag
                              if isinstance(n.op, PointToPoint)))
    subs = list(dict.fromkeys(n.op.subgroups for n in dag if getattr(n.op, "subgroups", None)))
    p2p = [[(t, dict(zip(d, p))[r]) for t, (_, _, d, p) in enumerate(ties) if r in d] for r in range(world)]
    static = [tuple((t, p > r, next(u for u, q in p2p[r] if q == p)) for t, p in p2p[r]) for r in range(world)]
    while True:
        sub = [[tuple(sorted(Counter(color[m] for m in g).items())) for g in s] for s in subs]
        new = [(color[r], static[r], tuple(color[p] for _, p in p2p[r]),
                tuple(sub[k][i] for k, s in enumerate(subs) for i, g in enumerate(s) if r in g)) for r in range(world)]
        if len(set(new)) == len(set(color)):
            break
        color = new
    out: dict[int, list[int]] = {}
    for r in range(world):
        out.setdefault(min(q for q in range(world) if color[q] == color[r]), []).append(r)
    return {rep: tuple(rs) for rep, rs in out.items()}


@pytest.mark.parametrize("seed", range(40))
def test_rank_classes_equal_plain_colour_refinement(seed):
    """Random groups, pairings and subgroups: the tensor version finds the partition a plain rank-by-rank
    refinement finds."""
    from piper_compile.ir.ops import TpCollective

    g = torch.Generator().manual_seed(seed)
    world = int(torch.randint(2, 13, (1,), generator=g))

    def group(size: int) -> tuple[int, ...]:
        return tuple(sorted(torch.randperm(world, generator=g)[:size].tolist()))

    dag = TrainingDAG()
    used: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for i in range(int(torch.randint(1, 7, (1,), generator=g))):
        size = int(torch.randint(1, world // 2 + 1, (1,), generator=g))
        reuse = used and torch.rand((), generator=g) < 0.5  # the same groups, paired again: shared peers
        a, b = used[int(torch.randint(len(used), (1,), generator=g))] if reuse else (group(size), group(size))
        used.append((a, b))
        size = len(a)
        dst = tuple(b[j] for j in torch.randperm(size, generator=g).tolist())
        dag.add(Node(f"f{i}", Segment("f"), devices=a, outputs=(f"x{i}",)))
        dag.add(Node(f"s{i}", Send(f"m{i}", dst), devices=a, stream="pp", inputs=(f"x{i}",)))
        dag.add(Node(f"r{i}", Recv(f"m{i}", tuple(a[dst.index(r)] for r in b)), devices=b, stream="pp",
                     outputs=(f"y{i}",)))
        if torch.rand((), generator=g) < 0.4:
            perm = torch.randperm(world, generator=g).tolist()
            k = int(torch.randint(1, 4, (1,), generator=g))
            subs = tuple(tuple(sorted(perm[j:j + k])) for j in range(0, world, k))
            dag.add(Node(f"tp{i}", TpCollective("all_reduce", subs), devices=tuple(range(world)), stream="tp",
                         inputs=(f"y{i}",)))
    assert rank_classes(dag, world).classes == _reference_classes(dag, world)


def test_ranks_whose_steps_share_a_peer_differ_from_those_whose_do_not():
    """Ranks 0-2 send two messages each to ranks 3-5 on one stream, the second pairing a permutation with a
    fixed point: rank 0 sends both to rank 3 (one channel), ranks 1 and 2 to two ranks each. Every group,
    pairing and peer class is alike, only the channels differ, and that splits the classes."""
    dag = TrainingDAG()
    for i, dst in enumerate([(3, 4, 5), (3, 5, 4)]):
        dag.add(Node(f"s{i}", Send(f"m{i}", dst), devices=(0, 1, 2), stream="pp"))
        dag.add(Node(f"r{i}", Recv(f"m{i}", tuple((0, 1, 2)[dst.index(r)] for r in (3, 4, 5))), devices=(3, 4, 5),
                     stream="pp"))
    assert rank_classes(dag, 6).classes == _reference_classes(dag, 6) == {0: (0,), 1: (1, 2), 3: (3,), 4: (4, 5)}


def test_rows_whose_hashes_collide_are_still_told_apart():
    """``_classes_of`` groups rows by a hash; two different rows with the same hash go to the exact sort."""
    from piper_compile.plan.symmetry import _classes_of

    w = torch.randint(-(2**62), 2**62, (2,), generator=torch.Generator().manual_seed(0)) | 1
    rows = torch.stack([torch.zeros(2, dtype=torch.long), torch.stack([w[1], -w[0]]), torch.zeros(2, dtype=torch.long)])
    assert int((rows[1] * w).sum()) == 0  # the same hash as the zero row
    inv, count = _classes_of(rows)
    assert count == 2 and inv[0] == inv[2] != inv[1]
