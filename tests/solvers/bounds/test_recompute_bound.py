"""The recompute bound: never above the cost of any schedule that fits (keep-set, nested or
cached), close to the proven optimum where one is known, within its deadline, and what
``auto`` reports on graphs too large for the integer programs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver, smallest_peak
from chkpt_opt.solvers.bounds.integer_cover import integer_cover_bound
from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound
from chkpt_opt.solvers.bounds.timed_bound import timed_bound
from chkpt_opt.solvers.deadline import Deadline
from tests.general_schedules import schedules_and_profiles
from tests.reference.general_enumerate import general_optimum, general_smallest_peak

CORPUS = Path(__file__).resolve().parents[3] / "graphs"
SLACK = 1e-12


@pytest.mark.parametrize("name", ["gpt_small", "resnet_small", "unet_small", "vit_small"])
def test_the_bound_is_below_the_cost_of_random_schedules_at_their_own_peak(name: str) -> None:
    graph = load_graph(CORPUS / f"{name}.json")
    for k, (schedule, profile) in enumerate(schedules_and_profiles(graph, 12)):
        bound = recompute_bound(graph, profile.peak_bytes)
        assert bound.floor_bytes <= profile.peak_bytes
        assert not bound.proves_infeasible
        assert bound.bound_s is not None
        assert bound.bound_s <= profile.recompute_s + SLACK, (k, schedule)


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_is_below_the_exact_keep_set_optimum_on_random_dags(seed: int) -> None:
    graph = random_dag(16, seed=seed, skip_prob=0.3, max_inputs=3)
    keep_all = simulate(graph, Schedule()).peak_bytes
    assert recompute_bound(graph, keep_all).floor_bytes <= smallest_peak(graph).peak_bytes
    for fraction in (0.95, 0.8, 0.65, 0.5, 0.35):
        budget = int(keep_all * fraction)
        exact = get_solver("cpsat")(graph, budget, time_limit_s=30)
        assert exact.proven
        bound = recompute_bound(graph, budget)
        if bound.proves_infeasible:
            assert not exact.feasible
            continue
        assert bound.bound_s is not None and bound.complete
        if exact.feasible:
            assert bound.bound_s <= exact.objective + SLACK, fraction


@pytest.mark.parametrize(
    "graph",
    [chain_graph(4, activation_bytes=1000), random_dag(4, seed=0, skip_prob=0.4, max_inputs=3)],
    ids=["chain4", "dag4"],
)
def test_the_bounds_hold_beyond_keep_set_against_brute_force(graph: CostGraph) -> None:
    """The recompute bound, the same program in integers and the time-indexed bound,
    against one brute-force optimum."""
    keep_all = simulate(graph, Schedule()).peak_bytes
    assert recompute_bound(graph, keep_all).floor_bytes <= general_smallest_peak(graph)
    assert integer_cover_bound(graph, keep_all) == 0.0
    for fraction in (0.85, 0.65):
        budget = int(keep_all * fraction)
        best = general_optimum(graph, budget)
        bound = recompute_bound(graph, budget)
        integer = integer_cover_bound(graph, budget)
        timed = timed_bound(graph, budget)
        if best is None:
            continue
        assert not bound.proves_infeasible
        assert bound.bound_s is not None and bound.bound_s <= best[1].recompute_s + SLACK
        assert integer is not None and bound.bound_s - 1e-9 <= integer
        assert integer <= best[1].recompute_s + SLACK
        assert timed.bound_s is not None and timed.bound_s <= best[1].recompute_s + SLACK


def test_the_bound_is_close_to_the_proven_optimum_at_a_loose_budget() -> None:
    graph = load_graph(CORPUS / "encoder_small.json")
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.9)
    exact = get_solver("cpsat")(graph, budget, time_limit_s=60)
    assert exact.status.value == "optimal"
    bound = recompute_bound(graph, budget)
    assert bound.bound_s is not None
    assert 0.9 * exact.objective <= bound.bound_s <= exact.objective + SLACK


def test_a_storage_larger_than_the_room_of_a_step_is_recomputed_wholly() -> None:
    """On vgg_small at 0.7 of its keep-all peak, the relaxation alone would recompute
    fractions of the large activations (0.83 of the optimum); the rule that a storage
    larger than what the budget leaves at a step is dead there lifts it to 0.92."""
    graph = load_graph(CORPUS / "vgg_small.json")
    budget = int(0.7 * simulate(graph, Schedule()).peak_bytes)
    optimum = get_solver("auto")(graph, budget, time_limit_s=20)
    assert optimum.status.value == "optimal"
    bound = recompute_bound(graph, budget)
    assert bound.complete and bound.bound_s is not None
    assert 0.9 * optimum.objective <= bound.bound_s <= optimum.objective


def test_a_budget_below_the_floor_is_proven_infeasible_and_nothing_fits() -> None:
    graph = load_graph(CORPUS / "resnet_small.json")
    floor = recompute_bound(graph, 0).floor_bytes
    bound = recompute_bound(graph, floor - 1)
    assert bound.proves_infeasible and bound.bound_s is None
    assert not get_solver("auto")(graph, floor - 1, time_limit_s=20).feasible
    assert get_solver("auto")(graph, floor - 1, time_limit_s=20).proves_infeasible


def test_nothing_to_recompute_when_keep_all_fits() -> None:
    graph = random_dag(10, seed=3)
    bound = recompute_bound(graph, simulate(graph, Schedule()).peak_bytes)
    assert bound.bound_s == 0.0 and bound.steps == 0


def test_an_expired_deadline_returns_at_once_without_a_bound() -> None:
    graph = load_graph(CORPUS / "gpt_small.json")
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.5)
    start = time.perf_counter()
    bound = recompute_bound(graph, budget, deadline=Deadline.after(0.0))
    assert time.perf_counter() - start < 5.0
    assert bound.bound_s is None and not bound.complete and not bound.proves_infeasible


@pytest.mark.slow  # 18-26 s: CI keeps to 15 min
def test_auto_reports_a_proven_gap_on_a_586_op_graph_within_its_time_limit() -> None:
    graph = load_graph(CORPUS / "gpt_large.json")
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.3)
    start = time.perf_counter()
    result = get_solver("auto")(graph, budget, time_limit_s=20)
    assert time.perf_counter() - start < 20 + 5
    assert result.feasible and result.bound is not None
    assert 0 < result.bound <= result.objective + SLACK
    assert result.stats["recompute_bound"]["bound_s"] == pytest.approx(result.bound)


def test_auto_beyond_keep_set_reports_the_bound_and_the_floor_of_every_schedule() -> None:
    graph = chain_graph(24, activation_bytes=1 << 20)
    keep_min = smallest_peak(graph).peak_bytes
    for budget in (int(keep_min * 0.8), 0):
        result = get_solver("auto", general=True)(graph, budget, time_limit_s=20)
        assert result.stats["beyond_keep_set"]
        if result.feasible:  # a nested schedule under the keep-set floor, with a bound
            assert result.peak_bytes < keep_min
            assert result.bound is not None and 0 < result.bound <= result.objective + SLACK
        else:
            lower = result.stats["recompute_bound"]["floor_bytes"]
            assert 0 < lower <= result.peak_bytes <= keep_min


def test_auto_stops_where_the_lowest_keep_set_peak_meets_the_floor_of_every_schedule() -> None:
    """Nothing fits, and the keep-set stages' lowest peak is the recompute bound's floor,
    which holds over every schedule: auto does not search beyond keep-set, and says its
    proof holds over every schedule (brute force over nested and cached ones agrees)."""
    graph = chain_graph(4, activation_bytes=1000)
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.65)
    result = get_solver("auto")(graph, budget, time_limit_s=20)
    assert not result.feasible and result.proves_infeasible
    assert result.stats["proofs_over"] == "every_schedule"
    assert "beyond_keep_set" not in result.stats
    assert result.peak_bytes == result.stats["recompute_bound"]["floor_bytes"]
    assert general_optimum(graph, budget) is None
