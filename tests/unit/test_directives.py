"""Directive parsing and validation: builders, JSON sources, and one error per kind of malformed directive."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import piper_compile as piper
from piper_compile import PiperDirectiveError
from piper_compile.directives.spec import (
    Order, Place, Replicate, Split, filter_matches, load_directives, parse_directive, parse_directives,
)

VALID = {"op": "split", "num_microbatches": 2}


def _error(directive: Any, index: int = 1) -> str:
    """Parse ``[VALID, ..., directive]`` with ``directive`` at ``index``; return the error message."""
    with pytest.raises(PiperDirectiveError) as ei:
        parse_directives([VALID] * index + [directive])
    msg = str(ei.value)
    assert msg.startswith("piper:"), msg
    assert f"directive #{index} " in msg, msg
    assert "Fix:" in msg and ".. Fix:" not in msg, msg
    assert ei.value.index == index
    return msg


# -- builders and sources ----------------------------------------------------------------------------
def test_builders_produce_dicts_that_parse() -> None:
    raw = [
        piper.place({"PP": 0}, [0, 2], stream="p2p"),
        piper.split(4),
        piper.replicate({"PP": "*"}, [0, 2], bucket_mb=10),
        piper.order({"PP": 0, "MB": 0, "PASS": "F"}, [{"PP": 0, "MB": 1, "PASS": "F"}, {"PP": 0, "MB": 0,
                                                                                       "PASS": "B"}]),
    ]
    assert all(isinstance(d, dict) for d in raw)
    json.dumps(raw)  # plain JSON
    place, split, rep, order = parse_directives(raw)
    assert isinstance(place, Place) and place.filter == {"PP": 0} and place.devices == (0, 2)
    assert place.stream == "p2p"
    assert isinstance(split, Split) and split.num_microbatches == 4 and split.dim_name == "MB" and split.dim == 0
    assert isinstance(rep, Replicate) and rep.devices == (0, 2) and rep.bucket_size == 10.0 and rep.zero == 0
    assert rep.filter == {"PP": "*"}
    assert isinstance(order, Order) and len(order.filters) == 2 and len(order.filters[1]) == 2
    assert [d.index for d in (place, split, rep, order)] == [0, 1, 2, 3]


def test_to_json_round_trips() -> None:
    raw = [*piper.pipeline(2, [[0, 1], [2, 3]]), piper.split(3, dim_name="CHUNK"), piper.replicate(zero=0),
           *piper.schedules.one_f_one_b(2, 3, mb_tag="CHUNK")]
    parsed = parse_directives(raw)
    again = parse_directives([d.to_json() for d in parsed])
    assert parsed == again


def test_pipeline_builder() -> None:
    assert piper.pipeline(2) == [piper.place({"PP": 0}, [0]), piper.place({"PP": 1}, [1])]
    assert piper.pipeline(2, [[0, 2], [1, 3]], tag="ST")[1] == piper.place({"ST": 1}, [1, 3])
    for bad in (lambda: piper.pipeline(0), lambda: piper.pipeline(2, [0])):
        with pytest.raises(PiperDirectiveError, match="Fix:"):
            bad()


def test_nested_lists_are_flattened() -> None:
    parsed = parse_directives([piper.pipeline(2), piper.split(2), piper.schedules.gpipe(2, 2)])
    assert [type(d).__name__ for d in parsed] == ["Place", "Place", "Split", "Order", "Order"]
    assert [d.index for d in parsed] == [0, 1, 2, 3, 4]


def test_json_file_path_is_accepted(tmp_path: Path) -> None:
    raw = [*piper.pipeline(2), piper.split(4), *piper.schedules.gpipe(2, 4)]
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(raw))
    assert parse_directives(str(path)) == parse_directives(raw)
    assert parse_directives(path) == parse_directives(raw)  # os.PathLike too
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"directives": raw}))
    assert parse_directives(str(wrapped)) == parse_directives(raw)


def test_json_text_and_list_are_accepted() -> None:
    raw = [piper.place({"PP": 0}, [0]), piper.split(2)]
    assert parse_directives(json.dumps(raw)) == parse_directives(raw)
    assert parse_directives(tuple(raw)) == parse_directives(raw)
    assert parse_directives(None) == [] and parse_directives([]) == []


def test_records_are_accepted() -> None:
    rec = Place(filter={"PP": 1}, devices=(1,))
    d = parse_directive(5, rec)
    assert d == rec and d.index == 5


def test_prototype_aliases() -> None:
    (p,) = parse_directives([{"op": "place", "filter": {"PP": 0}, "device": 3}])
    assert p.devices == (3,)
    (r,) = parse_directives([{"op": "replicate", "filter": {}, "bucket_mb": 4}])
    assert r.bucket_size == 4.0


def test_filter_values_are_normalised() -> None:
    (p,) = parse_directives([{"op": "place", "filter": {"PP": "1", "EP": "*", "PASS": "BW"}, "devices": [0]}])
    assert p.filter == {"PP": 1, "EP": "*", "PASS": "BW"}


def test_filter_matches() -> None:
    tags = {"PP": 1, "MB": 0, "PASS": "F"}
    assert filter_matches({}, tags)
    assert filter_matches({"PP": 1}, tags) and filter_matches({"PP": "*", "PASS": "F"}, tags)
    assert not filter_matches({"PP": 0}, tags)
    assert not filter_matches({"EP": "*"}, tags)  # a missing tag never matches, not even "*"


# -- source-level errors (no index) --------------------------------------------------------------------
def test_bad_json_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[{\"op\": ")
    with pytest.raises(PiperDirectiveError, match="not valid JSON") as ei:
        parse_directives(str(path))
    assert str(ei.value).startswith("piper:") and "Fix:" in str(ei.value)


def test_missing_file_is_neither_file_nor_json() -> None:
    with pytest.raises(PiperDirectiveError, match="neither an existing JSON file nor JSON text"):
        parse_directives("/nonexistent/schedule.json")


@pytest.mark.parametrize("source", [42, {"op": "split"}, "{\"op\": \"split\"}", "7"])
def test_directives_must_be_a_list(source: Any) -> None:
    with pytest.raises(PiperDirectiveError, match="must be a list") as ei:
        parse_directives(source)
    assert str(ei.value).startswith("piper:") and "Fix:" in str(ei.value)


def test_load_directives_passes_items_through() -> None:
    assert load_directives([1, [2, 3]]) == [1, 2, 3]


# -- per-directive errors --------------------------------------------------------------------------------
def test_unknown_op() -> None:
    msg = _error({"op": "plase", "filter": {}})
    assert "unknown op 'plase'" in msg and "place" in msg


def test_missing_op() -> None:
    assert "'op' must be a string, got None" in _error({"filter": {}})


def test_future_op_is_not_built_yet() -> None:
    assert "not built yet" in _error({"op": "stream", "filter": {"PP": "*"}})


@pytest.mark.parametrize("op", [["place"], {"name": "place"}])
def test_op_of_wrong_json_type(op: Any) -> None:
    _error({"op": op, "filter": {}, "devices": [0]})


@pytest.mark.parametrize("directive", [5, "place", ["op", "place"], None])
def test_directive_not_an_object(directive: Any) -> None:
    assert "must be a JSON object" in _error(directive)


def test_num_microbatches_as_string() -> None:
    msg = _error({"op": "split", "num_microbatches": "4"})
    assert "'num_microbatches'" in msg and "'4'" in msg and "str" in msg


@pytest.mark.parametrize("value", [True, 2.0, None, [4]])
def test_num_microbatches_wrong_type(value: Any) -> None:
    assert "'num_microbatches'" in _error({"op": "split", "num_microbatches": value})


@pytest.mark.parametrize("value", [0, -2])
def test_num_microbatches_not_positive(value: int) -> None:
    assert "num_microbatches must be >= 1" in _error({"op": "split", "num_microbatches": value})


def test_split_missing_count_and_bad_dim() -> None:
    assert "needs 'num_microbatches'" in _error({"op": "split"})
    assert "dim 1" in _error({"op": "split", "num_microbatches": 2, "dim": 1})
    assert "'dim_name'" in _error({"op": "split", "num_microbatches": 2, "dim_name": 3})


@pytest.mark.parametrize("devices", [0, "0,1", {"0": 1}, [], [0, "1"], [0, 1.0], [True]])
def test_devices_not_a_list_of_ranks(devices: Any) -> None:
    msg = _error({"op": "place", "filter": {"PP": 0}, "devices": devices})
    assert "'devices' must be a non-empty list of rank numbers" in msg


def test_place_needs_devices() -> None:
    assert "needs 'devices'" in _error({"op": "place", "filter": {"PP": 0}})


def test_place_stream_must_be_a_string() -> None:
    assert "'stream'" in _error({"op": "place", "filter": {}, "devices": [0], "stream": 1})


@pytest.mark.parametrize("flt", [[{"PP": 0}], "PP=0", 0, None])
def test_filter_not_a_dict(flt: Any) -> None:
    assert "filter must be a JSON object" in _error({"op": "place", "filter": flt, "devices": [0]})


@pytest.mark.parametrize("value", [1.5, None, [0], {"a": 1}, True])
def test_filter_value_wrong_type(value: Any) -> None:
    assert "tag 'PP'" in _error({"op": "split", "num_microbatches": 2, "filter": {"PP": value}})


@pytest.mark.parametrize("value", ["X", "f", "FB", 0, None])
def test_bad_pass_value(value: Any) -> None:
    msg = _error({"op": "place", "filter": {"PASS": value}, "devices": [0]})
    assert "PASS=" in msg and "BW" in msg


def test_bad_pass_value_inside_order() -> None:
    msg = _error({"op": "order", "filters": [[{"PP": 0, "PASS": "F"}], [{"PP": 0, "PASS": "W"}]]})
    assert "filters[1]" in msg and "PASS='W'" in msg


def test_filter_key_not_a_string() -> None:
    assert "key 0 is not a string" in _error({"op": "place", "filter": {0: 1}, "devices": [0]})


@pytest.mark.parametrize("zero", [4, -1, 9])
def test_zero_out_of_range(zero: int) -> None:
    assert f"zero must be 0, 1, 2 or 3, got {zero}" in _error({"op": "replicate", "filter": {}, "zero": zero})


@pytest.mark.parametrize("zero", ["1", 1.0, True])
def test_zero_wrong_type(zero: Any) -> None:
    assert "'zero'" in _error({"op": "replicate", "filter": {}, "zero": zero})


@pytest.mark.parametrize("raw,zero", [({"zero": 1}, 1), ({"zero": 3}, 3), ({"shard_grads": True}, 2),
                                      ({"shard_params": True}, 3), ({"zero": 1, "shard_grads": True}, 2)])
def test_prototype_shard_flags_map_to_zero_stages(raw: dict, zero: int) -> None:
    (d,) = parse_directives([{"op": "replicate", "filter": {}, **raw}])
    assert d.zero == zero


def test_negative_prefetch() -> None:
    assert "prefetch must be >= 0" in _error({"op": "replicate", "filter": {}, "zero": 3, "prefetch": -1})


def test_negative_rank() -> None:
    assert "negative rank" in _error({"op": "place", "filter": {"PP": 0}, "devices": [0, -1]})
    assert "negative rank" in _error({"op": "replicate", "filter": {}, "devices": [-2]})


def test_duplicate_rank() -> None:
    msg = _error({"op": "place", "filter": {"PP": 0}, "devices": [1, 0, 1]})
    assert "lists a rank twice" in msg
    assert "lists a rank twice" in _error({"op": "replicate", "filter": {}, "devices": [2, 2]})


@pytest.mark.parametrize("value", [0, -5])
def test_bucket_size_not_positive(value: float) -> None:
    assert "must be > 0 MB" in _error({"op": "replicate", "filter": {}, "bucket_size": value})


def test_bucket_size_wrong_type() -> None:
    assert "'bucket_mb'" in _error({"op": "replicate", "filter": {}, "bucket_mb": "25"})


def test_replicate_stream_wrong_type() -> None:
    assert "'reduce_stream'" in _error({"op": "replicate", "filter": {}, "reduce_stream": ["dp"]})


def test_unknown_field() -> None:
    msg = _error({"op": "split", "num_microbatches": 2, "microbatches": 2})
    assert "unknown field(s) ['microbatches']" in msg


@pytest.mark.parametrize("filters", [None, [], {"PP": 0}, "x"])
def test_order_needs_a_list_of_groups(filters: Any) -> None:
    assert "order needs 'filters'" in _error({"op": "order", "filters": filters})


@pytest.mark.parametrize("group", [[], "PP", 3, None])
def test_order_group_not_a_list_of_filters(group: Any) -> None:
    assert "filters[1] must be a non-empty list" in _error({"op": "order", "filters": [[{"PP": 0}], group]})


def test_order_accepts_bare_filters_as_groups() -> None:
    (o,) = parse_directives([{"op": "order", "filters": [{"PP": 0, "MB": 0}, [{"PP": 0, "MB": 1}]]}])
    assert o.filters == (({"PP": 0, "MB": 0},), ({"PP": 0, "MB": 1},))


def test_error_shows_the_directive_json() -> None:
    msg = _error({"op": "split", "num_microbatches": "4"}, index=3)
    assert '"num_microbatches": "4"' in msg and '"op": "split"' in msg
    assert msg.startswith("piper: directive #3 {")


def test_reduce_per_microbatch_needs_sharded_gradients() -> None:
    assert "needs zero >= 2" in _error({"op": "replicate", "filter": {}, "zero": 1, "reduce_per_microbatch": True})
    (d,) = parse_directives([piper.replicate(zero=3, reduce_per_microbatch=True)])
    assert d.reduce_per_microbatch and d.zero == 3


def test_bucket_size_is_per_replicate_directive() -> None:
    """Each replicate directive's bucket_size cuts the backward of the regions it matches: a tiny bucket
    on stage 0 gives it several gradient all-reduces while stage 1's large bucket keeps one (before,
    the smallest bucket_size of all directives applied to every region)."""
    import torch

    from piper_compile.ir.ops import GradReduce
    from piper_compile.testing.models import build_model

    model = build_model("gpt", layers=2, dim=16, heads=2, seq=8)
    model.annotate_stages(2)
    batch = model.make_batch(4, torch.Generator().manual_seed(0))
    directives = [*piper.pipeline(2, ranks=[[0, 2], [1, 3]]), piper.replicate({"PP": 0}, bucket_mb=0.001),
                  piper.replicate({"PP": 1}, bucket_mb=100)]
    p = piper.plan(model, *batch, directives=directives, world_size=4)
    reduces = [n for n in p.dag if isinstance(n.op, GradReduce)]
    per_group = {g: sum(n.devices == g for n in reduces) for g in ((0, 2), (1, 3))}
    assert per_group[(0, 2)] > 1 and per_group[(1, 3)] == 1, per_group
