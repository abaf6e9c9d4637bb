"""Recompute on unpack in the op sequence: hand-computed timelines, the rule's limits
(regions keep their inputs, what may be unpacked), and the schedule's file form."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph, check_graph, new_graph, node_attrs
from chkpt_opt.graphs.synthetic import chain_graph
from chkpt_opt.memory_model.schedule import Schedule, check_schedule
from chkpt_opt.memory_model.schedule_io import load_schedule, save_schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.memory_model.unpack import rebuilt_storages, unpack_candidates
from tests.solvers.bounds.test_general_milp import _mini_segnet


def _steps(graph: CostGraph, schedule: Schedule) -> list[tuple[str, str, int, int]]:
    profile = simulate(graph, schedule)
    return [(p.kind, p.node, p.during_bytes, p.after_bytes) for p in profile.timeline]


def _unpack(*names: str) -> Schedule:
    return Schedule(unpacked=frozenset(names))


def test_a_saved_input_is_rebuilt_before_its_saver_unpacks_it() -> None:
    # n0 -> n1 -> n2 -> n3, 100 bytes each, each saves its input. Unpacked n1: n2's save of
    # n1 keeps n0 instead (kept anyway by n1's own save), so n1 dies after n2 runs and is
    # rebuilt just before n2's backward, freed once it has run.
    g = chain_graph(4, activation_bytes=100, fwd_time_s=[1.0, 2.0, 4.0, 8.0])
    assert _steps(g, _unpack("n1")) == [
        ("fwd", "n0", 100, 100),
        ("fwd", "n1", 200, 200),
        ("fwd", "n2", 300, 200),  # n1 freed: its last reader ran, nothing keeps it
        ("fwd", "n3", 300, 300),
        ("bwd_start", "", 400, 400),
        ("bwd", "n3", 500, 400),  # keep-all holds n1 here: 600 during
        ("recompute", "n1", 500, 500),
        ("bwd", "n2", 600, 400),  # the rebuilt n1 freed with n2's incoming gradient
        ("bwd", "n1", 500, 300),
        ("bwd", "n0", 300, 200),
    ]
    profile = simulate(g, _unpack("n1"))
    assert profile.recompute_s == 2.0
    assert profile.compute_s == pytest.approx(15.0 + 2 * 15.0 + 2.0)


def test_an_op_that_saves_its_own_output_rebuilds_it_for_its_own_backward() -> None:
    g = chain_graph(4, activation_bytes=100, fwd_time_s=[1.0, 2.0, 4.0, 8.0], saves="output")
    assert _steps(g, _unpack("n1")) == [
        ("fwd", "n0", 100, 100),
        ("fwd", "n1", 200, 200),
        ("fwd", "n2", 300, 200),
        ("fwd", "n3", 300, 300),
        ("bwd_start", "", 400, 400),
        ("bwd", "n3", 500, 500),
        ("bwd", "n2", 600, 400),
        ("recompute", "n1", 500, 500),
        ("bwd", "n1", 600, 400),
        ("bwd", "n0", 400, 200),
    ]


def spec_graph(name: str, specs: list[tuple[str, list[str], int, dict[str, int]]]) -> CostGraph:
    """A graph of ops ``(name, inputs, output bytes, saved storages)`` in execution order,
    the k-th taking k + 1 seconds forward; the last op is the output."""
    g = new_graph(name)
    for i, (op, preds, nbytes, saved) in enumerate(specs):
        g.add_node(
            op,
            **node_attrs(
                index=i,
                op="op",
                outputs={op: nbytes},
                saved=saved,
                grad_bytes=nbytes,
                fwd_time_s=float(i + 1),
            ),
        )
        for p in preds:
            g.add_edge(p, op)
    g.graph["outputs"] = [specs[-1][0]]
    check_graph(g)
    return g


def _two_savers() -> CostGraph:
    """a -> b -> c -> d and b -> d; b (50 bytes) is saved by c and d, a by b."""
    return spec_graph(
        "two_savers",
        [
            ("a", [], 100, {}),
            ("b", ["a"], 50, {"a": 100}),
            ("c", ["b"], 100, {"b": 50}),
            ("d", ["b", "c"], 10, {"b": 50, "c": 100}),
        ],
    )


def chain_of_two() -> CostGraph:
    """a (20) -> b (50) -> c (80) -> d (10); d saves c, nothing else is saved."""
    return spec_graph(
        "chain_of_two",
        [
            ("a", [], 20, {}),
            ("b", ["a"], 50, {}),
            ("c", ["b"], 80, {}),
            ("d", ["c"], 10, {"c": 80}),
        ],
    )


def test_the_rebuild_runs_before_the_first_saver_and_lives_to_the_last() -> None:
    g = _two_savers()
    assert _steps(g, _unpack("b")) == [
        ("fwd", "a", 100, 100),
        ("fwd", "b", 150, 150),
        ("fwd", "c", 250, 250),
        ("fwd", "d", 260, 210),  # b freed after its last reader: c and d keep a instead
        ("bwd_start", "", 220, 220),
        ("recompute", "b", 270, 270),  # before d's backward, which unpacks b first
        ("bwd", "d", 420, 320),  # gradients of b and c; c (saved by d) freed
        ("bwd", "c", 370, 220),  # a second gradient of b; the rebuilt b freed: c was last
        ("accumulate", "c", 270, 170),
        ("bwd", "b", 270, 120),  # a's gradient; a (kept by b and both recipes) freed
        ("bwd", "a", 120, 20),
    ]
    assert simulate(g, _unpack("b")).recompute_s == 2.0


def test_a_chain_rebuilds_the_inner_op_first_and_frees_it_after_the_outer() -> None:
    # chain_of_two: d saves c, nothing else is saved. With b and c unpacked, c's recipe
    # holds a handle on b's recipe, which holds a: b dies after c runs,
    # and both are rebuilt before d's backward, b first, b freed once c is rebuilt.
    g = chain_of_two()
    assert _steps(g, _unpack("b", "c")) == [
        ("fwd", "a", 20, 20),
        ("fwd", "b", 70, 70),  # a held by b's recipe
        ("fwd", "c", 150, 100),  # b freed: c's recipe holds b's recipe, not b
        ("fwd", "d", 110, 30),  # c freed: d's save is c's recipe
        ("bwd_start", "", 40, 40),
        ("recompute", "b", 90, 90),
        ("recompute", "c", 170, 120),  # the rebuilt b freed once c is rebuilt
        ("bwd", "d", 200, 100),  # the rebuilt c and a (the recipes' input) freed
        ("bwd", "c", 150, 70),
        ("bwd", "b", 90, 40),
        ("bwd", "a", 40, 20),
    ]
    assert simulate(g, _unpack("b", "c")).recompute_s == 5.0
    assert unpack_candidates(g, frozenset()) == ["c"]
    assert unpack_candidates(g, frozenset(), frozenset({"c"})) == ["b", "c"]


def test_a_region_keeps_its_input_so_unpacking_it_changes_nothing() -> None:
    # n1 is the input of the region (n2, n3), whose checkpoint keeps it; n2's save of it is
    # the checkpoint's (inside the region), so no saver outside a region takes a recipe.
    g = chain_graph(5, activation_bytes=100, fwd_time_s=[1.0, 2.0, 4.0, 8.0, 16.0])
    region = Schedule(regions=(("n2", "n3"),))
    both = Schedule(regions=region.regions, unpacked=frozenset({"n1"}))
    assert _steps(g, both) == _steps(g, region)
    assert simulate(g, both).recompute_s == simulate(g, region).recompute_s
    # n0 (saved by n1) is worth unpacking; n1 is saved inside the region only, n4 returned
    assert unpack_candidates(g, frozenset({"n2", "n3"})) == ["n0"]


def test_the_mini_segnet_runs_the_checkmate_schedule() -> None:
    # conv1 unpacked: pool1's save of conv1's output keeps nothing (conv1 reads the
    # resident input), conv1 is rebuilt for pool1's backward: Checkmate's schedule of
    # tests/solvers/bounds/test_general_milp.py, 4.588e-7 s at a peak of 99,480 bytes.
    g = _mini_segnet()
    profile = simulate(g, _unpack("conv1"))
    assert profile.peak_bytes == 99_480
    assert profile.recompute_s == pytest.approx(4.58752e-07, rel=1e-12)
    assert simulate(g, Schedule()).peak_bytes == 132_248


def test_a_buffer_another_op_saves_is_rebuilt_one_only_its_owner_saves_is_not() -> None:
    # pool1's indices (a buffer) are saved by unpool1 too: a returned value, rebuilt; the
    # loss's log-softmax buffer is its own. Unpacking pool1 then frees its indices after
    # the forward pass (unpool1 and pool1 keep conv1's output instead, kept anyway).
    g = _mini_segnet()
    rebuilt = rebuilt_storages(g)
    assert rebuilt["pool1"] == {"pool1", "pool1:buf0"} and rebuilt["loss"] == {"loss"}
    keep_all = simulate(g, Schedule())
    unpacked = simulate(g, _unpack("pool1"))
    steps = [(p.kind, p.node) for p in unpacked.timeline]
    assert steps.index(("recompute", "pool1")) + 1 == steps.index(("bwd", "unpool1"))
    forward_end = [p.after_bytes for p in keep_all.timeline if p.kind == "fwd"][-1]
    # the indices freed (the pooled output, which nothing saves, is freed either way)
    assert [p.after_bytes for p in unpacked.timeline if p.kind == "fwd"][-1] == forward_end - 16_384


def test_what_cannot_be_unpacked_is_refused_with_the_fix() -> None:
    g = chain_graph(5, activation_bytes=100)
    with pytest.raises(ScheduleError, match=r"'nope' is not in graph.*Drop it"):
        check_schedule(g, _unpack("nope"))
    with pytest.raises(ScheduleError, match=r"'n2' lies in a recompute region.*take it out"):
        check_schedule(g, Schedule(regions=(("n2", "n3"),), unpacked=frozenset({"n2"})))
    with pytest.raises(ScheduleError, match="'n4' is a step output"):
        check_schedule(g, _unpack("n4"))
    flags = {
        "is_random": "draws random numbers",
        "is_stateful": "updates module state",
        "is_inplace": "writes a tensor in place",
    }
    for flag, problem in flags.items():
        bad = chain_graph(5, activation_bytes=100)
        bad.nodes["n1"][flag] = True
        with pytest.raises(ScheduleError, match=rf"'n1' {problem}.*Drop it from 'unpacked'"):
            check_schedule(bad, _unpack("n1"))
    view = chain_graph(5, activation_bytes=100)
    view.nodes["n1"].update(outputs={}, aliases=["n0"], is_view=True)
    with pytest.raises(ScheduleError, match="'n1' returns a view"):
        check_schedule(view, _unpack("n1"))


def test_unpacked_ops_round_trip_as_a_version_three_file(tmp_path: Path) -> None:
    g = chain_graph(6, activation_bytes=100)
    s = Schedule(regions=(("n3", "n4"),), unpacked=frozenset({"n1"}))
    assert not s.is_keep_set()
    assert Schedule.from_dict(s.to_dict()) == s
    assert "unpacked" not in Schedule(regions=s.regions, nested=(), saved=frozenset()).to_dict()
    path = tmp_path / "unpacked.json"
    save_schedule(path, g, s)
    data = json.loads(path.read_text())
    assert data["format_version"] == 3 and data["schedule"]["unpacked"] == ["n1"]
    assert load_schedule(path).schedule == s
    path.write_text(json.dumps(dict(data, format_version=2)))
    with pytest.raises(ScheduleError, match=r"format_version 2 but holds unpacked ops.*version 3"):
        load_schedule(path)
    with pytest.raises(ScheduleError, match="'unpacked' must be a list of node names"):
        Schedule.from_dict(dict(s.to_dict(), unpacked="n1"))
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(
        resources.files("chkpt_opt").joinpath("schemas/schedule-v3.schema.json").read_text()
    )
    jsonschema.validate(data, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dict(data, schedule=dict(data["schedule"], unpacked=[1])), schema)


def test_measured_hook_calls_are_charged_for_every_tensor_saved_under_the_hooks() -> None:
    # n0..n3 each save their input; n1 unpacked: the hooks see the saves of n1, n2, n3
    # (3 tensors), packed in the forward and unpacked in the backward
    g = chain_graph(4, activation_bytes=100, fwd_time_s=[1.0, 2.0, 4.0, 8.0])
    plain = simulate(g, _unpack("n1")).recompute_s
    g.graph["cached_op_overhead_s"] = 0.25
    assert simulate(g, _unpack("n1")).recompute_s == pytest.approx(plain + 2 * 3 * 0.25)
    assert simulate(g, _unpack("n2")).recompute_s == pytest.approx(4.0 + 2 * 2 * 0.25)
    assert simulate(g, Schedule()).recompute_s == 0.0
