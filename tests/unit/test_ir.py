"""TrainingDAG / Node: text form round trip, cycles, topological order, producers."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from piper_compile.ir.dag import Kind, Node, TrainingDAG, format_tags, make_tags, parse_dag, parse_node
from piper_compile.ir.meta import DagMeta, ExpertShard, TensorParallelSpec, ZeroGroup
from piper_compile.ir.ops import (OPS, ExpertA2A, ExpertCounts, ExpertStep, GradReduce, LossReduce, NormReduce,
                                  ParamGather, Recv, RecvPart, Segment, Send, SequenceChunk, TpCollective,
                                  Update)

_SEG = Segment("seg")
_OPS_SAMPLE = [_SEG, Segment("F.PP0", "0", loss="l"), Send("m", (1,)), Recv("m", (0,), ("s0", 2), "float32"),
               GradReduce("b0", ("w",), level=2, scatter=True), Update(("w",)), TpCollective("all_reduce", ((0, 1),))]


def _attrs(**kw: object) -> tuple:
    return tuple(sorted(kw.items()))


def _all_kinds_dag() -> TrainingDAG:
    """One node of every op (so every Kind), with int and str tags and attrs holding nested tuples."""
    dag = TrainingDAG()
    f0 = dag.add(Node("F.PP0.mb0", Segment("F.PP0", "0", loss="loss@mb0",
                                           grads=(("t_1@mb0", "layers.0.weight"), ("t_2@mb0", "layers.0.bias"))),
                      make_tags({"PP": 0, "MB": 0, "PASS": "F"}), (0,), "compute",
                      ("input:x@mb0", "param:layers.0.weight", "symexpr:s77//2"), ("tanh@mb0", "loss@mb0"),
                      _attrs(mb=0, replicate_index=1)))
    send = dag.add(Node("SEND.tanh@mb0>r1", Send("tanh@mb0>r1", (1,), mb=0), f0.tags, (0,), "pp_fwd",
                        ("tanh@mb0",), ()))
    recv = dag.add(Node("RECV.tanh@mb0>r1", Recv("tanh@mb0>r1", (0,), ("s77", "32"), "float32", mb=0), f0.tags,
                        (1,), "pp_fwd", (), ("tanh@mb0>r1",)))
    dag.add(Node("SEND.part:w.r1>r0", Send("part:w.r1>r0", (0,), state="w"), (), (1,), "pp_grad"))
    dag.add(Node("RECV.part:w.r1>r0", RecvPart("part:w.r1>r0", (1,), state="w"), (), (0,), "pp_grad"))
    b1 = dag.add(Node("B.PP1.mb0", Segment("B.PP1", "1"), make_tags({"PP": 1, "MB": 0, "PASS": "B"}), (1,),
                      "compute", ("tanh@mb0>r1", "tangent"), ("g@mb0",), _attrs(mb=0)))
    ar = dag.add(Node("AR.r0_1.b0", GradReduce("b0", ("a.weight", "a.bias")), make_tags({"BUCKET": 0}), (0, 1),
                      "dp", (), (), _attrs(bucket_mb=25.0)))
    rs = dag.add(Node("RS.b0", TpCollective("reduce_scatter", ((0, 1),), ("s0", 4), "float32", dim=1, size=2),
                      (("BUCKET", 0), ("ZERO", "z2")), (0, 1), "dp", ("g@mb0",), ("g_shard",),
                      _attrs(nested=((1, (2, 3)), ("a", ("b", ("c",)))), empty=())))
    ag = dag.add(Node("AG.b0", ParamGather("b0", ("a.weight",), 3, for_step="F.PP0.mb0"), (), (0, 1), "dp_gather",
                      ("g_shard",), ("g_full",), _attrs(flag=True, none=None, neg=-3)))
    cnt = dag.add(Node("CNT.ep", ExpertCounts(4, mb=1), (), (0, 1), "ep_counts", ("g_full",), ("counts",)))
    a2a = dag.add(Node("A2A.ep", ExpertA2A("dispatch", 4, ("n", 16), "float32"), make_tags({"EP": "experts"}),
                       (0, 1), "ep", ("g_full", "counts"), ("routed",), _attrs(counts=((1, 2), (3, 4)))))
    exp = dag.add(Node("E.ep", ExpertStep("experts", "E.ep", grads=(("gw", "moe.w_up"),), accumulate=True),
                       (), (0,), "compute", ("routed",), ("expert_out",)))
    chunk = dag.add(Node("CH.sp", SequenceChunk("CH.sp", 1, 2, ((0, 1),)), (), (0, 1), "compute", ("g_full",),
                         ("chunk",)))
    loss = dag.add(Node("AR.loss", LossReduce((0, 1)), (), (0, 1), "loss", (), ()))
    norm = dag.add(Node("AR.gradnorm", NormReduce(1.0), (), (0, 1), "norm", (), ()))
    upd = dag.add(Node("UPD.r0", Update(("layers.0.weight",), norm_params=("layers.0.weight",)),
                       make_tags({"PP": -1}), (0,), "compute", ("routed",), ()))
    dag.add_order(f0.name, send.name)
    dag.add_order(recv.name, b1.name)
    dag.add_order(ar.name, rs.name)
    dag.add_order(ag.name, a2a.name)
    dag.add_order(cnt.name, exp.name)
    dag.add_order(chunk.name, loss.name)
    dag.add_order(norm.name, upd.name)
    return dag


def _assert_same(a: TrainingDAG, b: TrainingDAG) -> None:
    assert list(a.nodes) == list(b.nodes)
    for name in a.nodes:
        assert a.nodes[name] == b.nodes[name], name
    assert a.order_edges == b.order_edges


def test_every_op_and_kind_is_covered_by_the_round_trip_dag() -> None:
    dag = _all_kinds_dag()
    assert {type(n.op) for n in dag} == set(OPS.values())
    assert {n.kind for n in dag} == set(Kind)


def test_dag_text_round_trip_every_kind() -> None:
    dag = _all_kinds_dag()
    text = dag.to_text()
    back = parse_dag(text)
    _assert_same(dag, back)
    assert back.to_text() == text


def test_round_trip_keeps_tag_value_types_and_nested_tuple_attrs() -> None:
    back = parse_dag(_all_kinds_dag().to_text())
    f0 = back.nodes["F.PP0.mb0"]
    assert f0.tag("PP") == 0 and isinstance(f0.tag("PP"), int)
    assert f0.tag("PASS") == "F"
    assert f0.op.grads == (("t_1@mb0", "layers.0.weight"), ("t_2@mb0", "layers.0.bias"))
    assert f0.attr("replicate_index") == 1
    rs = back.nodes["RS.b0"]
    assert rs.tag("ZERO") == "z2"
    assert rs.attr("nested") == ((1, (2, 3)), ("a", ("b", ("c",))))
    assert rs.attr("empty") == ()
    assert back.nodes["UPD.r0"].tag("PP") == -1
    assert back.nodes["AG.b0"].attr("none") is None and back.nodes["AG.b0"].attr("flag") is True
    assert back.nodes["AR.r0_1.b0"].attr("bucket_mb") == 25.0
    assert back.nodes["RECV.tanh@mb0>r1"].op.shape == ("s77", "32")
    assert back.nodes["CH.sp"].op.subgroups == ((0, 1),) and back.nodes["AG.b0"].op.for_step == "F.PP0.mb0"
    assert back.nodes["A2A.ep"].tag_dict == {"EP": "experts"}


def test_node_text_round_trip_of_a_bare_node() -> None:
    n = Node("x", _SEG)
    line = n.to_text()
    assert line.startswith("COMPUTE x ") and "\n" not in line
    assert parse_node(line) == n


def test_parse_dag_ignores_blank_lines_and_reads_order_lines() -> None:
    dag = TrainingDAG()
    dag.add(Node("a", _SEG, devices=(0,)))
    dag.add(Node("b", _SEG, devices=(0,)))
    dag.add_order("a", "b")
    text = "\n" + dag.to_text() + "\n\n"
    back = parse_dag(text)
    _assert_same(dag, back)
    assert "ORDER a -> b" in dag.to_text()


def test_format_tags() -> None:
    text = format_tags(make_tags({"PP": 1, "MB": 3, "PASS": "F"}))
    assert text.index("MB") < text.index("PASS") < text.index("PP")  # canonical (sorted) order
    assert "3" in text and "F" in text
    assert format_tags({}) != format_tags({"PP": 0})
    assert make_tags({"b": 1, "a": "x"}) == (("a", "x"), ("b", 1))


@pytest.mark.parametrize("value", ["k:v", "-", "x-1", "3", "-1", "a b", "a,b", " attrs=", "{}", "é"])
def test_round_trip_of_str_tags_that_look_like_ints_or_hold_separators(value: str) -> None:
    """Tag values come from user annotations (``piper.annotate(m, EP=...)``): any string must survive."""
    n = Node("x", _SEG, make_tags({"EP": value, "PP": 1}))
    back = parse_node(n.to_text())
    assert back == n and back.tag("EP") == value and back.tag("PP") == 1


# -- hypothesis: random nodes over the characters the text form allows --------------------------
_ident = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=6)
_value_name = st.text(alphabet="abcdefxyz_.@>:0123456789", min_size=1, max_size=10).filter(lambda s: s != "-")
_tag_value = st.integers(-5, 50) | st.text(max_size=6)
_attr_leaf = st.integers(-10, 10) | st.text(max_size=5) | st.booleans() | st.none()
_attr_value = st.recursive(_attr_leaf, lambda c: st.lists(c, max_size=3).map(tuple), max_leaves=6)


@st.composite
def _nodes(draw: st.DrawFn) -> list[Node]:
    names = draw(st.lists(_ident, min_size=1, max_size=6, unique=True))
    out = []
    for name in names:
        out.append(Node(
            name=name,
            op=draw(st.sampled_from(_OPS_SAMPLE)),
            tags=make_tags(draw(st.dictionaries(_ident, _tag_value, max_size=3))),
            devices=tuple(draw(st.lists(st.integers(0, 7), max_size=3, unique=True))),
            stream=draw(_ident),
            inputs=tuple(draw(st.lists(_value_name, max_size=3))),
            outputs=tuple(draw(st.lists(_value_name, max_size=3))),
            attrs=tuple(sorted(draw(st.dictionaries(_ident, _attr_value, max_size=3)).items())),
        ))
    return out


@settings(max_examples=80, deadline=None)
@given(_nodes(), st.data())
def test_random_dag_text_round_trip(nodes: list[Node], data: st.DataObject) -> None:
    dag = TrainingDAG()
    for n in nodes:
        dag.add(n)
    names = list(dag.nodes)
    for a, b in data.draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(names)), max_size=5)):
        dag.add_order(a, b)
    _assert_same(dag, parse_dag(dag.to_text()))


# -- cycles, topological order, producers ------------------------------------------------------
def _chain(*names: str) -> TrainingDAG:
    """a -> b -> c ... by data edges (each node consumes the previous one's output)."""
    dag = TrainingDAG()
    prev: tuple[str, ...] = ()
    for n in names:
        dag.add(Node(n, _SEG, inputs=prev, outputs=(f"v_{n}",)))
        prev = (f"v_{n}",)
    return dag


def _is_cycle(dag: TrainingDAG, cycle: list[str]) -> bool:
    preds = dag.predecessors()
    return len(cycle) >= 2 and cycle[0] == cycle[-1] and all(a in preds[b] for a, b in zip(cycle, cycle[1:]))


def test_find_cycle_none_on_acyclic() -> None:
    dag = _chain("a", "b", "c")
    dag.add_order("a", "c")
    assert dag.find_cycle() is None


def test_find_cycle_through_order_edge() -> None:
    dag = _chain("a", "b", "c")
    dag.add_order("c", "a")
    cycle = dag.find_cycle()
    assert cycle is not None and _is_cycle(dag, cycle)
    assert set(cycle) == {"a", "b", "c"}


def test_find_cycle_through_data_edges_only() -> None:
    dag = TrainingDAG()
    dag.add(Node("x", _SEG, inputs=("vy",), outputs=("vx",)))
    dag.add(Node("y", _SEG, inputs=("vx",), outputs=("vy",)))
    dag.add(Node("z", _SEG, inputs=("vx",)))
    cycle = dag.find_cycle()
    assert cycle is not None and _is_cycle(dag, cycle)
    assert set(cycle) == {"x", "y"}


def test_find_cycle_self_loop_by_data() -> None:
    dag = TrainingDAG()
    dag.add(Node("s", _SEG, inputs=("v",), outputs=("v",)))
    assert dag.find_cycle() == ["s", "s"]


def test_add_order_ignores_self_edges() -> None:
    dag = _chain("a")
    dag.add_order("a", "a")
    assert dag.order_edges == set()
    assert dag.find_cycle() is None


def test_topo_order_default_is_insertion_order_among_ready() -> None:
    dag = TrainingDAG()
    for n in ("c", "a", "b"):
        dag.add(Node(n, _SEG))
    assert dag.topo_order() == ["c", "a", "b"]
    dag.add_order("b", "c")
    assert dag.topo_order() == ["a", "b", "c"]


def test_topo_order_with_key_respects_edges_and_key() -> None:
    dag = TrainingDAG()
    # two independent chains; key prefers the "B" chain whenever both are ready
    dag.add(Node("F0", _SEG, make_tags({"PASS": "F"}), outputs=("f0",)))
    dag.add(Node("F1", _SEG, make_tags({"PASS": "F"}), inputs=("f0",), outputs=("f1",)))
    dag.add(Node("B0", _SEG, make_tags({"PASS": "B"}), outputs=("b0",)))
    dag.add(Node("B1", _SEG, make_tags({"PASS": "B"}), inputs=("b0",)))
    first_b = dag.topo_order(key=lambda n: 0 if n.tag("PASS") == "B" else 1)
    assert first_b == ["B0", "B1", "F0", "F1"]
    first_f = dag.topo_order(key=lambda n: 0 if n.tag("PASS") == "F" else 1)
    assert first_f == ["F0", "F1", "B0", "B1"]
    # an order edge overrides the key
    dag.add_order("F1", "B0")
    assert dag.topo_order(key=lambda n: 0 if n.tag("PASS") == "B" else 1) == ["F0", "F1", "B0", "B1"]


def test_topo_order_raises_on_cycle_and_names_it() -> None:
    dag = _chain("a", "b")
    dag.add_order("b", "a")
    with pytest.raises(ValueError, match="cycle") as ei:
        dag.topo_order()
    assert "a" in str(ei.value) and "b" in str(ei.value)


def test_producers_and_consumers() -> None:
    dag = _chain("a", "b", "c")
    assert dag.producers() == {"v_a": "a", "v_b": "b", "v_c": "c"}
    assert dict(dag.consumers()) == {"v_a": ["b"], "v_b": ["c"]}
    assert sorted(dag.data_edges()) == [("a", "b", "v_a"), ("b", "c", "v_b")]
    dag.add(Node("d", _SEG, inputs=("param:w", "v_c")))
    assert dag.external_values() == {"param:w"}


def test_producers_raise_on_value_produced_twice() -> None:
    dag = _chain("a")
    dag.add(Node("a2", _SEG, outputs=("v_a",)))
    with pytest.raises(ValueError, match="v_a") as ei:
        dag.producers()
    assert "a" in str(ei.value) and "a2" in str(ei.value)


def test_add_duplicate_node_raises_and_remove_drops_order_edges() -> None:
    dag = _chain("a", "b", "c")
    with pytest.raises(ValueError, match="duplicate"):
        dag.add(Node("a", _SEG))
    dag.add_order("a", "c")
    dag.remove("a")
    assert "a" not in dag.nodes and dag.order_edges == set()


def test_copy_is_independent() -> None:
    dag = _chain("a", "b")
    cp = dag.copy()
    cp.add(Node("z", _SEG))
    cp.add_order("a", "z")
    assert "z" not in dag.nodes and dag.order_edges == set()


def test_kind_flags() -> None:
    assert Kind.SEND.is_comm and not Kind.SEND.is_collective
    assert Kind.ALL_REDUCE.is_comm and Kind.ALL_REDUCE.is_collective
    assert not Kind.COMPUTE.is_comm and not Kind.UPDATE.is_comm
    assert {k for k in Kind if k.is_collective} == {Kind.ALL_REDUCE, Kind.REDUCE_SCATTER, Kind.ALL_GATHER,
                                                     Kind.ALL_TO_ALL}


def test_node_helpers() -> None:
    n = Node("F.PP1.mb3", Segment("F.PP1", "1"), make_tags({"PP": 1, "MB": 3, "PASS": "F"}),
             attrs=_attrs(region="PP1"))
    assert n.short() == "F1.mb3"
    assert n.tag("missing", 7) == 7 and n.attr("missing") is None
    m = n.with_attrs(z=1, a=2)
    assert [k for k, _ in m.attrs] == ["a", "region", "z"]
    assert n.with_op(label="7").short() == "F7.mb3" and n.op.label == "1"
    assert n.with_(stream="x").stream == "x" and n.stream == "compute"
    assert Node("SEND.v>r1", Send("v>r1", (1,)), devices=(0,)).short(peer=1) == "SEND.v->r1"


def test_dag_meta_round_trips_with_the_text_form() -> None:
    """Every field of the step's layout record prints with the DAG and parses back equal."""
    dag = _all_kinds_dag()
    dag.meta = DagMeta(split=4, mb_tag="mb", split_by=2, order_by={("F.PP0.mb0", "SEND.tanh@mb0>r1"): 3},
                       tp=TensorParallelSpec(5, ((0, 1), (2, 3)), "tp"), tp_size=2,
                       ep_params={"moe.w_up": ExpertShard((0, 1), 4, "ep")}, loss_group=(1,),
                       zero={(0, 1): ZeroGroup((0, 1), 3, "dp_gather", 2, True, [("r0_1.b0", ("a.weight", "a.bias"))],
                                              ["tied.weight"], ((0,), (1,)))})
    back = parse_dag(dag.to_text())
    assert back.meta == dag.meta
    assert back.to_text() == dag.to_text()
    assert dag.to_text().splitlines()[0].startswith("META {")


def test_fresh_meta_is_not_printed_and_a_copy_is_independent() -> None:
    dag = _all_kinds_dag()
    assert not dag.to_text().startswith("META")
    assert parse_dag(dag.to_text()).meta == DagMeta()
    copy = dag.copy()
    copy.meta.order_by[("a", "b")] = 1
    copy.meta.zero = {}
    assert dag.meta.order_by == {} and dag.meta.zero is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30), st.sampled_from([",", "_"]))
def test_rank_lists_round_trip_compactly(ranks: list[int], sep: str) -> None:
    from piper_compile.ir.ranks import compact, expand

    text = compact(tuple(ranks), sep)
    assert expand(text, sep) == tuple(ranks)
    assert len(text) <= len(sep.join(map(str, ranks)))


def test_rank_lists_write_runs_as_ranges() -> None:
    from piper_compile.ir.ranks import compact

    assert compact((0, 1)) == "0,1" and compact((0, 1), "_") == "0_1"  # two ranks stay a list
    assert compact((0, 1, 2, 3, 9)) == "0-3,9"
    assert compact(tuple(range(0, 16384, 8))) == "0-16376:8"
    assert compact((5, 3, 1, 2, 3)) == "5,3,1-3"  # order kept: it pairs the ranks of two groups


def test_long_rank_lists_in_op_fields_are_written_as_ranges() -> None:
    """A SEND to 2048 ranks and a TP collective over 1024 pairs round-trip with their rank lists as ranges."""
    dst = tuple(range(1, 16384, 8))
    subs = tuple((r, r + 1) for r in range(0, 2048, 2)) + (tuple(range(2048, 2080)),)
    dag = TrainingDAG()
    dag.add(Node("s", Send("m", dst), devices=tuple(range(0, 16384, 8)), stream="pp"))
    dag.add(Node("tp", TpCollective("all_reduce", subs), devices=tuple(range(2080)), stream="tp"))
    text = dag.to_text()
    assert '"dst":{"ranks":"1-16377:8"}' in text and '{"ranks":"2048-2079"}' in text and len(text) < 20000
    assert parse_dag(text).to_text() == text
    assert parse_dag(text).nodes["s"].op == dag.nodes["s"].op and parse_dag(text).nodes["tp"].op == dag.nodes["tp"].op
