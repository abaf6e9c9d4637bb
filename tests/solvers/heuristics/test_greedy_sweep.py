"""The greedy sweep inside ``auto``'s solve: run to its end once per budget, then served
from the frozen graph's memo (the keep-set stage and the cached-op search both start from
it)."""

from __future__ import annotations

from typing import Any

import pytest

from chkpt_opt.graphs.frozen import frozen
from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.heuristics import greedy_sweep as sweep_module
from chkpt_opt.solvers.heuristics.greedy_sweep import greedy_sweep


@pytest.fixture
def simulations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the sweep's simulations."""
    made: list[int] = []

    def counted(graph: Any, schedule: Schedule, **settings: Any) -> MemoryProfile:
        made.append(1)
        return simulate(graph, schedule, **settings)

    monkeypatch.setattr(sweep_module, "simulate", counted)
    return made


def test_a_sweep_run_to_its_end_is_served_again_inside_the_frozen_block(
    simulations: list[int],
) -> None:
    graph = random_dag(40, seed=2)
    budget = int(0.6 * simulate(graph, Schedule()).peak_bytes)
    with frozen(graph):
        first = greedy_sweep(graph, budget)
        done = len(simulations)
        again = get_solver("greedy")(graph, budget)
        assert len(simulations) == done  # nothing simulated the second time
        assert (again.schedule, again.objective, again.solver) == (
            first.schedule,
            first.objective,
            "greedy",
        )
        greedy_sweep(graph, budget - 1)  # another budget: swept anew
        assert len(simulations) > done
    greedy_sweep(graph, budget)  # outside the block nothing is kept
    assert len(simulations) > 2 * done


def test_a_sweep_cut_by_its_time_limit_is_not_kept(simulations: list[int]) -> None:
    graph = random_dag(40, seed=2)
    budget = int(0.6 * simulate(graph, Schedule()).peak_bytes)
    with frozen(graph):
        cut = greedy_sweep(graph, budget, time_limit_s=0.0)
        assert cut.stats["timed_out"]
        done = len(simulations)
        whole = greedy_sweep(graph, budget)
        assert not whole.stats["timed_out"] and len(simulations) > done
