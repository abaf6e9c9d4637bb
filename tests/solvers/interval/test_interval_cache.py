"""Cache columns of the interval model: slot by slot against the simulator on random
schedules with cached ops, the space they cover, and their refusals."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import check_schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.interval.cache_columns import CacheColumns
from chkpt_opt.solvers.interval.model import simulator_slot_bytes
from tests.conftest import REL, random_interval_choice
from tests.reference.general_enumerate import general_schedules

CORPUS = Path(__file__).resolve().parents[3] / "graphs"


def _check(graph: CostGraph, cache: str, n_schedules: int, rng: random.Random) -> int:
    """Checks ``n_schedules`` random choices; returns how many cached an op."""
    model = build_interval_model(graph, cache=cache)
    assert model.cache == cache
    cached = 0
    for _ in range(n_schedules):
        chosen = random_interval_choice(model, rng)
        schedule = model.schedule(graph, chosen)
        check_schedule(graph, schedule)
        cached += bool(schedule.saved)
        profile = simulate(graph, schedule)
        predicted = model.slot_bytes(chosen)
        for slot, (sim, mod) in enumerate(zip(simulator_slot_bytes(model, profile), predicted)):
            if sim is not None:
                where = (graph.graph["name"], schedule.spans(graph), sorted(schedule.saved))
                assert sim == mod, (*where, model.slots[slot])
        assert max(predicted) == profile.peak_bytes
        assert model.cost_s(chosen) == pytest.approx(profile.recompute_s, rel=REL, abs=1e-15)
    return cached


def test_columns_match_the_simulator_slot_by_slot_on_random_dags() -> None:
    rng = random.Random(0)
    cached = 0
    for n in (2, 3, 5, 8):
        for seed in range(6):
            for skip_prob in (0.3, 0.6):
                graph = random_dag(n, seed=seed, skip_prob=skip_prob, max_inputs=3)
                cached += _check(graph, "subsets", 12, rng)
    for seed in range(4):
        cached += _check(random_dag(20, seed=seed), "ranked", 12, rng)
    assert cached > 150  # most random choices cache something


@pytest.mark.parametrize("name", ["vgg_small", "resnet_small", "encoder_small"])
def test_columns_match_the_simulator_slot_by_slot_on_traced_graphs(name: str) -> None:
    """Views, saved buffers (max-pooling's indices), batch norm, attention."""
    graph = load_graph(CORPUS / f"{name}.json")
    assert _check(graph, "ranked", 20, random.Random(1)) > 0


def test_without_columns_nothing_changes() -> None:
    graph = random_dag(12, seed=3)
    plain = build_interval_model(graph)
    assert plain.cache == "none"
    assert all(not iv.cached for iv in plain.intervals)
    ranked = build_interval_model(graph, cache="ranked")
    assert [iv for iv in ranked.intervals if not iv.cached] == list(plain.intervals)
    spans = [(iv.start, iv.stop) for iv in plain.intervals[:3]]
    # Ids name the column that caches nothing (warm starts from keep-set schedules).
    assert [ranked.intervals[k] for k in ranked.interval_ids(spans)] == list(plain.intervals[:3])


def test_the_columns_cover_keep_set_schedules_and_their_own_sets() -> None:
    graph = chain_graph(5, activation_bytes=1000)
    columns = CacheColumns(graph, "subsets")
    schedules = list(general_schedules(graph))
    covered = [s for s in schedules if columns.covers(s)]
    assert all(columns.covers(s) for s in schedules if s.is_keep_set())
    assert not any(s.nested for s in covered)
    assert any(s.saved for s in covered)
    model = build_interval_model(graph, cache="subsets")
    from_columns = {model.schedule(graph, [k]) for k in range(len(model.intervals))}
    assert all(columns.covers(s) for s in from_columns)
    ranked = CacheColumns(graph, "ranked")
    assert {s for s in covered if ranked.covers(s)} < set(covered)  # prefixes only


def test_bad_modes_and_too_many_subsets_are_refused() -> None:
    with pytest.raises(SolverError, match="cache mode 'all'"):
        build_interval_model(chain_graph(4), cache="all")
    with pytest.raises(SolverError, match="cache='ranked'"):
        build_interval_model(chain_graph(14, activation_bytes=1000), cache="subsets")
