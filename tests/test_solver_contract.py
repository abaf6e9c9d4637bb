"""The contract every registered solver keeps, checked for all of them over the same small
graphs and budgets through the one validity check (tests/conftest.py): a valid result, or a
refusal with a message; statuses, bounds and proofs that no other solver's result
contradicts."""

from __future__ import annotations

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveResult, SolveStatus, available_solvers, get_solver
from tests.conftest import assert_valid_result

GRAPHS = {
    "chain8": lambda: chain_graph(8, activation_bytes=[(k % 3 + 1) << 12 for k in range(8)]),
    "dag9": lambda: random_dag(9, seed=4, skip_prob=0.5, max_inputs=3),
    "dag24": lambda: random_dag(24, seed=1),
}
FRACTIONS = (1.0, 0.8, 0.55, 0.3, 0.0)
TIME_LIMIT_S = 10.0
SLACK = 1e-6


def _solve_all(graph: CostGraph, budget: int) -> dict[str, SolveResult]:
    results = {}
    for name in available_solvers():
        try:
            result = get_solver(name)(graph, budget, time_limit_s=TIME_LIMIT_S)
        except SolverError as err:  # a documented refusal (graph too large, no blocks, ...)
            assert str(err).strip(), name
            continue
        assert_valid_result(graph, result, budget, rel=SLACK, abs_objective=1e-12)
        assert result.solver == name
        results[name] = result
    return results


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_every_registered_solver_keeps_the_contract(graph_name: str, fraction: float) -> None:
    graph = GRAPHS[graph_name]()
    budget = int(simulate(graph, Schedule()).peak_bytes * fraction)
    results = _solve_all(graph, budget)
    assert {"keep_all", "greedy", "sqrt", "auto"} <= set(results)
    # Proofs hold over keep-set schedules: they are checked against the results in that
    # space; schedules beyond it (nested regions, cached ops) may do better. A solver of
    # the larger space proves nothing unless it names the space it is exact over
    # (``optimal_over``); that space holds the keep-set schedules, so its proofs must hold
    # against every keep-set result too.
    general = {n for n, r in results.items() if r.stats.get("space") == "general"} | {
        n for n, r in results.items() if not r.schedule.is_keep_set()
    }
    keep_set = {n: r for n, r in results.items() if n not in general}
    feasible = [r.objective for r in results.values() if r.schedule.is_keep_set() and r.feasible]
    best = min(feasible, default=None)
    anything = [r.objective for r in results.values() if r.feasible]
    for name, result in results.items():
        if name in general and "optimal_over" not in result.stats:
            # Beyond keep-set the only proofs are over every schedule (the recompute bound
            # and its floor): held against every result, keep-set or not.
            if result.bound is not None and anything:
                assert result.bound <= min(anything) * (1 + SLACK) + 1e-12, name
            if result.status == SolveStatus.OPTIMAL:
                assert result.bound is not None, name
                assert result.objective <= result.bound * (1 + SLACK) + 1e-12, name
            assert not (result.proves_infeasible and anything), name
            continue
        if result.proves_infeasible:
            assert not feasible, (name, "proved infeasible, but a schedule fits")
        if best is None:
            continue
        slack = best * SLACK + 1e-12
        if result.status == SolveStatus.OPTIMAL:
            assert result.objective <= best + slack, (name, result.objective, best)
        if result.bound is not None:
            assert result.bound <= best + slack, (name, result.bound, best)
    auto = results["auto"]
    if feasible:
        assert auto.feasible
    if any(r.proven for r in keep_set.values()):
        if auto.schedule.is_keep_set():
            assert auto.proven, auto.stats.get("tried")
        else:  # beyond keep-set only when it beats the keep-set proof
            assert auto.stats["keep_set"]["status"] in ("optimal", "infeasible")
