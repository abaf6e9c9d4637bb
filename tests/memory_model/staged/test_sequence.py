"""Staged schedules in the op sequence: hand-computed timelines, the check, the file form,
and schedules of regions, cached and unpacked ops as staged ones."""

from __future__ import annotations

import json
import random
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import (
    CostGraph,
    check_graph,
    new_graph,
    node_attrs,
    ordered_nodes,
)
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.replay_cost import recomputed_ops
from chkpt_opt.memory_model.schedule import Schedule, cache_candidates, check_schedule
from chkpt_opt.memory_model.schedule_io import load_schedule, save_schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.memory_model.staged import recomputable_ops, staged_schedule
from chkpt_opt.memory_model.staged.rule import recomputed_storages, stage_ops
from chkpt_opt.memory_model.staged.translate import as_staged
from chkpt_opt.memory_model.unpack import rebuilt_storages, unpack_candidates, unpack_problem
from chkpt_opt.memory_model.unpack.rule import later_write_readers
from tests.general_schedules import random_general_schedule
from tests.memory_model.test_unpack_sequence import _two_savers, chain_of_two


def _staged(graph: CostGraph, stages: dict[str, list[str]]) -> Schedule:
    return Schedule(staged=staged_schedule(graph, stages))


def _steps(graph: CostGraph, schedule: Schedule) -> list[tuple[str, str, int, int]]:
    profile = simulate(graph, schedule)
    return [(p.kind, p.node, p.during_bytes, p.after_bytes) for p in profile.timeline]


def test_a_value_recomputed_for_its_saver_lives_from_the_stage_to_that_backward() -> None:
    # n0 -> n1 -> n2 -> n3, 100 bytes each, each saves its input: n1 recomputed before n2's
    # backward, which unpacks it; the forward's n1 dies after n2 (its last use before).
    g = chain_graph(4, activation_bytes=100, fwd_time_s=[1.0, 2.0, 4.0, 8.0])
    assert _steps(g, _staged(g, {"n2": ["n1"]})) == [
        ("fwd", "n0", 100, 100),
        ("fwd", "n1", 200, 200),
        ("fwd", "n2", 300, 200),
        ("fwd", "n3", 300, 300),
        ("bwd_start", "", 400, 400),
        ("bwd", "n3", 500, 400),
        ("recompute", "n1", 500, 500),
        ("bwd", "n2", 600, 400),
        ("bwd", "n1", 500, 300),
        ("bwd", "n0", 300, 200),
    ]
    assert simulate(g, _staged(g, {"n2": ["n1"]})).recompute_s == 2.0


def test_an_op_recomputed_at_two_stages_is_freed_in_between() -> None:
    # b (50 bytes) is saved by c and d: recomputed before d's backward and again before c's,
    # each value freed once its one saver has run; unpacked once, it lives across both.
    g = _two_savers()
    twice = _staged(g, {"d": ["b"], "c": ["b"]})
    assert _steps(g, twice) == [
        ("fwd", "a", 100, 100),
        ("fwd", "b", 150, 150),
        ("fwd", "c", 250, 250),
        ("fwd", "d", 260, 210),
        ("bwd_start", "", 220, 220),
        ("recompute", "b", 270, 270),
        ("bwd", "d", 420, 270),  # this b freed with c (both saved by d alone)
        ("recompute", "b", 320, 320),
        ("bwd", "c", 370, 220),  # the second b freed with it
        ("accumulate", "c", 270, 170),
        ("bwd", "b", 270, 120),
        ("bwd", "a", 120, 20),
    ]
    assert simulate(g, twice).recompute_s == 4.0
    once = Schedule(unpacked=frozenset({"b"}))
    assert simulate(g, once).recompute_s == 2.0


def test_a_recomputation_reads_the_value_recomputed_before_it_in_its_stage() -> None:
    # a -> b -> c -> d, d saves c: b and c recomputed before d's backward; c reads the b just
    # recomputed, b reads the forward's a, held until then.
    g = chain_of_two()
    assert _steps(g, _staged(g, {"d": ["b", "c"]})) == [
        ("fwd", "a", 20, 20),
        ("fwd", "b", 70, 70),
        ("fwd", "c", 150, 100),  # b freed: c's recomputation reads the recomputed one
        ("fwd", "d", 110, 30),  # the forward's c freed: d's save takes the recomputed one
        ("bwd_start", "", 40, 40),
        ("recompute", "b", 90, 70),  # a, held since the forward, freed once b has read it
        ("recompute", "c", 150, 100),  # the recomputed b freed once c has read it
        ("bwd", "d", 180, 100),
        ("bwd", "c", 150, 70),
        ("bwd", "b", 90, 40),
        ("bwd", "a", 40, 20),
    ]


def test_what_cannot_be_staged_is_refused_with_the_fix() -> None:
    g = chain_graph(4, activation_bytes=100)
    with pytest.raises(ScheduleError, match="not an op of graph"):
        check_schedule(g, Schedule(staged=(("zz", ("n1",)),)))
    with pytest.raises(ScheduleError, match="out of order"):
        check_schedule(g, Schedule(staged=(("n1", ("n0",)), ("n2", ("n1",)))))
    with pytest.raises(ScheduleError, match="execution order"):
        check_schedule(g, Schedule(staged=(("n3", ("n2", "n1")),)))
    with pytest.raises(ScheduleError, match="cannot be recomputed"):
        check_schedule(g, Schedule(staged=(("n3", ("n3",)),)))  # the step's output
    with pytest.raises(ScheduleError, match="either 'staged' or the others"):
        check_schedule(g, Schedule(regions=(("n1",),), staged=(("n3", ("n1",)),)))


def test_a_staged_schedule_round_trips_through_its_file_form(tmp_path: Path) -> None:
    g = _two_savers()
    s = _staged(g, {"d": ["b"], "c": ["a", "b"]})
    data = s.to_dict()
    assert data == {"kind": "staged", "recompute": [["d", ["b"]], ["c", ["a", "b"]]]}
    assert Schedule.from_dict(data) == s
    assert not s.is_keep_set() and s.recomputed_nodes() == frozenset({"a", "b"})
    for bad in ({"kind": "staged"}, {"kind": "staged", "recompute": [["d", []]]}):
        with pytest.raises(ScheduleError, match="recompute"):
            Schedule.from_dict(bad)
    path = tmp_path / "staged.json"
    save_schedule(path, g, s)
    written = json.loads(path.read_text())
    assert written["format_version"] == 4 and load_schedule(path).schedule == s
    path.write_text(json.dumps(dict(written, format_version=3)))
    with pytest.raises(ScheduleError, match=r"version 3 but holds a staged schedule.*version 4"):
        load_schedule(path)
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(
        resources.files("chkpt_opt").joinpath("schemas/schedule-v4.schema.json").read_text()
    )
    jsonschema.validate(written, schema)
    bad_stage = dict(written["schedule"], recompute=[["d", []]])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dict(written, schedule=bad_stage), schema)


def test_a_buffer_an_op_saves_for_itself_is_recomputed_with_it() -> None:
    # The U-Net's pool1 saves its indices for its own backward and returns only its output:
    # recomputed before enc2_1's backward, its indices are recomputed too, and the forward's
    # die after the forward.
    g = load_graph("graphs/unet_layers.json")
    assert "pool1:buf0" not in rebuilt_storages(g)["pool1"]
    assert "pool1:buf0" in recomputed_storages(g)["pool1"]
    staged = _staged(g, {"enc2_1": ["pool1"]})
    steps = lower(g, staged)
    forward = next(s for s in steps if s.kind == "fwd" and s.node == "pool1")
    assert "f:pool1:buf0" in forward.free
    rebuilt = next(s for s in steps if s.kind == "recompute")
    assert (
        dict(rebuilt.alloc)[f"s{steps.index(rebuilt)}:pool1:buf0"]
        == (g.nodes["pool1"]["saved"]["pool1:buf0"])
    )


def _graphs() -> list[CostGraph]:
    return [
        chain_graph(12, activation_bytes=1000),
        random_dag(18, seed=3),
        random_dag(24, seed=4),
        load_graph("graphs/unet_layers.json"),
        load_graph("graphs/mlp_small.json"),
        load_graph("graphs/resnet_small.json"),
    ]


@pytest.mark.parametrize("k", range(6))
def test_schedules_of_regions_cached_and_unpacked_ops_keep_no_less_as_staged_ones(k: int) -> None:
    g = _graphs()[k]
    rng = random.Random(k)
    allowed = recomputable_ops(g)
    checked = 0
    for _ in range(120):
        s = random_general_schedule(g, rng, depth=1)
        inside = frozenset(n for r in s.regions for n in r)
        candidates = unpack_candidates(g, inside)
        s = s.with_unpacked(frozenset(n for n in candidates if rng.random() < 0.4))
        owning = {n for n in s.recomputed_nodes() if g.nodes[n]["outputs"]}  # views: free
        if owning - allowed or not set(cache_candidates(g, s)) >= s.saved:
            continue
        check_schedule(g, s)
        staged = as_staged(g, s)
        profile, as_profile = simulate(g, s), simulate(g, staged)
        assert as_profile.recompute_s <= profile.recompute_s + 1e-12
        assert as_profile.peak_bytes <= profile.peak_bytes
        again = [step.node for step in lower(g, staged) if step.kind == "recompute"]
        assert Counter(recomputed_ops(g, staged)) == Counter(again)  # what lowering runs
        checked += 1
    assert checked >= 5


def test_the_empty_staged_schedule_is_keep_all() -> None:
    g = random_dag(18, seed=3)
    order = ordered_nodes(g)
    assert staged_schedule(g, {order[-1]: []}) == ()
    assert simulate(g, Schedule(staged=())).peak_bytes == simulate(g, Schedule()).peak_bytes


def test_an_op_whose_input_a_later_op_writes_in_place_is_neither_staged_nor_unpacked() -> None:
    # a -> b (reads a) -> c (writes a in place, after b ran) -> d: running b again later
    # would read the written a. Reading a storage written before the reader runs is fine.
    g = _built(
        "later_write",
        [
            ("a", [], {"outputs": {"a": 100}}),
            ("b", ["a"], {"outputs": {"b": 100}, "saved": {"a": 100}}),
            ("c", ["a", "b"], {"outputs": {}, "aliases": ["a"], "is_inplace": True}),
            ("d", ["c"], {"outputs": {"d": 10}, "saved": {"a": 100}}),
        ],
    )
    assert "b" in later_write_readers(g) and "d" not in later_write_readers(g)
    assert "b" not in recomputable_ops(g)
    assert "later op writes in place" in unpack_problem(g, "b")
    with pytest.raises(ScheduleError, match="cannot be recomputed"):
        check_schedule(g, Schedule(staged=(("d", ("b",)),)))


def test_stages_sit_at_ops_with_an_autograd_node_of_their_own() -> None:
    # gpt_small has views and getitems: their backward runs in another op's node, so a
    # stage there is refused.
    g = load_graph("graphs/gpt_small.json")
    hosts = stage_ops(g)
    getitem = next(n for n, a in g.nodes(data=True) if a["op"] == "getitem" and a["has_backward"])
    assert getitem not in hosts
    op = sorted(recomputable_ops(g), key=lambda n: g.nodes[n]["index"])[0]
    with pytest.raises(ScheduleError, match="no autograd node of its own"):
        check_schedule(g, Schedule(staged=((getitem, (op,)),)))
    rng = random.Random(0)
    for _ in range(40):  # a region's replay runs before a backward op that unpacks: a host
        staged = as_staged(g, random_general_schedule(g, rng, depth=1))
        check_schedule(g, staged)
        assert {b for b, _ in staged.staged} <= hosts


def test_recomputations_before_a_view_run_at_the_stage_before() -> None:
    # a -> b -> c -> v (a view of c that saves b) -> d: a region over b, c and v is replayed
    # before v's backward, which unpacks b; v has no autograd node of its own, so as a
    # staged schedule b and c are recomputed at d's stage, the backward before v's.
    g = _built(
        "view_saver",
        [
            ("a", [], {"outputs": {"a": 100}}),
            ("b", ["a"], {"outputs": {"b": 100}, "saved": {"a": 100}}),
            ("c", ["b"], {"outputs": {"c": 100}, "saved": {"b": 100}}),
            ("v", ["c"], {"outputs": {}, "aliases": ["c"], "saved": {"b": 100}}),
            ("d", ["v"], {"outputs": {"d": 10}, "saved": {"c": 100}}),
        ],
    )
    assert "v" not in stage_ops(g)
    region = Schedule(regions=(("b", "c", "v"),))
    staged = as_staged(g, region)
    assert staged.staged == (("d", ("b", "c")),)
    check_schedule(g, staged)
    assert simulate(g, staged).recompute_s == simulate(g, region).recompute_s


def _built(name: str, specs: list[tuple[str, list[str], dict]]) -> CostGraph:
    """A graph of ops ``(name, inputs, attributes)`` in execution order, 1 s forward and
    100 bytes of gradient each; the op named ``d`` is the output."""
    g = new_graph(name)
    for i, (op, preds, attrs) in enumerate(specs):
        g.add_node(op, **node_attrs(index=i, op="op", grad_bytes=100, fwd_time_s=1.0, **attrs))
        for p in preds:
            g.add_edge(p, op)
    g.graph["outputs"] = ["d"]
    check_graph(g)
    return g
