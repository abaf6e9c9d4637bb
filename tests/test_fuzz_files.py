"""Malformed, truncated and hostile cost-graph and schedule files.

Whatever the bytes, ``load_graph`` either returns a valid graph or raises GraphFormatError,
``load_schedule`` either returns a schedule file or raises ScheduleError, and the
``chkpt-opt`` command line answers exit code 2 with a one-line message. Mutated files come
from hypothesis (byte flips, truncations, values replaced, keys dropped); hostile ones
(huge numbers, cycles, unknown versions, wrong types, deep nesting, non-UTF-8, NaN,
very long strings, duplicate keys, bools for ints) are listed one by one. Nothing is ever
loaded with pickle.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chkpt_opt
from chkpt_opt.cli import EXIT_INPUT, EXIT_OK, main
from chkpt_opt.errors import GraphFormatError, ScheduleError
from chkpt_opt.graphs.costgraph import MAX_BYTES, check_graph, new_graph, node_attrs
from chkpt_opt.graphs.io import graph_to_dict, load_graph, save_graph
from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.memory_model.schedule import Schedule, check_schedule
from chkpt_opt.memory_model.schedule_io import load_schedule, save_schedule
from chkpt_opt.memory_model.simulate import simulate

PACKAGE = Path(chkpt_opt.__file__).parent
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ---- valid files --------------------------------------------------------------------------


def hand_graph() -> Any:
    """A small graph with a view, an op's own saved buffer, a skip edge and two uses."""
    g = new_graph("hand", param_bytes=64, trainable_param_bytes=64, input_bytes=16)
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
            bwd_time_s=2e-3,
        ),
    )
    g.add_node(
        "c", **node_attrs(index=3, op="x.c", outputs={"c": 4}, saved={"b": 256}, grad_bytes=4)
    )
    g.add_edges_from([("a", "v"), ("v", "b"), ("a", "c")])
    g.add_edge("b", "c", uses=2)
    g.graph["outputs"] = ["c"]
    check_graph(g)
    return g


GRAPHS = {"hand": hand_graph, "dag": lambda: random_dag(10, seed=4, skip_prob=0.5)}


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="chkpt_opt_fuzz_") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def valid_files(workdir: Path) -> dict[str, tuple[Any, Path, Path]]:
    """For each graph: the graph, its file, and a schedule file made for it."""
    files = {}
    for name, make in GRAPHS.items():
        graph = make()
        gpath, spath = workdir / f"{name}.json", workdir / f"{name}.schedule.json"
        save_graph(graph, gpath)
        order = sorted(graph, key=lambda n: graph.nodes[n]["index"])
        save_schedule(
            spath,
            graph,
            Schedule(regions=(tuple(order[:2]),)),
            budget_bytes=10**6,
            activation_budget_bytes=10**5,
            predicted_peak_bytes=12345,
            solver="greedy",
            status="feasible",
            objective_s=0.5,
            bound_s=None,
        )
        files[name] = (graph, gpath, spath)
    return files


# ---- what a load may do -------------------------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


def check_graph_file(path: Path) -> None:
    """load_graph returns a graph that simulates, or raises GraphFormatError; the CLI
    answers 0 or 2 accordingly, with a one-line message."""
    try:
        graph = load_graph(path)
    except GraphFormatError as err:
        assert str(err).strip()
        code, stderr = run_cli("show", str(path))
        assert code == EXIT_INPUT, stderr
        assert stderr.startswith("chkpt-opt: ") and "Traceback" not in stderr
        return
    check_graph(graph)
    simulate(graph, Schedule())
    code, stderr = run_cli("show", str(path), "--json")
    assert code == EXIT_OK, stderr


def check_schedule_file(path: Path, graph: Any, graph_path: Path) -> None:
    """load_schedule returns a schedule file or raises ScheduleError; checked against its
    graph, the schedule is refused with ScheduleError or simulates; the CLI agrees."""
    try:
        loaded = load_schedule(path)
    except ScheduleError as err:
        assert str(err).strip()
        for argv in (("show", str(path)), ("simulate", str(graph_path), str(path))):
            code, stderr = run_cli(*argv)
            assert code == EXIT_INPUT, (argv, stderr)
            assert stderr.startswith("chkpt-opt: ") and "Traceback" not in stderr
        return
    assert isinstance(loaded.schedule, Schedule)
    try:
        loaded.check_against(graph)
    except ScheduleError:
        code, stderr = run_cli("simulate", str(graph_path), str(path))
        assert code == EXIT_INPUT, stderr
        return
    check_schedule(graph, loaded.schedule)
    simulate(graph, loaded.schedule)
    code, stderr = run_cli("simulate", str(graph_path), str(path), "--json")
    assert code == EXIT_OK, stderr


# ---- hypothesis mutations -----------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, MAX_BYTES, MAX_BYTES + 1, 2**63, 10**30, 10**400]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, -0.0, 1e308, 1e-320]),
    st.text(max_size=20),
    st.sampled_from(["", "a" * 100_000, "\x00", "\ud800", "n0", "a", "keep_set", "1"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def paths_of(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside parsed JSON (the root excluded)."""
    out = []
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return out
    for key, child in items:
        out.append((*prefix, key))
        out.extend(paths_of(child, (*prefix, key)))
    return out


def mutate(data: Any, path: tuple[Any, ...], action: str, value: Any) -> Any:
    data = copy.deepcopy(data)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if action == "replace":
        parent[path[-1]] = value
    elif action == "drop":
        del parent[path[-1]]
    elif action == "wrap":  # deeper nesting around the value
        parent[path[-1]] = [[[parent[path[-1]]]]]
    return data


def write_bytes(path: Path, raw: bytes) -> Path:
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("name", sorted(GRAPHS))
@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6)
)
def test_graph_file_with_flipped_bytes(
    valid_files: dict, workdir: Path, name: str, flips: list[tuple[int, int]]
) -> None:
    raw = bytearray(valid_files[name][1].read_bytes())
    for position, byte in flips:
        raw[position % len(raw)] = byte
    check_graph_file(write_bytes(workdir / "flipped.json", bytes(raw)))


@pytest.mark.parametrize("name", sorted(GRAPHS))
@FUZZ
@given(cut=st.integers(min_value=0, max_value=10**6))
def test_truncated_graph_file_is_refused(
    valid_files: dict, workdir: Path, name: str, cut: int
) -> None:
    raw = valid_files[name][1].read_bytes()
    prefix = raw[: cut % len(raw)]
    path = write_bytes(workdir / "truncated.json", prefix)
    if prefix.strip() == raw.strip():  # only the final newline cut: still the whole file
        load_graph(path)
        return
    with pytest.raises(GraphFormatError, match=r"not valid JSON|truncated"):
        load_graph(path)
    check_graph_file(path)


@pytest.mark.parametrize("name", sorted(GRAPHS))
@FUZZ
@given(
    choice=st.integers(min_value=0),
    action=st.sampled_from(["replace", "replace", "replace", "drop", "wrap"]),
    value=json_values,
)
def test_graph_file_with_a_value_replaced(
    valid_files: dict, workdir: Path, name: str, choice: int, action: str, value: Any
) -> None:
    data = json.loads(valid_files[name][1].read_text())
    paths = paths_of(data)
    data = mutate(data, paths[choice % len(paths)], action, value)
    path = workdir / "replaced.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    check_graph_file(path)


@pytest.mark.parametrize("name", sorted(GRAPHS))
@FUZZ
@given(
    choice=st.integers(min_value=0),
    action=st.sampled_from(["replace", "replace", "drop", "wrap"]),
    value=json_values,
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
)
def test_schedule_file_mutated(
    valid_files: dict,
    workdir: Path,
    name: str,
    choice: int,
    action: str,
    value: Any,
    flips: list[tuple[int, int]],
) -> None:
    graph, gpath, spath = valid_files[name]
    data = json.loads(spath.read_text())
    paths = paths_of(data)
    data = mutate(data, paths[choice % len(paths)], action, value)
    raw = bytearray(json.dumps(data).encode())
    for position, byte in flips:
        raw[position % len(raw)] = byte
    check_schedule_file(write_bytes(workdir / "mutated.schedule.json", bytes(raw)), graph, gpath)


@pytest.mark.parametrize("name", sorted(GRAPHS))
@FUZZ
@given(cut=st.integers(min_value=0, max_value=10**6))
def test_truncated_schedule_file_is_refused(
    valid_files: dict, workdir: Path, name: str, cut: int
) -> None:
    graph, gpath, spath = valid_files[name]
    raw = spath.read_bytes()
    prefix = raw[: cut % len(raw)]
    path = write_bytes(workdir / "truncated.schedule.json", prefix)
    if prefix.strip() == raw.strip():
        load_schedule(path)
        return
    with pytest.raises(ScheduleError, match=r"not valid JSON|truncated"):
        load_schedule(path)
    check_schedule_file(path, graph, gpath)


# ---- hostile files, one by one ------------------------------------------------------------


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Any], Any]:
    return lambda data: mutate(data, path, "replace", value)


def _node(data: Any, name: str) -> int:
    return next(i for i, n in enumerate(data["nodes"]) if n["name"] == name)


def _graph_edit(edit: Callable[[dict], None]) -> Callable[[Any], Any]:
    def apply(data: Any) -> Any:
        data = copy.deepcopy(data)
        edit(data)
        return data

    return apply


HOSTILE_GRAPHS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "huge byte count": (
        _graph_edit(lambda d: d["nodes"][0]["outputs"].update(a=2**64)),
        "out of range",
    ),
    "huge int literal": (
        lambda d: json.dumps(d).replace('"param_bytes": 64', '"param_bytes": 1' + "0" * 5000),
        "unreadable value",
    ),
    "negative bytes": (_set(("graph", "input_bytes"), -1), "out of range"),
    "cycle": (_graph_edit(lambda d: d["edges"].append(["c", "a"])), "acyclic|against"),
    "self loop": (_graph_edit(lambda d: d["edges"].append(["b", "b"])), "self-loop"),
    "unknown version": (_set(("format_version",), 99), "format_version 99"),
    "version as string": (_set(("format_version",), "1"), "format_version '1'"),
    "other format": (
        _set(("format",), "chkpt_opt.memory_model.schedule"),
        "not a chkpt_opt cost graph",
    ),
    "nodes not a list": (_set(("nodes",), {"a": 1}), "'nodes' must be a JSON list"),
    "index as float": (_graph_edit(lambda d: d["nodes"][1].update(index=1.0)), "must be an int"),
    "bool for int": (_graph_edit(lambda d: d["nodes"][1].update(index=True)), "must be an int"),
    "bool for bytes": (
        _graph_edit(lambda d: d["nodes"][0]["outputs"].update(a=True)),
        "must be an int",
    ),
    "int for bool": (_graph_edit(lambda d: d["nodes"][0].update(is_view=1)), "must be a bool"),
    "string for time": (
        _graph_edit(lambda d: d["nodes"][2].update(fwd_time_s="1")),
        "must be a number",
    ),
    "uses as bool": (_graph_edit(lambda d: d["edges"][-1].__setitem__(2, True)), "'uses'"),
    "deep nesting": (_set(("graph", "name"), json.loads("[" * 500 + "]" * 500)), "string"),
    "very deep nesting": (
        lambda d: json.loads("[" * 400 + json.dumps(d) + "]" * 400),
        "not a chkpt_opt cost graph",
    ),
    "edge to nowhere": (_graph_edit(lambda d: d["edges"].append(["a", "zz"])), "known node"),
    "duplicate node": (
        _graph_edit(lambda d: d["nodes"].append(copy.deepcopy(d["nodes"][0]))),
        "appears twice",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_GRAPHS))
def test_hostile_graph_file_is_refused_clearly(valid_files: dict, workdir: Path, case: str) -> None:
    edit, expected = HOSTILE_GRAPHS[case]
    data = edit(json.loads(valid_files["hand"][1].read_text()))
    path = workdir / "hostile.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    with pytest.raises(GraphFormatError, match=expected) as info:
        load_graph(path)
    assert len(str(info.value)) < 1000
    code, stderr = run_cli("show", str(path))
    assert code == EXIT_INPUT and len(stderr.splitlines()) == 1


RAW_HOSTILE: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "not valid JSON"),
    "not json": (b"hello", "not valid JSON"),
    "nan": (b'{"format": "chkpt_opt.costgraph", "format_version": NaN}', "NaN is not allowed"),
    "infinity": (b'{"format": "chkpt_opt.costgraph", "x": -Infinity}', "Infinity"),
    "latin-1": ('{"format": "é"}'.encode("latin-1"), "not UTF-8"),
    "utf-16": (json.dumps({"format": "x"}).encode("utf-16"), "not UTF-8"),
    "utf-8 bom": (b"\xef\xbb\xbf{}", "not valid JSON"),
    "nested too deeply": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "nul bytes": (b"\x00" * 64, "not valid JSON"),
    "json array": (b"[1, 2, 3]", "not a chkpt_opt"),
    "pickle payload": (pickle.dumps({"format": "chkpt_opt.costgraph"}), "not UTF-8|not valid"),
}


@pytest.mark.parametrize("case", sorted(RAW_HOSTILE))
def test_raw_hostile_bytes_are_refused_as_graph_and_schedule(
    valid_files: dict, workdir: Path, case: str
) -> None:
    raw, expected = RAW_HOSTILE[case]
    path = write_bytes(workdir / "raw.json", raw)
    with pytest.raises(GraphFormatError, match=expected):
        load_graph(path)
    with pytest.raises(ScheduleError, match=expected):
        load_schedule(path)
    graph, gpath, _ = valid_files["hand"]
    check_graph_file(path)
    check_schedule_file(path, graph, gpath)


def test_missing_and_directory_paths_are_refused(workdir: Path) -> None:
    for path in (workdir / "no_such_file.json", workdir):
        with pytest.raises(GraphFormatError, match="does not exist or is not a file"):
            load_graph(path)
        with pytest.raises(ScheduleError, match="does not exist or is not a file"):
            load_schedule(path)
        assert run_cli("show", str(path))[0] == EXIT_INPUT


HOSTILE_SCHEDULES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "unknown version": (_set(("format_version",), 99), "format_version 99"),
    "other format": (_set(("format",), "chkpt_opt.costgraph"), "not a chkpt_opt schedule"),
    "no fingerprint": (_set(("graph",), {"name": "x"}), "graph.fingerprint"),
    "fingerprint not a string": (_set(("graph", "fingerprint"), 12), "graph.fingerprint"),
    "other kind": (_set(("schedule", "kind"), "revolve"), '"kind" one of'),
    "regions not a list": (_set(("schedule", "regions"), "abc"), "regions"),
    "empty region": (_set(("schedule", "regions"), [[]]), "regions"),
    "int node name": (_set(("schedule", "regions"), [[1]]), "regions"),
    "deep nesting": (_set(("schedule", "regions"), json.loads("[" * 500 + "]" * 500)), "regions"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_SCHEDULES))
def test_hostile_schedule_file_is_refused_clearly(
    valid_files: dict, workdir: Path, case: str
) -> None:
    edit, expected = HOSTILE_SCHEDULES[case]
    _, gpath, spath = valid_files["hand"]
    path = workdir / "hostile.schedule.json"
    path.write_text(json.dumps(edit(json.loads(spath.read_text()))), encoding="utf-8")
    with pytest.raises(ScheduleError, match=expected) as info:
        load_schedule(path)
    assert len(str(info.value)) < 1000
    for argv in (("show", str(path)), ("simulate", str(gpath), str(path))):
        code, stderr = run_cli(*argv)
        assert code == EXIT_INPUT and len(stderr.splitlines()) == 1, (argv, stderr)


SCHEDULE_AGAINST_GRAPH: dict[str, tuple[list[list[str]], str]] = {
    "unknown op": ([["zz"]], "not in graph"),
    "not consecutive": ([["a", "b"]], "consecutive"),
    "out of order": ([["b"], ["a"]], "overlaps or precedes"),
    "overlapping": ([["a", "v"], ["v", "b"]], "overlaps"),
    "repeated op": ([["a", "a"]], "consecutive"),
}


@pytest.mark.parametrize("case", sorted(SCHEDULE_AGAINST_GRAPH))
def test_schedule_that_does_not_fit_its_graph_is_refused(
    valid_files: dict, workdir: Path, case: str
) -> None:
    regions, expected = SCHEDULE_AGAINST_GRAPH[case]
    graph, gpath, spath = valid_files["hand"]
    data = json.loads(spath.read_text())
    data["schedule"]["regions"] = regions
    path = workdir / "misfit.schedule.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ScheduleError, match=expected):
        load_schedule(path).check_against(graph)
    assert run_cli("simulate", str(gpath), str(path))[0] == EXIT_INPUT


def test_schedule_for_another_graph_is_refused(valid_files: dict) -> None:
    graph, _, _ = valid_files["dag"]
    _, _, hand_schedule = valid_files["hand"]
    with pytest.raises(ScheduleError, match="fingerprint"):
        load_schedule(hand_schedule).check_against(graph)
    code, stderr = run_cli("simulate", str(valid_files["dag"][1]), str(hand_schedule))
    assert code == EXIT_INPUT and "fingerprint" in stderr


def test_command_line_exits_2_on_hostile_files_in_a_fresh_process(
    valid_files: dict, workdir: Path
) -> None:
    """The installed console script, not main(): exit code 2, one line, no traceback."""
    bad = write_bytes(workdir / "cli_bad.json", b'{"format": "chkpt_opt.costgraph", "format_')
    _, gpath, _ = valid_files["hand"]
    script = Path(sys.executable).parent / "chkpt-opt"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "chkpt_opt.cli"]
    for argv in (
        ["show", str(bad)],
        ["simulate", str(gpath), str(bad)],
        ["solve", str(bad), "--budget", "1GB"],
    ):
        done = subprocess.run(
            [*command, *argv], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == EXIT_INPUT, (argv, done.stderr)
        assert "Traceback" not in done.stderr and done.stderr.startswith("chkpt-opt: ")


# ---- known gaps (outside the loaders' current checks) -------------------------------------


@pytest.mark.parametrize("kind", ["graph", "schedule"])
def test_duplicate_keys_are_refused(valid_files: dict, workdir: Path, kind: str) -> None:
    _, gpath, spath = valid_files["hand"]
    source = gpath if kind == "graph" else spath
    text = source.read_text()
    text = text.replace('"format_version": 1,', '"format_version": 99, "format_version": 1,', 1)
    path = workdir / f"dup.{kind}.json"
    path.write_text(text, encoding="utf-8")
    loader = load_graph if kind == "graph" else load_schedule
    with pytest.raises((GraphFormatError, ScheduleError), match=r"duplicate|twice"):
        loader(path)


SCHEMA_VIOLATIONS: dict[str, Callable[[Any], Any]] = {
    "bool budget": _set(("budget_bytes",), True),
    "string budget": _set(("budget_bytes",), "200MB"),
    "negative peak": _set(("predicted_peak_bytes",), -5),
    "unknown status": _set(("status",), "great"),
    "graph name not a string": _set(("graph", "name"), ["x"]),
    "graph nodes not an int": _set(("graph", "nodes"), "12"),
    "fingerprint not hex": _set(("graph", "fingerprint"), "zz"),
    "extra schedule key": _set(("schedule", "extra"), 1),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_VIOLATIONS))
def test_schedule_files_that_break_the_published_schema_are_refused(
    valid_files: dict, workdir: Path, case: str, request: pytest.FixtureRequest
) -> None:
    """chkpt_opt/schemas/schedule-v1.schema.json is what a trainer reads; load_schedule
    should refuse what the schema refuses. Every case here is schema-invalid."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((PACKAGE / "schemas" / "schedule-v1.schema.json").read_text())
    _, _, spath = valid_files["hand"]
    jsonschema.validate(json.loads(spath.read_text()), schema)  # the valid file is valid
    data = SCHEMA_VIOLATIONS[case](json.loads(spath.read_text()))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)
    path = workdir / "schema.schedule.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ScheduleError):
        load_schedule(path)


@pytest.mark.parametrize("where", ["node attribute", "schedule version"])
def test_error_messages_stay_short_for_huge_values(
    valid_files: dict, workdir: Path, where: str
) -> None:
    huge = "x" * 1_000_000
    _, gpath, spath = valid_files["hand"]
    if where == "node attribute":
        data = json.loads(gpath.read_text())
        data["nodes"][0]["index"] = huge
        loader: Callable[[Path], Any] = load_graph
    else:
        data = json.loads(spath.read_text())
        data["format_version"] = huge
        loader = load_schedule
    path = workdir / "long.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises((GraphFormatError, ScheduleError)) as info:
        loader(path)
    assert len(str(info.value)) < 2000


def test_very_long_names_load_when_the_file_is_otherwise_valid(workdir: Path) -> None:
    g = random_dag(4, seed=0)
    long = "n" * 200_000
    data = graph_to_dict(g)
    text = json.dumps(data).replace('"n3"', json.dumps(long))
    path = workdir / "long_names.json"
    path.write_text(text, encoding="utf-8")
    graph = load_graph(path)
    assert long in graph and graph.graph["outputs"] == [long]


# ---- nothing is loaded with pickle --------------------------------------------------------

_UNPICKLING_CALLS = {
    ("pickle", "load"),
    ("pickle", "loads"),
    ("pickle", "Unpickler"),
    ("cPickle", "load"),
    ("cPickle", "loads"),
    ("torch", "load"),
    ("marshal", "load"),
    ("marshal", "loads"),
    ("shelve", "open"),
    ("dill", "load"),
    ("dill", "loads"),
    ("cloudpickle", "load"),
    ("cloudpickle", "loads"),
    ("joblib", "load"),
    ("yaml", "load"),
    ("yaml", "unsafe_load"),
}


def _package_sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_of_the_package_unpickles() -> None:
    """Every call in chkpt_opt/: no pickle/torch/marshal/shelve/dill/joblib/yaml loading,
    no numpy.load with allow_pickle, no eval/exec of file contents."""
    offenders: list[str] = []
    sources = _package_sources()
    assert len(sources) > 20
    for source in sources:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    qualified = f"{node.module}.{alias.name}"
                    aliases[alias.asname or alias.name] = qualified
                    if (node.module.split(".")[0], alias.name) in _UNPICKLING_CALLS:
                        offenders.append(f"{source.name}:{node.lineno} imports {qualified}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            where = f"{source.relative_to(PACKAGE)}:{node.lineno}"
            if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                offenders.append(f"{where} calls {func.id}")
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                module = aliases.get(func.value.id, func.value.id).split(".")[0]
                if (module, func.attr) in _UNPICKLING_CALLS:
                    offenders.append(f"{where} calls {module}.{func.attr}")
                if module == "numpy" and func.attr == "load":
                    pickled = [k for k in node.keywords if k.arg == "allow_pickle"]
                    if any(not isinstance(k.value, ast.Constant) or k.value.value for k in pickled):
                        offenders.append(f"{where} calls numpy.load(allow_pickle=...)")
    assert not offenders, offenders


class _Boom:
    """Unpickling this runs code: it would create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_pickle_payloads_are_never_executed(valid_files: dict, workdir: Path) -> None:
    marker = workdir / "pwned"
    payload = pickle.dumps({"format": "chkpt_opt.costgraph", "x": _Boom(str(marker))})
    path = write_bytes(workdir / "evil.json", payload)
    with pytest.raises(GraphFormatError):
        load_graph(path)
    with pytest.raises(ScheduleError):
        load_schedule(path)
    _, gpath, _ = valid_files["hand"]
    for argv in (
        ("show", str(path)),
        ("simulate", str(gpath), str(path)),
        ("solve", str(path), "--budget", "1GB"),
    ):
        assert run_cli(*argv)[0] == EXIT_INPUT
    assert not marker.exists()
    # Sanity: the payload really is live when unpickled.
    pickle.loads(payload)
    assert marker.exists()
    os.remove(marker)


def test_random_seeded_mutation_smoke(valid_files: dict, workdir: Path) -> None:
    """A fixed-seed sweep of single-byte flips over every position of a small file."""
    raw = valid_files["hand"][1].read_bytes()
    rng = random.Random(0)
    path = workdir / "sweep.json"
    for position in range(0, len(raw), max(1, len(raw) // 300)):
        flipped = bytearray(raw)
        flipped[position] = rng.choice(b'{}[]",:0123456789 -.eEtfnx\\\x00\xff')
        path.write_bytes(bytes(flipped))
        with contextlib.suppress(GraphFormatError):
            load_graph(path)
