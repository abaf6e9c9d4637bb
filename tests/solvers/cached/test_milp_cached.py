"""milp_cached: its optimum against brute force over its space on tiny graphs, strictly
below the keep-set optimum where caching pays, never above it, and its time limit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.interval.cache_columns import CacheColumns
from tests.conftest import REL, assert_valid_result
from tests.reference.general_enumerate import general_optimum, general_schedules

CORPUS = Path(__file__).resolve().parents[3] / "graphs"

TINY = {
    "chain5": lambda: chain_graph(5, activation_bytes=[1000, 3000, 1000, 2000, 1000]),
    # Caching pays here: at 6,501,120 bytes the keep-set optimum recomputes 7.37 ms, a
    # region caching its first op 4.05 ms.
    "dag5_s12": lambda: random_dag(5, seed=12, skip_prob=0.5, max_inputs=3),
    "dag5_s4": lambda: random_dag(5, seed=4, skip_prob=0.5, max_inputs=3),
    "dag6_s1": lambda: random_dag(6, seed=1, skip_prob=0.5, max_inputs=3),
}


def _space_peaks(graph: CostGraph, columns: CacheColumns) -> list[int]:
    """The distinct peaks of the schedules in the columns' space."""
    space = [s for s in general_schedules(graph, nesting=False) if columns.covers(s)]
    return sorted({simulate(graph, s, check=False).peak_bytes for s in space})


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_optimum_equals_brute_force_over_its_space(name: str) -> None:
    graph = TINY[name]()
    columns = CacheColumns(graph, "subsets")
    peaks = _space_peaks(graph, columns)
    solver = get_solver("milp_cached", cache="subsets")
    beats_keep_set = 0
    for budget in peaks[:: max(1, len(peaks) // 6)]:
        best = general_optimum(graph, budget, nesting=False, within=columns.covers)
        result = solver(graph, budget, time_limit_s=30)
        assert_valid_result(graph, result, budget)
        assert best is not None  # the budget is one schedule's peak
        assert result.status == SolveStatus.OPTIMAL, (budget, result.stats)
        assert result.objective == pytest.approx(best[1].recompute_s, rel=REL, abs=1e-15)
        assert result.stats["proofs_over"] == "cached_subsets"
        keep = get_solver("enumerate")(graph, budget)
        assert not keep.feasible or result.objective <= keep.objective * (1 + REL)
        beats_keep_set += not keep.feasible or result.objective < keep.objective * (1 - 1e-6)
    if name == "dag5_s12":
        assert beats_keep_set


@pytest.mark.parametrize("name", ["dag5_s12", "dag6_s1"])
def test_below_every_schedule_of_its_space_it_finds_the_lowest_peak(name: str) -> None:
    graph = TINY[name]()
    lowest = _space_peaks(graph, CacheColumns(graph, "subsets"))[0]
    result = get_solver("milp_cached", cache="subsets")(graph, lowest - 1, time_limit_s=30)
    assert result.status == SolveStatus.INFEASIBLE and result.proves_infeasible
    assert result.stats["min_feasible_bytes"] == lowest
    assert result.stats["min_feasible_proven"]
    assert result.peak_bytes == lowest


def test_caching_beats_the_keep_set_optimum_where_it_pays() -> None:
    graph = TINY["dag5_s12"]()
    budget = 6_501_120
    keep = get_solver("milp")(graph, budget)
    for cache in ("subsets", "ranked"):
        result = get_solver("milp_cached", cache=cache)(graph, budget, time_limit_s=30)
        assert result.status == SolveStatus.OPTIMAL
        assert result.schedule.saved
        assert result.objective < 0.6 * keep.objective
        assert result.stats["keep_set"]["objective_s"] == pytest.approx(keep.objective)


@pytest.mark.parametrize("fraction", [0.9, 0.7])
def test_on_a_conv_net_it_is_never_above_the_keep_set_optimum(fraction: float) -> None:
    """On the corpus VGG the optimum with cached ops equals the keep-set one (proven)."""
    graph = load_graph(CORPUS / "vgg_small.json")
    budget = int(simulate(graph, Schedule()).peak_bytes * fraction)
    keep = get_solver("milp")(graph, budget, time_limit_s=30)
    result = get_solver("milp_cached")(graph, budget, time_limit_s=60)
    assert_valid_result(graph, result, budget)
    assert result.status == SolveStatus.OPTIMAL and keep.status == SolveStatus.OPTIMAL
    assert result.objective == pytest.approx(keep.objective, rel=REL)
    assert "ranked" in result.stats["optimal_over"]


def test_a_time_limit_is_kept_with_the_keep_set_result_at_least() -> None:
    """At 0.7 of encoder_small's peak the columns' program takes minutes: out of time, the
    result is the keep-set stage's (how far that stage gets in its 30% depends on the
    machine's load), never worse, and not called optimal."""
    graph = load_graph(CORPUS / "encoder_small.json")
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.7)
    start = time.perf_counter()
    result = get_solver("milp_cached")(graph, budget, time_limit_s=4)
    assert time.perf_counter() - start < 4 + 3
    assert_valid_result(graph, result, budget)
    keep = result.stats["keep_set"]
    assert result.feasible and result.objective <= keep["objective_s"] * (1 + REL)
    assert result.status == SolveStatus.FEASIBLE


def test_bad_settings_are_refused() -> None:
    with pytest.raises(SolverError, match="cache='all'"):
        get_solver("milp_cached", cache="all")(chain_graph(4), 0)
    with pytest.raises(SolverError, match="backend"):
        get_solver("milp_cached", backend="gurobi")(chain_graph(4), 0)
