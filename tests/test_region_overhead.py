"""What regions cost beyond their ops (the per-region overhead, and the selective-checkpoint
policy of a region that caches ops): measured once per plan with profile_times, counted by
the simulator and by every solver's model alike."""

from __future__ import annotations

import pytest

from chkpt_opt.errors import GraphFormatError
from chkpt_opt.graphs.costgraph import check_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.region_replay import policy_dispatches
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.interval.cache_columns import CacheColumns
from tests.conftest import REL, assert_valid_result
from tests.reference.general_enumerate import general_optimum, general_schedules

OVERHEAD_S = 2e-4


POLICY_REGION_S = 1e-4
POLICY_OP_S = 1e-5


def _with_overhead(graph, overhead_s: float = OVERHEAD_S, **policy_s: float):
    graph = graph.copy()
    graph.graph["region_overhead_s"] = overhead_s
    graph.graph.update(policy_s)
    check_graph(graph)
    return graph


def _with_policy(graph, region_s: float = POLICY_REGION_S, op_s: float = POLICY_OP_S):
    return _with_overhead(graph, 0.0, cached_region_overhead_s=region_s, cached_op_overhead_s=op_s)


def test_the_simulator_charges_every_region_once() -> None:
    plain = chain_graph(8, activation_bytes=1000)
    charged = _with_overhead(plain)
    schedule = Schedule.from_spans(plain, [(1, 3), (4, 6)])
    nested = Schedule(regions=schedule.regions, nested=(schedule.regions[0][1:],))
    for s, regions in ((Schedule(), 0), (schedule, 2)):
        assert simulate(charged, s).recompute_s == pytest.approx(
            simulate(plain, s).recompute_s + regions * OVERHEAD_S
        )
    assert simulate(charged, nested).recompute_s == pytest.approx(
        simulate(plain, nested).recompute_s + 3 * OVERHEAD_S
    )
    assert simulate(charged, schedule).peak_bytes == simulate(plain, schedule).peak_bytes


@pytest.mark.parametrize(
    "name", ["enumerate", "cpsat", "milp", "dp_chain", "pruned", "dp_nested", "auto"]
)
def test_every_model_counts_the_overhead_as_the_simulator_does(name: str) -> None:
    graph = _with_overhead(chain_graph(10, activation_bytes=1000))
    keep = simulate(graph, Schedule()).peak_bytes
    for fraction in (0.8, 0.6, 0.45):
        budget = int(fraction * keep)
        result = get_solver(name)(graph, budget, time_limit_s=20)
        assert_valid_result(graph, result, budget)


def test_a_large_overhead_makes_the_optimum_use_fewer_regions() -> None:
    graph = random_dag(18, seed=4, skip_prob=0.2, max_inputs=2)
    budget = int(0.6 * simulate(graph, Schedule()).peak_bytes)
    free = get_solver("cpsat")(graph, budget, time_limit_s=20)
    assert free.proven and free.feasible and len(free.schedule.regions) > 1
    total = sum(a["fwd_time_s"] for _, a in graph.nodes(data=True))
    charged = get_solver("cpsat")(_with_overhead(graph, total), budget, time_limit_s=20)
    assert charged.proven and len(charged.schedule.regions) < len(free.schedule.regions)


def test_the_simulator_charges_a_caching_region_its_policy_per_op_dispatched() -> None:
    plain = chain_graph(8, activation_bytes=1000)
    charged = _with_policy(plain)
    keep_set = Schedule.from_spans(plain, [(1, 5), (6, 8)])
    cached = Schedule(keep_set.regions, saved=frozenset({keep_set.regions[0][1]}))
    # The policy sees the region's 4 forward ops and its replay: the ops recomputed, and
    # the cached op, which the replay reaches and takes from the cache.
    replayed = [s.node for s in lower(plain, cached) if s.kind == "recompute"]
    replayed = [n for n in replayed if n in keep_set.regions[0]]
    assert policy_dispatches(charged, cached) == [4 + len(replayed) + 1]
    assert policy_dispatches(charged, keep_set) == []
    assert simulate(charged, cached).recompute_s == pytest.approx(
        simulate(plain, cached).recompute_s + POLICY_REGION_S + POLICY_OP_S * (5 + len(replayed))
    )
    assert simulate(charged, keep_set).recompute_s == simulate(plain, keep_set).recompute_s
    assert simulate(charged, cached).peak_bytes == simulate(plain, cached).peak_bytes


def test_the_cached_program_counts_the_policy_and_stays_exact_over_its_space() -> None:
    """On a graph where caching pays without a policy cost (dag5_s12 in
    tests/test_milp_cached.py), milp_cached's optimum with the cost charged equals brute
    force over its space; a policy costlier than what caching saves makes it cache nothing."""
    graph = _with_policy(random_dag(5, seed=12, skip_prob=0.5, max_inputs=3))
    columns = CacheColumns(graph, "subsets")
    space = [s for s in general_schedules(graph, nesting=False) if columns.covers(s)]
    peaks = sorted({simulate(graph, s, check=False).peak_bytes for s in space})
    solver = get_solver("milp_cached", cache="subsets")
    for budget in peaks[:: max(1, len(peaks) // 4)]:
        best = general_optimum(graph, budget, nesting=False, within=columns.covers)
        result = solver(graph, budget, time_limit_s=30)
        assert_valid_result(graph, result, budget)
        assert best is not None and result.status == SolveStatus.OPTIMAL
        assert result.objective == pytest.approx(best[1].recompute_s, rel=REL, abs=1e-15)
    budget = 6_501_120  # keep-set optimum 7.37 ms, caching 4.05 ms without a policy cost
    assert get_solver("milp_cached")(graph, budget, time_limit_s=30).schedule.saved
    costly = _with_policy(graph, region_s=4e-3)
    result = get_solver("milp_cached")(costly, budget, time_limit_s=30)
    assert_valid_result(costly, result, budget)
    assert result.status == SolveStatus.OPTIMAL and not result.schedule.saved


def test_bad_overheads_are_refused() -> None:
    keys = ("region_overhead_s", "cached_region_overhead_s", "cached_op_overhead_s")
    for key in keys:
        for bad in (-1e-3, 2.0, "0.1", True, float("nan")):
            graph = chain_graph(4)
            graph.graph[key] = bad
            with pytest.raises(GraphFormatError, match=key):
                check_graph(graph)


def test_dp_nested_charges_every_region_and_nests_less_for_it() -> None:
    """On a chain whose lowest peak needs nesting, dp_nested's nested plan pays the
    overhead per region (its prediction is checked against the simulator's inside the
    solver); a large overhead makes its optimum use fewer regions, and equals a brute
    force over the plans it found."""
    graph = chain_graph(12, activation_bytes=1000)
    lowest = get_solver("dp_nested")(graph, 0, time_limit_s=20)
    budget = lowest.peak_bytes + 1500
    free = get_solver("dp_nested")(graph, budget, time_limit_s=20)
    assert free.proven and free.schedule.nested
    total = sum(a["fwd_time_s"] for _, a in graph.nodes(data=True))
    charged_graph = _with_overhead(graph, total / 4)
    charged = get_solver("dp_nested")(charged_graph, budget, time_limit_s=20)
    assert_valid_result(charged_graph, charged, budget)
    assert charged.proven
    count = len(charged.schedule.regions) + len(charged.schedule.nested)
    assert count < len(free.schedule.regions) + len(free.schedule.nested)
    # The overhead-free optimum, charged, is no cheaper than the charged optimum.
    assert charged.objective <= simulate(charged_graph, free.schedule).recompute_s + 1e-12
