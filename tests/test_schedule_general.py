"""General schedules (nested regions, cached ops): the data, its checks and files, and the
one memory model against measured runs of the rewritten models."""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

import pytest
import torch

from chkpt_opt import zoo
from chkpt_opt.codegen import rewrite_module
from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import ordered_nodes
from chkpt_opt.graphs.synthetic import chain_graph
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.measurement.step import measure_step
from chkpt_opt.memory_model.schedule import Schedule, check_schedule, region_tree
from chkpt_opt.memory_model.schedule_io import load_schedule, save_schedule
from chkpt_opt.memory_model.simulate import simulate
from tests.conftest import MODELS
from tests.general_schedules import random_general_schedule


def _spans(graph, *spans: tuple[int, int]) -> tuple[tuple[str, ...], ...]:
    order = ordered_nodes(graph)
    return tuple(tuple(order[a:b]) for a, b in spans)


# ---- the data ---------------------------------------------------------------------------


def test_keep_set_schedule_keeps_the_round_one_form() -> None:
    s = Schedule(regions=(("a", "b"),))
    assert s.is_keep_set()
    assert s.to_dict() == {"kind": "keep_set", "regions": [["a", "b"]]}


def test_general_schedule_round_trips_through_its_dict() -> None:
    s = Schedule(regions=(("a", "b", "c"),), nested=(("b", "c"),), saved=frozenset({"c"}))
    data = s.to_dict()
    assert data["kind"] == "regions" and data["saved"] == ["c"]
    assert Schedule.from_dict(json.loads(json.dumps(data))) == s
    assert s.recomputed_nodes() == {"a", "b"}


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"kind": "regions", "regions": [["a"]], "extra": 1}, "unknown keys"),
        ({"kind": "keep_set", "regions": [["a"]], "saved": ["a"]}, "unknown keys"),
        ({"kind": "regions", "regions": [["a"]], "nested": "a"}, "'nested' must be"),
        ({"kind": "regions", "regions": [["a"]], "saved": [1]}, "'saved' must be"),
        ({"kind": "other", "regions": []}, '"kind" one of'),
    ],
)
def test_malformed_schedule_data_is_refused(data: dict, fragment: str) -> None:
    with pytest.raises(ScheduleError, match=fragment):
        Schedule.from_dict(data)


@pytest.fixture(scope="module")
def chain():
    return chain_graph(12, activation_bytes=1000)


@pytest.mark.parametrize(
    "regions, nested, saved, fragment",
    [
        ([(0, 6)], [(4, 8)], [], "overlaps"),
        ([(0, 6)], [(0, 6)], [], "repeats"),
        ([(0, 6)], [(7, 9)], [], "in no region"),
        ([(0, 6)], [], [7], "lies in no recompute region"),
    ],
)
def test_invalid_general_schedules_name_the_fault(chain, regions, nested, saved, fragment) -> None:
    order = ordered_nodes(chain)
    s = Schedule(
        regions=_spans(chain, *regions),
        nested=_spans(chain, *nested),
        saved=frozenset(order[i] for i in saved),
    )
    with pytest.raises(ScheduleError, match=fragment):
        check_schedule(chain, s)


def test_region_tree_places_nested_regions_under_their_parents(chain) -> None:
    s = Schedule(regions=_spans(chain, (0, 8), (9, 12)), nested=_spans(chain, (2, 8), (4, 6)))
    tree = region_tree(chain, s)
    assert [(r.start, r.stop, r.parent, r.depth) for r in tree] == [
        (0, 8, -1, 0),
        (2, 8, 0, 1),
        (4, 6, 1, 2),
        (9, 12, -1, 0),
    ]
    assert tree[0].children == (1,) and tree[1].children == (2,)


# ---- files ------------------------------------------------------------------------------


def test_general_schedule_file_is_version_two_and_validates(chain, tmp_path: Path) -> None:
    order = ordered_nodes(chain)
    s = Schedule(
        regions=_spans(chain, (0, 8)), nested=_spans(chain, (2, 6)), saved=frozenset([order[7]])
    )
    check_schedule(chain, s)
    path = tmp_path / "general.json"
    save_schedule(path, chain, s)
    data = json.loads(path.read_text())
    assert data["format_version"] == 2
    assert load_schedule(path).schedule == s
    keep = tmp_path / "keep.json"
    save_schedule(keep, chain, Schedule(regions=_spans(chain, (0, 8))))
    assert json.loads(keep.read_text())["format_version"] == 1
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(
        resources.files("chkpt_opt").joinpath("schemas/schedule-v2.schema.json").read_text()
    )
    jsonschema.validate(data, schema)
    jsonschema.validate(json.loads(keep.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dict(data, schedule=dict(data["schedule"], extra=1)), schema)


def test_version_one_file_with_a_general_schedule_is_refused(chain, tmp_path: Path) -> None:
    s = Schedule(regions=_spans(chain, (0, 8)), nested=_spans(chain, (2, 6)))
    path = tmp_path / "general.json"
    save_schedule(path, chain, s)
    data = json.loads(path.read_text())
    path.write_text(json.dumps(dict(data, format_version=1)))
    with pytest.raises(ScheduleError, match="version 1 cannot express"):
        load_schedule(path)


# ---- the memory model against measured runs ---------------------------------------------

GENERAL_MODELS = dict(MODELS, vgg=lambda: zoo.vgg(widths=(8, 16), image=16, batch=4))


@pytest.mark.parametrize("name", sorted(GENERAL_MODELS))
def test_random_general_schedules_run_as_predicted_with_the_same_gradients(name: str) -> None:
    model, args, kwargs = GENERAL_MODELS[name]()
    traced = trace_model(model, args, kwargs)
    graph = traced.graph
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = None
    measure_step(model, args, kwargs)
    reference = [p.grad for p in model.parameters()]
    rng = random.Random(0)
    checked = 0
    for _ in range(30):
        schedule = random_general_schedule(graph, rng)
        if schedule.is_keep_set():
            continue
        predicted = simulate(graph, schedule).peak_bytes
        module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)
        measured = measure_step(module, args, kwargs).peak_bytes
        assert abs(predicted - measured) <= 0.03 * measured, (name, schedule, predicted, measured)
        for ref, p in zip(reference, model.parameters()):
            assert (ref is None and p.grad is None) or torch.equal(ref, p.grad), name
        checked += 1
        if checked == 5:
            break
    assert checked == 5


def test_a_nested_regions_inputs_are_held_while_it_runs_as_measured() -> None:
    # Four levels of nesting on an 8-layer linear+ReLU chain: in the forward pass and in
    # every replay, the code calling a nested checkpoint holds its inputs until it returns
    # (measured 27% above a model that frees them after their last reader).
    model, args, kwargs = zoo.relu_chain(width=64, depth=8, batch=256)
    traced = trace_model(model, args, kwargs)
    graph = traced.graph
    schedule = Schedule(
        regions=_spans(graph, (0, 15), (16, 18)),
        nested=_spans(
            graph,
            *[(0, 5), (1, 5), (2, 5), (2, 3), (3, 5), (5, 15), (6, 15), (6, 9), (6, 7)],
            *[(7, 9), (9, 15), (10, 15), (10, 13), (10, 11), (11, 13), (13, 15)],
        ),
    )
    check_schedule(graph, schedule)
    module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
    assert measure_step(module, args, kwargs).peak_bytes == simulate(graph, schedule).peak_bytes
