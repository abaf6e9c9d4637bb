"""The time-indexed bound: never above the cost of any schedule that fits (random general
schedules, exact staged optima; brute force beside the recompute bound, in
test_recompute_bound.py), and tight where the recompute bound prices multi-level schedules
as one recomputation per op (a chain below its square-root budget)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound
from chkpt_opt.solvers.bounds.timed_bound import timed_bound
from tests.general_schedules import schedules_and_profiles

CORPUS = Path(__file__).resolve().parents[3] / "graphs"
SLACK = 1e-12


@pytest.mark.parametrize("name", ["gpt_small", "vit_small"])
def test_the_bound_is_below_the_cost_of_random_schedules_at_their_own_peak(name: str) -> None:
    graph = load_graph(CORPUS / f"{name}.json")
    for k, (schedule, profile) in enumerate(schedules_and_profiles(graph, 8)):
        bound = timed_bound(graph, profile.peak_bytes)
        assert not bound.proves_infeasible and bound.bound_s is not None
        assert bound.bound_s <= profile.recompute_s + SLACK, (k, schedule)


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_is_below_the_staged_optimum_on_random_dags(seed: int) -> None:
    """Staged schedules recompute an op at several stages: the bound holds over them."""
    graph = random_dag(12, seed=seed, skip_prob=0.3, max_inputs=3)
    keep_all = simulate(graph, Schedule()).peak_bytes
    for fraction in (0.8, 0.6, 0.45):
        budget = int(keep_all * fraction)
        staged = get_solver("staged")(graph, budget, time_limit_s=30)
        bound = timed_bound(graph, budget)
        if bound.proves_infeasible:
            assert not staged.feasible
            continue
        if staged.feasible:
            assert bound.bound_s is not None
            assert bound.bound_s <= staged.objective + SLACK, (fraction, staged.status)


def test_below_the_square_root_budget_it_proves_the_nested_optimum() -> None:
    """A 16-op chain at 0.3 of its keep-all peak: the nested optimum recomputes early ops
    several times (0.091 s); the recompute bound counts each once (0.013 s), the
    time-indexed bound meets the optimum, a proof over every schedule."""
    graph = chain_graph(16, activation_bytes=1 << 20)
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.3)
    nested = get_solver("dp_nested")(graph, budget, time_limit_s=20)
    timed = timed_bound(graph, budget)
    assert nested.proven and timed.bound_s is not None
    assert timed.bound_s <= nested.objective + SLACK
    assert timed.bound_s >= nested.objective * (1 - 1e-6)
    assert recompute_bound(graph, budget).bound_s < 0.2 * timed.bound_s


def test_a_budget_below_the_floor_is_proven_infeasible() -> None:
    graph = chain_graph(8, activation_bytes=1000)
    floor = recompute_bound(graph, 0).floor_bytes
    assert timed_bound(graph, floor - 1).proves_infeasible
    assert timed_bound(graph, simulate(graph, Schedule()).peak_bytes).bound_s == 0.0
