"""dp_nested's block options (solvers/unit_options.py): keep-set schedules inside the blocks
of a separator chain, weighed by the top frame. Their bytes are read off the op sequence;
the DP's optimum equals brute force over region trees and options on small graphs, and
adding them never makes a plan costlier."""

from __future__ import annotations

import itertools
import random

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.schedule import Schedule
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.deadline import NO_DEADLINE
from chkpt_opt.solvers.dp_nested import OPTIONS_SPACE, SEPARATOR_SPACE, predict
from chkpt_opt.solvers.nested_chain import plan_schedule
from chkpt_opt.solvers.separator_chain import separator_chain
from chkpt_opt.solvers.unit_options import with_options
from tests.conftest import assert_valid_result
from tests.test_separator_chain import _all_plans

SEEDS = [21, 79]  # random DAGs of 9 ops with block options, all counted exactly


@pytest.mark.parametrize("seed", SEEDS)
def test_dp_optimum_equals_brute_force_over_plans_and_block_options(seed: int) -> None:
    graph = random_dag(9, seed=seed, skip_prob=0.5, max_inputs=2)
    chain = with_options(graph, separator_chain(graph), deadline=NO_DEADLINE)
    assert chain.exact and sum(map(len, chain.options)) >= 3
    profiles = []
    for plan in _all_plans(0, chain.n, False):
        try:
            predict(graph, plan_schedule(graph, chain, plan))
        except SolverError:  # a region holding no packer: never better, outside the space
            continue
        free = [u for u in range(chain.n) if not any(a <= u < b for a, b, _ in plan)]
        ways = [[None, *range(len(chain.options[u]))] for u in free]
        for choice in itertools.product(*ways):
            picks = tuple((u, k) for u, k in zip(free, choice) if k is not None)
            schedule = plan_schedule(graph, chain, plan, picks)
            profiles.append(simulate(graph, schedule))
    keep_all = simulate(graph, Schedule()).peak_bytes
    lowest = min(p.peak_bytes for p in profiles)
    used = False
    for budget in sorted({(keep_all + lowest) // 2, (keep_all + 3 * lowest) // 4, lowest}):
        result = get_solver("dp_nested")(graph, budget)
        assert_valid_result(graph, result, budget)
        proof = result.stats["space_proof"]
        assert proof["over"] == SEPARATOR_SPACE + OPTIONS_SPACE
        best = min(p.recompute_s for p in profiles if p.peak_bytes <= budget)
        assert result.status == SolveStatus.FEASIBLE and proof["optimal"], budget
        assert result.objective == pytest.approx(best, rel=1e-12, abs=1e-15)
        without = get_solver("dp_nested", block_options=False)(graph, budget)
        used |= not without.feasible or without.objective > result.objective * (1 + 1e-9)
    below = get_solver("dp_nested")(graph, lowest - 1)
    assert below.status == SolveStatus.INFEASIBLE
    assert below.stats["space_proof"]["infeasible"]
    assert below.peak_bytes == lowest == below.stats["space_proof"]["min_peak_lower_bytes"]
    assert used, "the options never mattered on this graph"


def test_block_options_never_make_a_plan_costlier() -> None:
    rng = random.Random(3)
    better = compared = 0
    for k in range(200):
        if compared >= 24:
            break
        graph = random_dag(
            rng.randint(8, 12), seed=100 + k, skip_prob=rng.choice([0.3, 0.5]), max_inputs=2
        )
        try:
            separator_chain(graph)
        except SolverError:
            continue
        keep_all = simulate(graph, Schedule()).peak_bytes
        for fraction in (0.85, 0.7):
            budget = int(fraction * keep_all)
            plain = get_solver("dp_nested", block_options=False)(graph, budget)
            with_opts = get_solver("dp_nested")(graph, budget)  # judged by the simulator
            assert_valid_result(graph, with_opts, budget)
            if plain.feasible:
                assert with_opts.feasible
                assert with_opts.objective <= plain.objective * (1 + 1e-12), (k, fraction)
                better += with_opts.objective < plain.objective * (1 - 1e-9)
                compared += 1
            else:
                assert with_opts.peak_bytes <= plain.peak_bytes, (k, fraction)
    assert compared >= 24 and better >= 3, (compared, better)
