"""dp_nested: its memory model against the simulator, its optimum against brute force over
schedules that cache nothing (on chains whose ops keep buffers of their own and are followed
by views of their outputs too), against dp_chain's keep-set optimum and the nested heuristic
on the deep chain, on the zoo's VGG, and its time limit."""

from __future__ import annotations

import random
import time

import pytest

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, new_graph, node_attrs, ordered_nodes
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.nested.dp_nested import predict
from tests.conftest import assert_valid_result, deep_chain_at_three_quarters
from tests.general_schedules import random_general_schedule
from tests.reference.general_enumerate import general_schedules


def random_chain(n: int, rng: random.Random) -> CostGraph:
    """A heterogeneous simple chain: each op saves its input, its output, both or nothing
    (or only a resident tensor), with random workspaces, parameter gradients, gradient
    sizes and forbidden cuts."""
    sizes = [rng.randint(1, 9) * 100 for _ in range(n)]
    times = [rng.uniform(1e-4, 1e-3) for _ in range(n)]
    graph = chain_graph(n, activation_bytes=sizes, fwd_time_s=times)
    order = ordered_nodes(graph)
    for i, v in enumerate(order):
        attrs = graph.nodes[v]
        kind = rng.choice(["input", "output", "none", "both", "input", "output"])
        saved: dict[str, int] = {}
        if kind in ("input", "both") and i:
            saved.update(graph.nodes[order[i - 1]]["outputs"])
        if kind in ("output", "both"):
            saved.update(attrs["outputs"])
        attrs["saved"] = saved
        attrs["n_saved"] = len(saved) or (1 if rng.random() < 0.2 else 0)
        for key, scale in (
            ("param_grad_bytes", 10),
            ("fwd_workspace_bytes", 10),
            ("bwd_workspace_bytes", 10),
            ("grad_bytes", 100),
        ):
            if rng.random() < 0.2:
                attrs[key] = rng.randint(1, 5) * scale
        if i < n - 1 and rng.random() < 0.2:
            attrs["cut_after_ok"] = False
    return graph


def random_unit_chain(n: int, rng: random.Random) -> CostGraph:
    """``random_chain`` where some ops also keep a buffer of their own (as max-pooling keeps
    its indices) and some outputs are followed by a view (as ``flatten``), no region boundary
    between an op and its view (dp_nested's space, so brute force searches the same one)."""
    base = random_chain(n, rng)
    graph = new_graph(f"units{n}")
    previous = ""
    for i, v in enumerate(ordered_nodes(base)):
        attrs = dict(base.nodes[v])
        if rng.random() < 0.4:
            saved = {**attrs["saved"], f"{v}:buf0": rng.randint(1, 5) * 50}
            attrs.update(saved=saved, saved_bytes=sum(saved.values()))
            attrs["n_saved"] = max(attrs["n_saved"], len(saved))
        view = i < n - 1 and rng.random() < 0.3
        attrs["index"] = graph.number_of_nodes()
        if view:
            attrs["cut_after_ok"] = False
        graph.add_node(v, **attrs)
        if previous:
            graph.add_edge(previous, v)
        previous = v
        if view:
            name = f"{v}_view"
            graph.add_node(
                name,
                **node_attrs(
                    index=graph.number_of_nodes(),
                    op="synthetic.view",
                    aliases=list(attrs["outputs"]),
                    grad_bytes=attrs["grad_bytes"],
                    bwd_grad_alias=True,
                    fwd_time_s=rng.uniform(1e-6, 1e-5),
                    cut_after_ok=base.nodes[v]["cut_after_ok"],
                ),
            )
            graph.add_edge(previous, name)
            previous = name
    graph.graph["outputs"] = [previous]
    return graph


def test_the_dp_counts_every_schedule_of_its_space_as_the_simulator_does() -> None:
    rng = random.Random(0)
    checked = multi_level = 0
    for k in range(400):
        make = random_unit_chain if k % 4 == 3 else random_chain
        graph = make(rng.randint(2, 14), rng)
        schedule = random_general_schedule(graph, rng, depth=4, cache_share=0.0)
        try:
            peak, cost = predict(graph, schedule)
        except SolverError as err:  # a region that saves nothing: outside the space
            assert "saves anything" in str(err)
            continue
        profile = simulate(graph, schedule)
        assert peak == profile.peak_bytes, (schedule, peak, profile.peak_bytes)
        assert cost == pytest.approx(profile.recompute_s, rel=1e-12, abs=1e-15)
        checked += 1
        multi_level += bool(schedule.nested)
    assert checked > 200 and multi_level > 70, (checked, multi_level)


def _brute_force_cases() -> list[tuple[str, CostGraph]]:
    rng = random.Random(7)
    cases = [(f"random{k}", random_chain(rng.randint(2, 5), rng)) for k in range(16)]
    cases += [(f"units{k}", random_unit_chain(rng.randint(3, 6), rng)) for k in range(8)]
    cases.append(("chain4", chain_graph(4, activation_bytes=1000)))
    cases.append(
        (
            "chain5_output",
            chain_graph(5, activation_bytes=[300, 100, 700, 200, 500], saves="output"),
        )
    )
    model, (x,), _ = zoo.relu_chain(width=8, depth=1, batch=4)
    cases.append(("relu_chain1", chkpt_opt.trace(model, (x,))))
    # max-pooling (indices kept), flatten (a view) and a loss keeping its statistics
    model, args, _ = zoo.vgg(widths=(4,), convs_per_stage=1, image=8, batch=2)
    cases.append(("vgg_tiny", chkpt_opt.trace(model, args)))
    return cases


@pytest.mark.parametrize(
    "name,graph",
    [
        # units7 (6 ops, 18 s: the largest brute force of the list) runs with -m slow
        pytest.param(name, graph, id=name, marks=[pytest.mark.slow] if name == "units7" else [])
        for name, graph in _brute_force_cases()
    ],
)
def test_dp_optimum_equals_the_brute_force_optimum_without_caching(
    name: str, graph: CostGraph
) -> None:
    profiles = [simulate(graph, s, check=False) for s in general_schedules(graph, cache=False)]
    keep_all = simulate(graph, Schedule()).peak_bytes
    lowest = min(p.peak_bytes for p in profiles)
    budgets = sorted({keep_all, (keep_all + lowest) // 2, int(0.8 * keep_all), lowest, lowest - 1})
    for budget in budgets:
        result = get_solver("dp_nested")(graph, budget)
        assert_valid_result(graph, result, budget)
        fitting = [p.recompute_s for p in profiles if p.peak_bytes <= budget]
        if fitting:
            assert result.status == SolveStatus.OPTIMAL, (name, budget)
            assert result.objective == pytest.approx(min(fitting), rel=1e-12, abs=1e-15)
        else:
            assert result.status == SolveStatus.INFEASIBLE and result.proves_infeasible
            assert result.peak_bytes == lowest == result.stats["min_feasible_bytes"]


def test_never_costlier_than_the_keep_set_optimum() -> None:
    rng = random.Random(3)
    compared = 0
    for k in range(6):
        graph = random_chain(rng.randint(10, 18), rng)
        keep_all = simulate(graph, Schedule()).peak_bytes
        for fraction in (0.9, 0.7, 0.5, 0.35):
            budget = int(keep_all * fraction)
            keep = get_solver("dp_chain")(graph, budget)
            nested = get_solver("dp_nested")(graph, budget, time_limit_s=30)
            assert_valid_result(graph, nested, budget)
            if keep.feasible:
                assert nested.status == SolveStatus.OPTIMAL, (k, fraction)
                assert nested.objective <= keep.objective * (1 + 1e-12) + 1e-15
                compared += 1
            else:
                assert nested.peak_bytes <= keep.peak_bytes
    assert compared >= 10


@pytest.mark.slow  # 24 s; test_general_solvers plans and measures the deep chain in CI
def test_deep_chain_below_three_quarters_of_the_keep_set_floor_cheaper_than_nested() -> None:
    _, _, graph, resident, step_budget = deep_chain_at_three_quarters()
    budget = step_budget - resident
    heuristic = get_solver("nested")(graph, budget, time_limit_s=20)
    start = time.perf_counter()
    # The full solve takes about 80 s on 2 cores; within 20 s the coarse stages answer.
    result = get_solver("dp_nested")(graph, budget, time_limit_s=20)
    assert time.perf_counter() - start < 20 + 5
    assert_valid_result(graph, result, budget)
    assert result.feasible and result.schedule.nested
    assert heuristic.feasible and result.objective <= heuristic.objective
    if result.status == SolveStatus.OPTIMAL:  # no costlier than any keep-set schedule
        assert result.bound == result.objective and result.stats["cuts_used"] == 67
    else:  # the full solve was cut short: no claim
        assert result.stats["timed_out"] and result.bound is None
        assert "of the 67 allowed cuts" in result.stats["optimal_over"]


def test_time_limit_is_kept_with_an_honest_status() -> None:
    graph = chain_graph(120, activation_bytes=[(k % 5 + 1) << 10 for k in range(120)])
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.2)
    start = time.perf_counter()
    result = get_solver("dp_nested")(graph, budget, time_limit_s=0.5)
    assert time.perf_counter() - start < 0.5 + 5
    assert_valid_result(graph, result, budget)
    if result.stats.get("timed_out"):
        assert result.status in (SolveStatus.FEASIBLE, SolveStatus.TIMED_OUT)
        assert result.bound is None and not result.proves_infeasible


def test_graphs_that_are_no_chain_are_refused_with_the_reason() -> None:
    graph = random_dag(6, seed=0, skip_prob=0.9, max_inputs=3)
    graph.graph["outputs"] = [*graph.graph["outputs"], ordered_nodes(graph)[2]]
    with pytest.raises(SolverError, match=r"not a simple chain.*no chain of blocks"):
        get_solver("dp_nested")(graph, 10**9)


def test_auto_general_beats_the_nested_optimum_below_the_keep_set_floor() -> None:
    graph = chain_graph(16, activation_bytes=[(k % 3 + 1) << 10 for k in range(16)])
    keep_min = get_solver("dp_chain")(graph, 0).peak_bytes
    budget = int(0.8 * keep_min)
    exact = get_solver("dp_nested")(graph, budget, time_limit_s=20)
    assert exact.status == SolveStatus.OPTIMAL and exact.schedule.nested
    result = get_solver("auto", general=True)(graph, budget, time_limit_s=30)
    assert_valid_result(graph, result, budget)
    # The staged program recomputes op by op, stage by stage: 0.018 s where the best
    # nested schedule needs 0.020; its bound holds over every schedule, and meets it.
    assert result.objective < exact.objective * (1 - 1e-3)
    assert result.status == SolveStatus.OPTIMAL and result.schedule.staged
    assert result.bound is not None and result.bound >= result.stats["recompute_bound"]["bound_s"]


def test_a_region_boundary_between_an_op_and_its_view_is_outside_the_space() -> None:
    model, args, _ = zoo.vgg(widths=(4,), convs_per_stage=1, image=8, batch=2)
    graph = chkpt_opt.trace(model, args)
    order = ordered_nodes(graph)
    pool = next(k for k, v in enumerate(order) if graph.nodes[v]["op"].startswith("aten.max_pool"))
    assert graph.nodes[order[pool + 1]]["is_view"]
    inside = Schedule(regions=(tuple(order[: pool + 1]),))  # ends between the pool and its view
    with pytest.raises(SolverError, match="inside a unit of the chain"):
        predict(graph, inside)
    whole = Schedule(regions=(tuple(order[: pool + 2]),))
    peak, cost = predict(graph, whole)
    profile = simulate(graph, whole)
    assert peak == profile.peak_bytes
    assert cost == pytest.approx(profile.recompute_s, rel=1e-12, abs=1e-15)


def test_coarse_phases_never_change_a_full_solve() -> None:
    graph = chain_graph(
        14,
        activation_bytes=[(k * 7 % 5 + 1) << 10 for k in range(14)],
        fwd_time_s=[(k % 3 + 1) * 1e-3 for k in range(14)],
    )
    keep_all = simulate(graph, Schedule()).peak_bytes
    for fraction in (0.8, 0.6, 0.0):
        results = [
            get_solver("dp_nested", coarse_cuts=(4, 8), coarse_phases=phases)(
                graph, int(fraction * keep_all), time_limit_s=60
            )
            for phases in (False, True)
        ]
        assert results[0].stats["cuts_used"] == results[1].stats["cuts_used"] == 15
        assert results[0].status == results[1].status
        assert results[0].peak_bytes == results[1].peak_bytes
        assert results[0].objective == pytest.approx(results[1].objective, rel=1e-12)
