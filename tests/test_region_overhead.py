"""The per-region overhead: measured once per plan with profile_times, counted for every
region by the simulator and by every solver's model alike."""

from __future__ import annotations

import pytest
import torch

import chkpt_opt
from chkpt_opt.errors import GraphFormatError
from chkpt_opt.graphs.costgraph import check_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.schedule import Schedule
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers import get_solver
from tests.conftest import assert_valid_result

OVERHEAD_S = 2e-4


def _with_overhead(graph, overhead_s: float = OVERHEAD_S):
    graph = graph.copy()
    graph.graph["region_overhead_s"] = overhead_s
    check_graph(graph)
    return graph


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


def test_bad_overheads_are_refused() -> None:
    for bad in (-1e-3, 2.0, "0.1", True, float("nan")):
        graph = chain_graph(4)
        graph.graph["region_overhead_s"] = bad
        with pytest.raises(GraphFormatError, match="region_overhead_s"):
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


def test_profiled_plans_measure_the_overhead() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    made = chkpt_opt.plan(
        model, (torch.randn(8, 16),), budget=10**12, optimizer=None, profile_times=True
    )
    overhead = made.graph.graph["region_overhead_s"]
    assert 0.0 < overhead < 0.05  # a checkpoint call costs microseconds to milliseconds
    assert "region_overhead_s" not in chkpt_opt.trace(model, (torch.randn(8, 16),)).graph
