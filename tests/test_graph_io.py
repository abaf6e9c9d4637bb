"""CostGraph JSON: lossless, deterministic, versioned round trip; malformed input refused."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chkpt_opt import zoo
from chkpt_opt.api import trace
from chkpt_opt.errors import ChkptOptError, GraphFormatError
from chkpt_opt.graphs import io as graph_io
from chkpt_opt.graphs.costgraph import (
    FORMAT_VERSION,
    MAX_BYTES,
    NODE_ATTRS,
    CostGraph,
    check_graph,
    new_graph,
    node_attrs,
    ordered_nodes,
)
from chkpt_opt.graphs.io import graph_to_dict, load_graph, save_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag

# ---- helpers --------------------------------------------------------------------------


def same_type(value: Any, other: Any) -> bool:
    # str subclasses (the tracer records torch.__version__, a TorchVersion) load as str
    if isinstance(value, str):
        return type(other) is str
    return type(other) is type(value)


def assert_same_graph(a: CostGraph, b: CostGraph) -> None:
    """Exact equality of node attrs, edges and graph attrs, including Python types."""
    assert a.graph == b.graph
    for key, value in a.graph.items():
        assert same_type(value, b.graph[key]), key
    assert set(a.nodes) == set(b.nodes)
    assert ordered_nodes(a) == ordered_nodes(b)
    for node in a.nodes:
        attrs_a, attrs_b = a.nodes[node], b.nodes[node]
        assert attrs_a == attrs_b, node
        for key, value in attrs_a.items():
            assert same_type(value, attrs_b[key]), (node, key)
            if isinstance(value, dict):
                assert list(value.items()) == list(attrs_b[key].items()), (node, key)
                for sid, nbytes in value.items():
                    assert same_type(nbytes, attrs_b[key][sid])
    assert set(a.edges) == set(b.edges)


def round_trip(graph: CostGraph, tmp_path: Path, name: str = "g.json") -> CostGraph:
    path = tmp_path / name
    save_graph(graph, path)
    return load_graph(path)


@pytest.fixture(scope="module")
def traced_mlp() -> CostGraph:
    model, args, kwargs = zoo.mlp(depth=3, width=16, batch=4)
    return trace(model, args, kwargs)


def valid_dict() -> dict[str, Any]:
    """The JSON form of a small graph with a view, an own buffer and a skip edge."""
    g = new_graph("tiny", param_bytes=64, trainable_param_bytes=64, input_bytes=16)
    g.add_node("a", **node_attrs(index=0, op="x.a", outputs={"a": 128}, grad_bytes=128))
    g.add_node(
        "v", **node_attrs(index=1, op="x.view", aliases=["a"], grad_bytes=128, bwd_grad_alias=True)
    )
    g.add_node(
        "b",
        **node_attrs(
            index=2,
            op="x.b",
            outputs={"b": 256},
            saved={"a": 128, "b:buf0": 32},
            grad_bytes=256,
            fwd_time_s=1e-3,
        ),
    )
    g.add_node(
        "c", **node_attrs(index=3, op="x.c", outputs={"c": 4}, saved={"b": 256}, grad_bytes=4)
    )
    g.add_edges_from([("a", "v"), ("v", "b"), ("b", "c"), ("a", "c")])
    g.graph["outputs"] = ["c"]
    check_graph(g)
    return graph_to_dict(g)


def node_entry(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(n for n in data["nodes"] if n["name"] == name)


def write(tmp_path: Path, data: Any, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def load_error(path: Path) -> str:
    with pytest.raises(GraphFormatError) as info:
        load_graph(path)
    return str(info.value)


# ---- lossless round trip ------------------------------------------------------------------


def test_round_trip_is_lossless_for_a_chain(tmp_path: Path) -> None:
    graph = chain_graph(12, activation_bytes=[1000 + 7 * i for i in range(12)], saves="output")
    loaded = round_trip(graph, tmp_path)
    assert_same_graph(graph, loaded)
    assert loaded.nodes["n5"]["outputs"] == {"n5": 1035}
    assert isinstance(loaded.nodes["n5"]["fwd_flops"], int)


def test_round_trip_is_lossless_for_a_random_dag(tmp_path: Path) -> None:
    graph = random_dag(40, seed=3)
    assert graph.number_of_edges() > graph.number_of_nodes() - 1  # has skip edges
    assert_same_graph(graph, round_trip(graph, tmp_path))


def test_round_trip_is_lossless_for_a_traced_model(traced_mlp: CostGraph, tmp_path: Path) -> None:
    loaded = round_trip(traced_mlp, tmp_path)
    assert_same_graph(traced_mlp, loaded)
    assert loaded.graph["tracer"] == traced_mlp.graph["tracer"]
    assert loaded.graph["param_bytes"] == 3 * (16 * 16 + 16) * 4
    # floats keep every bit
    for node in traced_mlp:
        assert loaded.nodes[node]["fwd_time_s"] == traced_mlp.nodes[node]["fwd_time_s"]


def test_round_trip_keeps_ints_as_ints(traced_mlp: CostGraph, tmp_path: Path) -> None:
    loaded = round_trip(traced_mlp, tmp_path)
    for _, attrs in loaded.nodes(data=True):
        for key in ("index", "output_bytes", "saved_bytes", "fwd_flops", "bwd_flops"):
            assert type(attrs[key]) is int
        for nbytes in [*attrs["outputs"].values(), *attrs["saved"].values()]:
            assert type(nbytes) is int
        assert type(attrs["fwd_time_s"]) is float
        assert type(attrs["is_view"]) is bool


def test_round_trip_keeps_large_exact_ints(tmp_path: Path) -> None:
    graph = chain_graph(2, activation_bytes=[2**53 + 1, 2**60])
    loaded = round_trip(graph, tmp_path)
    assert loaded.nodes["n0"]["outputs"]["n0"] == 2**53 + 1
    assert loaded.nodes["n1"]["output_bytes"] == 2**60


def test_round_trip_of_hand_built_graph_with_views_and_buffers(tmp_path: Path) -> None:
    graph = graph_io.graph_from_dict(valid_dict())
    loaded = round_trip(graph, tmp_path)
    assert_same_graph(graph, loaded)
    assert loaded.nodes["v"]["is_view"] is True
    assert loaded.nodes["v"]["aliases"] == ["a"]
    assert loaded.nodes["b"]["saved"] == {"a": 128, "b:buf0": 32}


def test_file_records_format_and_version(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    save_graph(chain_graph(3), path)
    data = json.loads(path.read_text())
    assert data["format"] == "chkpt_opt.costgraph"
    assert data["format_version"] == FORMAT_VERSION
    assert [n["name"] for n in data["nodes"]] == ["n0", "n1", "n2"]
    assert data["edges"] == [["n0", "n1"], ["n1", "n2"]]


@given(n=st.integers(min_value=0, max_value=60), seed=st.integers(min_value=0, max_value=10**6))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_random_dags_round_trip_losslessly(tmp_path: Path, n: int, seed: int) -> None:
    graph = random_dag(n, seed=seed)
    loaded = round_trip(graph, tmp_path, name=f"dag_{n}_{seed}.json")
    assert_same_graph(graph, loaded)
    assert loaded.number_of_nodes() == n


# ---- deterministic files ----------------------------------------------------------------


def test_saving_twice_gives_identical_bytes(traced_mlp: CostGraph, tmp_path: Path) -> None:
    save_graph(traced_mlp, tmp_path / "a.json")
    save_graph(traced_mlp, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_saving_a_loaded_graph_gives_identical_bytes(tmp_path: Path) -> None:
    save_graph(random_dag(30, seed=11), tmp_path / "a.json")
    save_graph(load_graph(tmp_path / "a.json"), tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_file_bytes_do_not_depend_on_node_insertion_order(tmp_path: Path) -> None:
    graph = random_dag(20, seed=5)
    shuffled = nx.DiGraph()
    shuffled.graph.update(copy.deepcopy(graph.graph))
    for node in reversed(list(graph.nodes)):
        shuffled.add_node(node, **copy.deepcopy(graph.nodes[node]))
    shuffled.add_edges_from(reversed(list(graph.edges)))
    save_graph(graph, tmp_path / "a.json")
    save_graph(shuffled, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


# ---- malformed files ------------------------------------------------------------------


def test_valid_dict_fixture_loads(tmp_path: Path) -> None:
    graph = load_graph(write(tmp_path, valid_dict()))
    assert ordered_nodes(graph) == ["a", "v", "b", "c"]


def test_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("this is not json", encoding="utf-8")
    message = load_error(path)
    assert "not valid JSON" in message and "line 1" in message


def test_truncated_json_is_refused(tmp_path: Path) -> None:
    text = json.dumps(valid_dict())
    path = tmp_path / "bad.json"
    path.write_text(text[: len(text) // 2], encoding="utf-8")
    message = load_error(path)
    assert "not valid JSON" in message and "truncated" in message


def test_non_utf8_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(b"\xff\xfe" + json.dumps(valid_dict()).encode())
    assert "UTF-8" in load_error(path)


@pytest.mark.parametrize("fmt", ["something.else", None, 1])
def test_wrong_format_is_refused(tmp_path: Path, fmt: Any) -> None:
    data = valid_dict()
    data["format"] = fmt
    message = load_error(write(tmp_path, data))
    assert "not a chkpt_opt cost graph" in message and '"chkpt_opt.costgraph"' in message


def test_json_array_is_refused(tmp_path: Path) -> None:
    assert "not a chkpt_opt cost graph" in load_error(write(tmp_path, [1, 2, 3]))


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 0, "1", None])
def test_other_format_version_is_refused_with_regenerate_advice(
    tmp_path: Path, version: Any
) -> None:
    data = valid_dict()
    data["format_version"] = version
    message = load_error(write(tmp_path, data))
    assert f"format_version {version!r}" in message
    assert f"reads version {FORMAT_VERSION}" in message
    assert "Regenerate" in message and "chkpt-opt trace" in message


def test_graph_attr_format_version_mismatch_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    data["graph"]["format_version"] = FORMAT_VERSION + 1
    message = load_error(write(tmp_path, data))
    assert "format_version" in message and "regenerate" in message.lower()


@pytest.mark.parametrize("field", ["graph", "nodes", "edges"])
def test_missing_top_level_field_is_refused(tmp_path: Path, field: str) -> None:
    data = valid_dict()
    del data[field]
    assert repr(field) in load_error(write(tmp_path, data))


@pytest.mark.parametrize("attr", ["saved_bytes", "outputs", "is_view", "index", "op"])
def test_missing_node_attribute_is_refused(tmp_path: Path, attr: str) -> None:
    data = valid_dict()
    del node_entry(data, "b")[attr]
    message = load_error(write(tmp_path, data))
    assert "'b'" in message and "lacks attributes" in message and repr(attr) in message


def test_missing_graph_attribute_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    del data["graph"]["param_bytes"]
    message = load_error(write(tmp_path, data))
    assert "'param_bytes'" in message and "must be an int" in message


def test_unknown_node_attribute_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    node_entry(data, "a")["colour"] = "red"
    assert "unknown attributes ['colour']" in load_error(write(tmp_path, data))


@pytest.mark.parametrize(
    ("attr", "value", "expected"),
    [
        ("output_bytes", "128", "must be an int"),
        ("fwd_flops", 1.5, "must be an int"),
        ("index", True, "must be an int"),
        ("fwd_time_s", "fast", "must be a number"),
        ("is_view", 0, "must be a bool"),
        ("op", 7, "must be a string"),
        ("aliases", "a", "list of storage ids"),
        ("saved", [["a", 128]], "map storage ids to bytes"),
    ],
)
def test_wrong_attribute_type_is_refused(
    tmp_path: Path, attr: str, value: Any, expected: str
) -> None:
    data = valid_dict()
    node_entry(data, "b")[attr] = value
    message = load_error(write(tmp_path, data))
    assert "'b'" in message and repr(attr) in message and expected in message


def test_string_byte_count_in_outputs_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    node_entry(data, "a")["outputs"] = {"a": "128"}
    message = load_error(write(tmp_path, data))
    assert "outputs['a']" in message and "must be an int" in message


def test_negative_bytes_are_refused(tmp_path: Path) -> None:
    data = valid_dict()
    node_entry(data, "b")["saved"] = {"a": -128, "b:buf0": 32}
    node_entry(data, "b")["saved_bytes"] = -96
    message = load_error(write(tmp_path, data))
    assert "-96" in message and "out of range" in message


def test_negative_graph_bytes_are_refused(tmp_path: Path) -> None:
    data = valid_dict()
    data["graph"]["input_bytes"] = -1
    assert "'input_bytes' = -1 is out of range" in load_error(write(tmp_path, data))


@pytest.mark.parametrize("value", [MAX_BYTES + 1, 2**64, 10**30])
def test_huge_byte_counts_are_refused(tmp_path: Path, value: int) -> None:
    data = valid_dict()
    node_entry(data, "a")["outputs"] = {"a": value}
    node_entry(data, "a")["output_bytes"] = value
    message = load_error(write(tmp_path, data))
    assert str(value) in message and "out of range" in message


def test_absurdly_long_int_literal_is_refused_as_format_error(tmp_path: Path) -> None:
    text = json.dumps(valid_dict()).replace('"output_bytes": 128', '"output_bytes": ' + "9" * 5000)
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(GraphFormatError):
        load_graph(path)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_constants_are_refused(tmp_path: Path, constant: str) -> None:
    text = json.dumps(valid_dict()).replace('"fwd_time_s": 0.001', f'"fwd_time_s": {constant}')
    assert constant in text
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    message = load_error(path)
    assert f"JSON constant {constant} is not allowed" in message


def test_overflowing_float_is_refused(tmp_path: Path) -> None:
    text = json.dumps(valid_dict()).replace('"fwd_time_s": 0.001', '"fwd_time_s": 1e400')
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    assert "'fwd_time_s' must be finite" in load_error(path)


def test_an_int_beyond_floats_range_as_a_time_is_refused(tmp_path: Path) -> None:
    # Found by the fuzz test: math.isfinite raised OverflowError on such an int.
    text = json.dumps(valid_dict()).replace('"fwd_time_s": 0.001', '"fwd_time_s": ' + "1" * 400)
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    assert "'fwd_time_s' must be finite" in load_error(path)


def test_cycle_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    data["edges"].append(["c", "a"])
    message = load_error(write(tmp_path, data))
    assert "acyclic" in message and "cycle" in message


def test_edge_against_execution_order_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    data["edges"] = [["v", "a"] if e == ["a", "v"] else e for e in data["edges"]]
    assert "goes against the execution order" in load_error(write(tmp_path, data))


def test_duplicate_node_names_are_refused(tmp_path: Path) -> None:
    data = valid_dict()
    data["nodes"].append(copy.deepcopy(node_entry(data, "b")))
    message = load_error(write(tmp_path, data))
    assert "'b' appears twice" in message


def test_edge_to_unknown_node_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    data["edges"].append(["c", "ghost"])
    message = load_error(write(tmp_path, data))
    assert "ghost" in message and "known node names" in message


@pytest.mark.parametrize(
    ("edge", "expected"),
    [
        (["a"], "known node names"),
        (["a", "b", "c"], "'uses' must be an int"),
        (["a", "b", 0], "'uses' must be an int"),
        ("a->b", "known node names"),
        (["a", 3], "known node names"),
    ],
)
def test_malformed_edge_is_refused(tmp_path: Path, edge: Any, expected: str) -> None:
    data = valid_dict()
    data["edges"].append(edge)
    assert expected in load_error(write(tmp_path, data))


def test_node_without_name_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    del node_entry(data, "c")["name"]
    assert "string 'name'" in load_error(write(tmp_path, data))


def test_alias_to_storage_no_earlier_node_owns_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    node_entry(data, "v")["aliases"] = ["b"]  # b is produced later
    message = load_error(write(tmp_path, data))
    assert "'v' aliases storage 'b', which no earlier node owns" in message


def test_saved_storage_nobody_owns_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    node_entry(data, "c")["saved"] = {"elsewhere": 256}
    message = load_error(write(tmp_path, data))
    assert "'c' saves storage 'elsewhere'" in message


def test_storage_owned_twice_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    node_entry(data, "c")["outputs"] = {"b": 4}
    assert "'b' is owned by two nodes" in load_error(write(tmp_path, data))


def test_inconsistent_totals_are_refused(tmp_path: Path) -> None:
    data = valid_dict()
    node_entry(data, "b")["output_bytes"] = 255
    assert "output_bytes differs" in load_error(write(tmp_path, data))


def test_duplicate_indices_are_refused(tmp_path: Path) -> None:
    data = valid_dict()
    node_entry(data, "c")["index"] = 2
    assert "indices must be 0..n-1" in load_error(write(tmp_path, data))


def test_output_that_is_not_a_node_is_refused(tmp_path: Path) -> None:
    data = valid_dict()
    data["graph"]["outputs"] = ["nowhere"]
    assert "'nowhere' is not a node" in load_error(write(tmp_path, data))


def test_directory_path_is_refused(tmp_path: Path) -> None:
    message = load_error(tmp_path)
    assert str(tmp_path) in message and "not a file" in message


def test_missing_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "missing.json"
    message = load_error(path)
    assert str(path) in message and "does not exist" in message


def test_error_message_names_the_file(tmp_path: Path) -> None:
    data = valid_dict()
    del node_entry(data, "a")["op"]
    path = write(tmp_path, data, name="named_file.json")
    assert "named_file.json" in load_error(path)


def test_graph_format_error_is_a_value_error_and_chkpt_opt_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_graph(tmp_path / "missing.json")
    with pytest.raises(ChkptOptError):
        load_graph(tmp_path / "missing.json")


# ---- check_graph on in-memory graphs ---------------------------------------------------


@pytest.fixture
def good_graph() -> CostGraph:
    return graph_io.graph_from_dict(valid_dict())


def check_error(graph: Any) -> str:
    with pytest.raises(GraphFormatError) as info:
        check_graph(graph)
    return str(info.value)


def test_check_graph_accepts_generated_and_traced_graphs(traced_mlp: CostGraph) -> None:
    check_graph(chain_graph(5))
    check_graph(random_dag(25, seed=2))
    check_graph(traced_mlp)


def test_check_graph_refuses_non_digraph() -> None:
    assert "networkx.DiGraph" in check_error(nx.Graph())


def test_check_graph_refuses_other_format_version(good_graph: CostGraph) -> None:
    good_graph.graph["format_version"] = 99
    message = check_error(good_graph)
    assert "format_version 99" in message and "regenerate" in message


def test_check_graph_refuses_missing_attribute(good_graph: CostGraph) -> None:
    del good_graph.nodes["b"]["saved"]
    assert "'b' lacks attributes ['saved']" in check_error(good_graph)


def test_check_graph_refuses_string_where_int(good_graph: CostGraph) -> None:
    good_graph.nodes["a"]["grad_bytes"] = "128"
    message = check_error(good_graph)
    assert "'grad_bytes'" in message and "must be an int" in message


def test_check_graph_refuses_negative_bytes(good_graph: CostGraph) -> None:
    good_graph.nodes["c"]["outputs"] = {"c": -4}
    good_graph.nodes["c"]["output_bytes"] = 0
    message = check_error(good_graph)
    assert "outputs['c'] = -4 is out of range" in message


def test_check_graph_refuses_huge_numbers(good_graph: CostGraph) -> None:
    good_graph.nodes["a"]["grad_bytes"] = 2**61
    assert "out of range" in check_error(good_graph)


def test_check_graph_refuses_huge_flops(good_graph: CostGraph) -> None:
    good_graph.nodes["a"]["fwd_flops"] = 10**25
    assert "'fwd_flops'" in check_error(good_graph)


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_check_graph_refuses_nonfinite_or_negative_times(
    good_graph: CostGraph, value: float
) -> None:
    good_graph.nodes["b"]["bwd_time_s"] = value
    assert "'bwd_time_s' must be finite and >= 0" in check_error(good_graph)


def test_check_graph_refuses_cycle(good_graph: CostGraph) -> None:
    good_graph.add_edge("c", "a")
    assert "cycle" in check_error(good_graph)


def test_check_graph_refuses_alias_to_unowned_storage(good_graph: CostGraph) -> None:
    good_graph.nodes["v"]["aliases"] = ["nobody"]
    assert "aliases storage 'nobody', which no earlier node owns" in check_error(good_graph)


def test_check_graph_refuses_storage_owned_twice(good_graph: CostGraph) -> None:
    good_graph.nodes["c"]["outputs"] = {"a": 4}
    assert "'a' is owned by two nodes" in check_error(good_graph)


def test_check_graph_refuses_non_string_node_keys() -> None:
    g = new_graph("g")
    g.add_node(0, **node_attrs(index=0, op="x", outputs={"s": 4}))
    assert "node keys must be strings" in check_error(g)


def test_check_graph_refuses_edge_to_node_without_attributes(good_graph: CostGraph) -> None:
    good_graph.add_edge("c", "ghost")  # networkx creates 'ghost' with no attributes
    assert "'ghost' lacks attributes" in check_error(good_graph)


def test_node_attrs_lists_every_checked_attribute() -> None:
    attrs = node_attrs(index=0, op="x")
    assert set(attrs) == set(NODE_ATTRS)


# ---- atomic writes --------------------------------------------------------------------


def test_failing_write_leaves_no_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom(data: Any, handle: Any, **kwargs: Any) -> None:
        handle.write('{"format": "chkpt_opt.costgraph", "nod')  # a partial write
        raise OSError("disk full")

    monkeypatch.setattr(graph_io.json, "dump", boom)
    target = tmp_path / "g.json"
    with pytest.raises(OSError, match="disk full"):
        save_graph(chain_graph(3), target)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind either


def test_failing_write_keeps_old_content(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "g.json"
    save_graph(chain_graph(3), target)
    before = target.read_bytes()

    def boom(data: Any, handle: Any, **kwargs: Any) -> None:
        handle.write("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(graph_io.json, "dump", boom)
    with pytest.raises(KeyboardInterrupt):
        save_graph(random_dag(10, seed=0), target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["g.json"]
    assert_same_graph(load_graph(target), chain_graph(3))


def test_saving_an_invalid_graph_writes_nothing(tmp_path: Path) -> None:
    graph = chain_graph(3)
    graph.nodes["n1"]["output_bytes"] = -1
    target = tmp_path / "g.json"
    with pytest.raises(GraphFormatError):
        save_graph(graph, target)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_save_creates_parent_directories(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "g.json"
    save_graph(chain_graph(2), target)
    assert_same_graph(load_graph(target), chain_graph(2))
