"""The staged program against brute force: on graphs small enough to simulate every staged
schedule, ``solver="staged"`` returns the cheapest that fits, and its bound lies under it."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.memory_model.staged import recomputable_ops, staged_schedule
from chkpt_opt.solvers import SolveStatus, get_solver
from tests.memory_model.test_unpack_sequence import _two_savers, chain_of_two
from tests.solvers.bounds.test_general_milp import _mini_segnet

GRAPHS = {
    "chain4": lambda: chain_graph(4, activation_bytes=[300, 100, 200, 50], fwd_time_s=[1, 3, 2, 4]),
    "two_savers": _two_savers,
    "chain_of_two": chain_of_two,
}


def _every_staged(graph: CostGraph) -> list[Schedule]:
    stages = [n for n in reversed(ordered_nodes(graph)) if graph.nodes[n]["has_backward"]]
    ops = sorted(recomputable_ops(graph), key=lambda n: graph.nodes[n]["index"])
    subsets = [c for k in range(len(ops) + 1) for c in itertools.combinations(ops, k)]
    return [
        Schedule(staged=staged_schedule(graph, dict(zip(stages, pick, strict=True))))
        for pick in itertools.product(subsets, repeat=len(stages))
    ]


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_the_staged_program_finds_the_cheapest_staged_schedule_that_fits(name: str) -> None:
    graph = GRAPHS[name]()
    profiles = [simulate(graph, s, check=False) for s in _every_staged(graph)]
    assert len(profiles) >= 2**9
    floor = min(p.peak_bytes for p in profiles)
    keep_all = simulate(graph, Schedule()).peak_bytes
    for budget in sorted({keep_all, floor, (keep_all + floor) // 2, (3 * floor + keep_all) // 4}):
        cheapest = min(p.recompute_s for p in profiles if p.peak_bytes <= budget)
        result = get_solver("staged")(graph, budget, time_limit_s=20)
        assert result.feasible, (name, budget)
        assert result.objective == pytest.approx(cheapest, abs=1e-12), (name, budget)
        assert result.bound is not None and result.bound <= cheapest + 1e-12
        assert result.status == SolveStatus.OPTIMAL
    below = get_solver("staged")(graph, floor - 1, time_limit_s=20)
    assert not below.feasible


def test_the_result_is_never_costlier_than_its_warm_start() -> None:
    graph = _mini_segnet()
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.7)
    warm = get_solver("cached")(graph, budget, time_limit_s=10)
    assert warm.feasible
    result = get_solver("staged", warm_start=warm.schedule)(graph, budget, time_limit_s=20)
    assert result.feasible and result.objective <= warm.objective + 1e-12
    assert result.stats["rounds"], "the program ran"


def test_a_limit_that_cuts_the_program_is_kept_and_said() -> None:
    # gpt_small (106 ops): the programs take far longer than a second
    graph = load_graph(Path(__file__).resolve().parents[3] / "graphs" / "gpt_small.json")
    budget = int(0.6 * simulate(graph, Schedule()).peak_bytes)
    start = time.monotonic()
    result = get_solver("staged")(graph, budget, time_limit_s=1.0)
    assert time.monotonic() - start < 4.0
    assert result.status == SolveStatus.TIMED_OUT and not result.proves_infeasible
