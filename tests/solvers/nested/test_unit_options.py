"""dp_nested's block options (solvers/nested/unit_options.py): keep-set schedules inside the blocks
of a separator chain, weighed by the top frame. Their bytes are read off the op sequence;
the DP's optimum equals brute force over region trees and options on small graphs, and
adding them never makes a plan costlier."""

from __future__ import annotations

import itertools
import random

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import ordered_nodes
from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.deadline import NO_DEADLINE
from chkpt_opt.solvers.nested.dp_nested import (
    OPTIONS_SPACE,
    SEPARATOR_SPACE,
    evaluate_plan,
    predict,
)
from chkpt_opt.solvers.nested.separator_chain import separator_chain, separators
from chkpt_opt.solvers.nested.unit_chain import NestedChain, Plan, plan_schedule
from chkpt_opt.solvers.nested.unit_options import with_options
from tests.conftest import assert_valid_result
from tests.solvers.nested.test_separator_chain import _all_plans, _random_plan


def _free_units(
    chain: NestedChain, plan: Plan, start: int, stop: int, path: tuple = ()
) -> list[tuple[tuple, int]]:
    """The units a plan may run an option at, with the path of their frame: plain units of
    the top frame, and of a region's frame past its first unit and before its last
    packer."""
    covered = {u for a, b, _ in plan for u in range(a, b)}
    units = range(0, stop) if start < 0 else range(start + 1, chain.lp[stop])
    found = [(path, u) for u in units if u not in covered]
    for k, (a, b, inner) in enumerate(plan):
        found += _free_units(chain, inner, a, b, (*path, k))
    return found


def _with_picks(plan: Plan, path: tuple, picks: dict) -> Plan:
    """``plan`` with the option pieces of ``picks`` (per frame path) added."""
    inner = tuple((a, b, _with_picks(sub, (*path, k), picks)) for k, (a, b, sub) in enumerate(plan))
    return inner + tuple(piece for (where, _u), piece in picks.items() if where == path)


# Random DAGs of 9 ops with block options, all counted exactly; on seed 4 (50 k plans, a
# minute) the optimum at 0.85 of keep-all runs an option inside a region. The tests of
# options cut the DAGs at separators with nothing broadcast (test_separator_chain.py
# covers broadcast storages; test_the_dp_counts_plans_with_options... both).
SEEDS = [21, 79, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("seed", SEEDS)
def test_dp_optimum_equals_brute_force_over_plans_and_block_options(seed: int) -> None:
    graph = random_dag(9, seed=seed, skip_prob=0.5, max_inputs=2)
    chain = with_options(graph, separator_chain(graph, broadcast=False), deadline=NO_DEADLINE)
    # Options whose regions hold inputs make the count conservative (unit_options.py).
    assert not chain.exact and sum(map(len, chain.options)) >= 3
    profiles = []
    for plan in _all_plans(0, chain.n, False):
        try:
            predict(graph, plan_schedule(graph, chain, plan), broadcast=False)
        except SolverError:  # a region holding no packer: never better, outside the space
            continue
        free = _free_units(chain, plan, -1, chain.n)
        ways = [[None, *range(len(chain.options[u]))] for _, u in free]
        for choice in itertools.product(*ways):
            picks = {(path, u): (u, k) for (path, u), k in zip(free, choice) if k is not None}
            schedule = plan_schedule(graph, chain, _with_picks(plan, (), picks))
            profiles.append(simulate(graph, schedule))
    keep_all = simulate(graph, Schedule()).peak_bytes
    lowest = min(p.peak_bytes for p in profiles)
    used, optimal = False, 0
    fractions = {(keep_all + lowest) // 2, (keep_all + 3 * lowest) // 4, int(0.85 * keep_all)}
    for budget in sorted({b for b in fractions if lowest <= b < keep_all} | {lowest}):
        result = get_solver("dp_nested", broadcast=False)(graph, budget)
        assert_valid_result(graph, result, budget)
        proof = result.stats["space_proof"]
        assert proof["over"] == SEPARATOR_SPACE + OPTIONS_SPACE
        best = min(p.recompute_s for p in profiles if p.peak_bytes <= budget)
        assert result.status == SolveStatus.FEASIBLE, budget
        assert result.objective >= best * (1 - 1e-12)
        assert proof["bound_s"] is not None and proof["bound_s"] <= best * (1 + 1e-12)
        if proof["optimal"]:
            assert result.objective == pytest.approx(best, rel=1e-12, abs=1e-15)
        optimal += result.objective <= best * (1 + 1e-12)
        without = get_solver("dp_nested", block_options=False, broadcast=False)(graph, budget)
        used |= not without.feasible or without.objective > result.objective * (1 + 1e-9)
    below = get_solver("dp_nested", broadcast=False)(graph, lowest - 1)
    if below.status == SolveStatus.INFEASIBLE:
        lower = below.stats["space_proof"]["min_peak_lower_bytes"]
        assert lower is None or lower <= lowest <= below.peak_bytes
    assert used, "the options never mattered on this graph"
    assert optimal, "the DP found the optimum at no budget"


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
            separator_chain(graph, broadcast=False)
        except SolverError:
            continue
        keep_all = simulate(graph, Schedule()).peak_bytes
        for fraction in (0.85, 0.7):
            budget = int(fraction * keep_all)
            plain = get_solver("dp_nested", block_options=False, broadcast=False)(graph, budget)
            with_opts = get_solver("dp_nested", broadcast=False)(
                graph, budget
            )  # judged by the simulator
            assert_valid_result(graph, with_opts, budget)
            if plain.feasible:
                assert with_opts.feasible
                assert with_opts.objective <= plain.objective * (1 + 1e-12), (k, fraction)
                better += with_opts.objective < plain.objective * (1 - 1e-9)
                compared += 1
            else:
                assert with_opts.peak_bytes <= plain.peak_bytes, (k, fraction)
    assert compared >= 24 and better >= 3, (compared, better)


def test_a_block_inside_a_region_runs_an_option() -> None:
    """On this DAG the cheapest plan at 0.85 of keep-all nests a block's own regions inside
    a region over blocks (the solver checks its count against the simulator), where no
    plan without options fits."""
    graph = random_dag(9, seed=4, skip_prob=0.5, max_inputs=2)
    budget = int(0.85 * simulate(graph, Schedule()).peak_bytes)
    result = get_solver("dp_nested", broadcast=False)(graph, budget)
    assert_valid_result(graph, result, budget)
    assert result.stats["model"] == "conservative" and result.feasible
    order = {v: i for i, v in enumerate(ordered_nodes(graph))}
    bounds = {0, *separators(graph, broadcast=False), len(order)}
    inner = [r for r in result.schedule.nested if order[r[0]] not in bounds]
    assert inner, result.schedule
    plain = get_solver("dp_nested", block_options=False, broadcast=False)(graph, budget)
    assert not plain.feasible


def test_the_dp_counts_plans_with_options_as_the_simulator_does() -> None:
    """Random region trees with random options at every place the DP runs them (top level
    and inside regions): the DP's count never lies below the simulator's nor above it by
    more than the chain's slack (most are equal), and the recompute time is exact."""
    rng = random.Random(5)
    checked = exact = inside = 0
    for k in range(80):
        graph = random_dag(
            rng.randint(8, 16), seed=300 + k, skip_prob=rng.choice([0.3, 0.5]), max_inputs=2
        )
        try:
            chain = with_options(graph, separator_chain(graph), deadline=NO_DEADLINE)
        except SolverError:  # no separator
            continue
        if not any(chain.options):
            continue
        for _ in range(6):
            plan = _random_plan(rng, 0, chain.n, 3)
            if chain.n >= 3 and rng.random() < 0.5:  # one region with room inside
                lo = rng.randrange(0, chain.n - 2)
                hi = rng.randrange(lo + 3, chain.n + 1)
                plan = ((lo, hi, _random_plan(rng, lo, hi, 2)),)
            picks = {
                (path, u): (u, rng.randrange(len(chain.options[u])))
                for path, u in _free_units(chain, plan, -1, chain.n)
                if chain.options[u] and rng.random() < 0.6
            }
            with_picks = _with_picks(plan, (), picks)
            try:
                peak, cost = evaluate_plan(chain, with_picks)
            except SolverError as err:  # a region that saves nothing: outside the space
                assert "saves anything" in str(err)
                continue
            profile = simulate(graph, plan_schedule(graph, chain, with_picks))
            assert cost == pytest.approx(profile.recompute_s, rel=1e-12, abs=1e-15)
            assert profile.peak_bytes <= peak <= profile.peak_bytes + chain.slack_bytes, k
            if chain.exact:
                assert peak == profile.peak_bytes, (k, with_picks)
            exact += peak == profile.peak_bytes
            checked += 1
            inside += any(path for path, _ in picks)
    assert checked > 150 and exact > checked // 2 and inside > 30, (checked, exact, inside)
