"""Checkmate's program (general rematerialization): its optimum never above the cost of any
schedule that fits (brute force over the general space of tiny graphs), equal to it where
the spaces coincide, its infeasibility and its time limit kept."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.bounds.general_milp import general_bound
from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound
from tests.general_schedules import random_general_schedule
from tests.reference.general_enumerate import general_schedules

CORPUS = Path(__file__).resolve().parents[3] / "graphs"


def _optima(graph: CostGraph) -> dict[int, float]:
    """The general brute-force optimum (recompute seconds) at each peak some schedule has."""
    profiles = [simulate(graph, s, check=False) for s in general_schedules(graph)]
    peaks = sorted({p.peak_bytes for p in profiles})
    return {b: min(p.recompute_s for p in profiles if p.peak_bytes <= b) for b in peaks}


@pytest.mark.parametrize("seed", range(6))
def test_the_optimum_is_below_the_general_brute_force_optimum(seed: int) -> None:
    graph = random_dag(4, seed=seed)
    for budget, best_s in list(_optima(graph).items())[:4]:
        found = general_bound(graph, budget, time_limit_s=20)
        assert found.status == "optimal"
        assert found.bound_s is not None and found.bound_s <= best_s + 1e-12
        assert found.objective_s is not None and found.objective_s <= best_s + 1e-9


@pytest.mark.parametrize("name", ["segnet_layers", "resnet_small"])
def test_the_bound_is_below_random_nested_and_caching_schedules_at_their_own_peak(
    name: str,
) -> None:
    # resnet_small is traced: views, in-place ReLUs and batch norm
    graph = load_graph(CORPUS / f"{name}.json")
    rng = random.Random(7)
    for k in range(3):
        schedule = random_general_schedule(graph, rng, cache_share=0.0 if k == 0 else 0.3)
        profile = simulate(graph, schedule)
        found = general_bound(graph, profile.peak_bytes, time_limit_s=30)
        assert found.bound_s is not None and found.bound_s <= profile.recompute_s + 1e-12, k


def test_on_a_chain_it_equals_the_brute_force_optimum_with_the_same_peak() -> None:
    # the Checkmate schedules the program finds on this chain are ours (recompute n0, or n0
    # and n1, for a backward step): the same cost and, run as Checkmate runs them, the peak
    # of our cheapest schedule of that cost
    graph = chain_graph(
        4, activation_bytes=[300, 200, 400, 100], fwd_time_s=[1e-3, 3e-3, 2e-3, 1e-3]
    )
    profiles = [simulate(graph, s, check=False) for s in general_schedules(graph)]
    costs = []
    for budget in sorted({p.peak_bytes for p in profiles}):
        best_s, best_peak = min(
            (p.recompute_s, p.peak_bytes) for p in profiles if p.peak_bytes <= budget
        )
        found = general_bound(graph, budget, time_limit_s=20)
        assert found.objective_s == pytest.approx(best_s, abs=1e-12)
        assert found.checkmate_peak_bytes == best_peak
        costs.append(found.objective_s)
    assert costs[0] > costs[1] > costs[-1] == 0.0  # the budgets are not all trivial


def test_a_budget_below_what_every_step_holds_is_infeasible() -> None:
    graph = load_graph(CORPUS / "vgg16_layers.json")
    floor = recompute_bound(graph, 0).floor_bytes
    found = general_bound(graph, floor // 2, time_limit_s=20)
    assert found.status == "infeasible" and found.objective_s is None
    keep_all = simulate(graph, Schedule()).peak_bytes
    assert general_bound(graph, keep_all, time_limit_s=20).objective_s == 0.0


@pytest.mark.parametrize(("name", "limit_s"), [("unet_layers", 2.0), ("gpt_small", 2.0)])
def test_the_time_limit_is_kept_and_recorded(name: str, limit_s: float) -> None:
    # gpt_small (106 ops, 30,000 binaries) takes longer than the limit to build alone
    graph = load_graph(CORPUS / f"{name}.json")
    budget = int(0.5 * simulate(graph, Schedule()).peak_bytes)
    start = time.monotonic()
    found = general_bound(graph, budget, time_limit_s=limit_s)
    assert time.monotonic() - start < limit_s + 2.0
    assert found.time_limit_s == limit_s and found.solve_s < limit_s + 2.0
    assert found.status in ("optimal", "feasible", "timed_out")


def test_bad_settings_name_the_value_and_the_fix() -> None:
    graph = chain_graph(3)
    with pytest.raises(SolverError, match="backend 'gurobi' is unknown; use one of scip, highs"):
        general_bound(graph, 10**6, backend="gurobi")
    with pytest.raises(SolverError, match="time_limit_s = 0 must be > 0"):
        general_bound(graph, 10**6, time_limit_s=0)


def _mini_segnet() -> CostGraph:
    """conv -> max-pool (indices) -> unpool by those indices -> conv -> loss, at 32²."""
    from chkpt_opt.zoo.layer_level import _start  # the layer builder, for a net this small

    net = _start("mini_segnet", 1, 32)
    pooled = net.pool("pool1", net.conv("conv1", "input", 8))
    x = net.conv("conv3", net.unpool("unpool1", pooled, pooled), 4, relu=False)
    return net.loss(x, label_bytes=32 * 32 * 8)


@pytest.mark.slow
def test_a_checkmate_schedule_outside_our_space_is_cheaper_and_fits() -> None:
    # Checkmate frees conv1's output after the forward and recomputes conv1 alone for
    # pool1's backward, pool1's indices kept for unpool1's: a saved tensor rebuilt on
    # unpack. Nested regions and cached ops cannot: a region around conv1 leaves its output
    # saved by pool1 outside it, and one around conv1 and pool1 recomputes pool1 too.
    graph = _mini_segnet()
    budget = 99_480
    ours = _optima(graph)
    best_ours = min(s for b, s in ours.items() if b <= budget)
    found = general_bound(graph, budget, time_limit_s=20)
    assert {op for _, ops in found.recomputed for op in ops} == {"conv1"}
    assert found.checkmate_peak_bytes is not None and found.checkmate_peak_bytes <= budget
    assert found.objective_s is not None and found.objective_s < best_ours * 0.99
    # recompute on unpack runs it: conv1 unpacked has Checkmate's cost at a peak that fits
    unpacked = simulate(graph, Schedule(unpacked=frozenset({"conv1"})))
    assert unpacked.peak_bytes <= budget
    assert unpacked.recompute_s == pytest.approx(found.objective_s, rel=1e-6)
