"""A time limit is a promise: a solve given ``time_limit_s`` returns within it (plus a few
seconds for judging the result), with the best it has and an honest status."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.deadline import GRACE_S, Deadline, DeadlineExceeded, run_within
from chkpt_opt.solvers.engines import milp_engine
from chkpt_opt.solvers.interval_builder import build_interval_model
from chkpt_opt.solvers.interval_program import build_program

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


def test_run_within_returns_the_value_and_raises_the_error_of_a_call_that_ends_in_time() -> None:
    deadline = Deadline.after(5.0)
    assert run_within(deadline, lambda: 7, what="a quick call") == 7
    with pytest.raises(ZeroDivisionError):
        run_within(deadline, lambda: 1 / 0, what="a failing call")
    assert run_within(Deadline.after(None), lambda: "no limit", what="a call") == "no limit"


def test_run_within_leaves_a_call_that_overruns_its_deadline() -> None:
    start = time.perf_counter()
    with pytest.raises(DeadlineExceeded, match="a slow call was still running"):
        run_within(Deadline.after(0.2), lambda: time.sleep(3.0), what="a slow call", grace_s=0.2)
    assert time.perf_counter() - start < 1.5


def test_a_milp_solve_that_overruns_the_deadline_is_left_with_an_honest_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graph = chain_graph(8, activation_bytes=1000)
    program = build_program(build_interval_model(graph))

    def slow_run(*args: object, **kwargs: object) -> int:
        time.sleep(3.0)  # a backend that ignores its time limit, releasing the GIL
        raise AssertionError("the solve was waited for past its deadline")

    monkeypatch.setattr(milp_engine, "run_milp", slow_run)
    start = time.perf_counter()
    outcome = milp_engine.solve_milp(program, 6000, deadline=Deadline.after(0.3))
    assert time.perf_counter() - start < 0.3 + GRACE_S + 0.5
    assert outcome.chosen is None and not outcome.proven_optimal
    assert outcome.stats["milp_left_at_deadline"] is True
    assert outcome.stats["milp_status"] == "NOT_SOLVED"
