"""A time limit is a promise: a solve given ``time_limit_s`` returns within it (plus a few
seconds for judging the result), with the best it has and an honest status."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from chkpt_opt.graphs.io import load_graph
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers import SolveStatus, get_solver

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
LIMIT_S = 6.0
SLACK_S = 5.0


@pytest.mark.parametrize("solver", ["auto", "pruned", "hierarchical", "milp", "cpsat"])
def test_solvers_return_within_their_time_limit_on_a_586_op_graph(solver: str) -> None:
    graph = load_graph(GRAPHS / "gpt_large.json")
    assert graph.number_of_nodes() >= 400
    keep_all = simulate(graph, get_solver("keep_all")(graph, 10**15).schedule).peak_bytes
    start = time.perf_counter()
    result = get_solver(solver)(graph, int(0.3 * keep_all), time_limit_s=LIMIT_S)
    elapsed = time.perf_counter() - start
    assert elapsed <= LIMIT_S + SLACK_S, (solver, elapsed)
    if result.status == SolveStatus.OPTIMAL:
        assert result.bound is not None and result.objective <= result.bound + 1e-9
    if result.feasible:
        assert simulate(graph, result.schedule).peak_bytes <= int(0.3 * keep_all)
