"""Property-based tests of every registered solver on random graphs and budgets.

For random DAGs (sizes, seeds, skip connections, fan-in, forbidden cuts, frozen prefixes,
byte and time scales) and random budgets, every solver returns a valid schedule, reports
the peak and extra compute the simulator gives it, never calls a schedule that does not
fit ``optimal`` or ``feasible`` (nor one that fits ``infeasible``), and never claims an
optimum or a lower bound that another solver beats. The only exceptions allowed are the
documented ones (SolverError for a graph a solver does not handle, InfeasibleBudgetError).
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chkpt_opt.errors import InfeasibleBudgetError, SolverError
from chkpt_opt.graphs.costgraph import CostGraph, check_graph, new_graph, node_attrs, ordered_nodes
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveResult, SolveStatus, available_solvers, get_solver
from tests.conftest import assert_valid_result

SOLVERS = sorted(available_solvers())
DOCUMENTED = (SolverError, InfeasibleBudgetError)
TIME_LIMIT_S = 2.0
# Solvers that search exhaustively or run a MIP: small graphs only.
SMALL_ONLY = {"enumerate"}
EPS = 1e-9


# ---- graphs and budgets -------------------------------------------------------------------


def _finish(graph: CostGraph, forbid: set[int], frozen: int) -> CostGraph:
    """Forbids region boundaries after the ops in ``forbid`` and freezes the first
    ``frozen`` ops (no gradient, no backward), as traced graphs have them."""
    for name in ordered_nodes(graph):
        attrs = graph.nodes[name]
        if attrs["index"] in forbid:
            attrs["cut_after_ok"] = False
        if attrs["index"] < frozen and not any(
            graph.nodes[p]["requires_grad"] for p in graph.predecessors(name)
        ):
            attrs.update(requires_grad=False, has_backward=False, grad_bytes=0, bwd_time_s=0.0)
            attrs.update(bwd_flops=0, saved={}, saved_bytes=0, n_saved=0)
    check_graph(graph)
    return graph


@st.composite
def dags(draw: st.DrawFn, max_ops: int) -> CostGraph:
    n = draw(st.integers(min_value=1, max_value=max_ops))
    scale = draw(st.sampled_from([1 << 10, 1 << 20, 1 << 40]))
    graph = random_dag(
        n,
        seed=draw(st.integers(min_value=0, max_value=2**31)),
        max_inputs=draw(st.integers(min_value=1, max_value=4)),
        skip_prob=draw(st.floats(min_value=0.0, max_value=1.0)),
        min_bytes=scale,
        max_bytes=scale * draw(st.sampled_from([1, 4, 1024])),
    )
    forbid = draw(st.sets(st.integers(min_value=0, max_value=n - 1), max_size=n // 3))
    frozen = draw(st.integers(min_value=0, max_value=min(2, n - 1)))
    return _finish(graph, forbid, frozen)


def repeated_blocks(n_blocks: int, seed: int) -> CostGraph:
    """A prologue, ``n_blocks`` identical blocks (module paths ``layers.<k>``) with skip
    edges inside each and a residual from the block input, and an epilogue."""
    rng = random.Random(seed)
    length = rng.randint(2, 4)
    template = []
    for k in range(length):
        extra = rng.sample(range(-1, k - 1), k=min(1, k)) if k and rng.random() < 0.5 else []
        template.append(
            (extra, rng.choice([1, 2, 4]) << 16, rng.choice(["input", "output", "none"]))
        )
    graph = new_graph(f"blocks{n_blocks}_s{seed}")
    names: list[str] = []

    def add(inputs: list[str], nbytes: int, saves: str, path: str) -> str:
        name = f"n{len(names)}"
        saved: dict[str, int] = {}
        if saves == "input":
            for u in inputs:
                saved.update(graph.nodes[u]["outputs"])
        elif saves == "output":
            saved[name] = nbytes
        graph.add_node(
            name,
            **node_attrs(
                index=len(names),
                op=f"synthetic.{saves}",
                module_path=path,
                outputs={name: nbytes},
                saved=saved,
                grad_bytes=nbytes,
                fwd_flops=nbytes,
                bwd_flops=2 * nbytes,
                fwd_time_s=nbytes * 1e-9,
                bwd_time_s=2 * nbytes * 1e-9,
            ),
        )
        for u in dict.fromkeys(inputs):
            graph.add_edge(u, name)
        names.append(name)
        return name

    x = add([], 1 << 16, "none", "embed")
    for j in range(n_blocks):
        block = [x]
        for k, (extra, nbytes, saves) in enumerate(template):
            inputs = [block[-1]] + [block[e + 1] for e in extra]
            if k == length - 1:
                inputs.append(block[0])  # residual
            block.append(add(inputs, nbytes, saves, f"layers.{j}"))
        x = block[-1]
    add([x], 4, "input", "head")
    graph.graph["outputs"] = names[-1:]
    check_graph(graph)
    return graph


def lowest_peak(graph: CostGraph) -> int:
    """The lowest peak the solvers reach (``auto`` asked for a budget of 0)."""
    return get_solver("auto")(graph, 0, time_limit_s=TIME_LIMIT_S).peak_bytes


@st.composite
def budgets(draw: st.DrawFn, graph: CostGraph) -> int:
    """Budgets around the interesting points, most of them between the lowest peak the
    solvers reach and the keep-everything peak (where recomputation is needed and
    possible): also 0, exactly those two peaks, a byte below each, and far above."""
    keep = simulate(graph, Schedule()).peak_bytes
    kind = draw(
        st.sampled_from(
            ["between"] * 6 + ["lowest", "below lowest", "keep", "below keep", "zero", "above"]
        )
    )
    if kind == "zero":
        return 0
    if kind == "keep":
        return keep
    if kind == "below keep":
        return max(0, keep - 1)
    if kind == "above":
        return keep * draw(st.integers(min_value=1, max_value=10**6))
    low = lowest_peak(graph)
    if kind == "lowest":
        return low
    if kind == "below lowest":
        return max(0, low - 1)
    return low + int((keep - low) * draw(st.floats(min_value=0.0, max_value=1.0)))


# ---- the properties -----------------------------------------------------------------------


def run_solver(name: str, graph: CostGraph, budget: int) -> SolveResult | None:
    """Runs a solver; None when it refuses the graph with a documented error."""
    start = time.perf_counter()
    try:
        result = get_solver(name)(graph, budget, time_limit_s=TIME_LIMIT_S)
    except DOCUMENTED as err:
        assert str(err).strip(), name
        return None
    elapsed = time.perf_counter() - start
    assert elapsed <= 3 * TIME_LIMIT_S + 10, (name, elapsed)  # no runaway search
    check_result(name, graph, budget, result)
    return result


def check_result(name: str, graph: CostGraph, budget: int, result: SolveResult) -> None:
    """One solver's result is valid, within its budget when it says so, and honest."""
    assert_valid_result(graph, result, budget, rel=1e-6, abs_objective=1e-12, abs_bound=EPS)


def check_consistent(graph: CostGraph, budget: int, results: dict[str, SolveResult]) -> None:
    """No solver claims an optimum, or a lower bound, that another solver's feasible
    schedule beats (proofs hold over keep-set schedules: schedules beyond it, from the
    nested and cached searches, are not held against them and claim no proof, unless their
    solver names the space it is exact over, ``optimal_over``, which holds the keep-set
    schedules: then its proof is held against them too; the recompute bound, which a result
    beyond keep-set may carry, holds over every schedule and is held against all)."""
    anything = [r.objective for r in results.values() if r.feasible]
    for name, result in results.items():
        if not result.schedule.is_keep_set() and "optimal_over" not in result.stats:
            # Beyond keep-set the only bound is one over every schedule (the recompute
            # bound): held against every feasible result, keep-set or not.
            if result.bound is not None and anything:
                assert result.bound <= min(anything) * (1 + 1e-6) + EPS, name
            if result.status == SolveStatus.OPTIMAL:
                assert result.bound is not None and result.objective <= result.bound + EPS, name
    feasible = {
        n: r.objective for n, r in results.items() if r.feasible and r.schedule.is_keep_set()
    }
    if not feasible:
        return
    best_name, best = min(feasible.items(), key=lambda kv: kv[1])
    slack = best * 1e-6 + EPS
    for name, result in results.items():
        if result.status == SolveStatus.OPTIMAL:
            assert result.objective <= best + slack, (
                f"{name} claims optimal at {result.objective} but {best_name} found {best}",
                budget,
                graph.graph["name"],
            )
        if result.bound is not None:
            assert result.bound <= best + slack, (name, result.bound, best_name, best)


SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(data=st.data())
def test_every_solver_on_small_random_dags(data: st.DataObject) -> None:
    graph = data.draw(dags(max_ops=9), label="graph")
    budget = data.draw(budgets(graph), label="budget")
    results = {}
    for name in SOLVERS:
        result = run_solver(name, graph, budget)
        if result is not None:
            results[name] = result
    assert {"keep_all", "greedy", "sqrt"} <= set(results)
    check_consistent(graph, budget, results)


@pytest.mark.slow  # 40 s; every solver meets the validity checker on small DAGs in CI
@settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data())
def test_fast_and_time_limited_solvers_on_larger_random_dags(data: st.DataObject) -> None:
    graph = data.draw(dags(max_ops=60), label="graph")
    budget = data.draw(budgets(graph), label="budget")
    results = {}
    for name in SOLVERS:
        if name in SMALL_ONLY:
            continue
        result = run_solver(name, graph, budget)
        if result is not None:
            results[name] = result
    check_consistent(graph, budget, results)


@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    n_blocks=st.integers(min_value=2, max_value=5),
    seed=st.integers(min_value=0, max_value=10**6),
    fraction=st.floats(min_value=0.0, max_value=1.0),
)
def test_every_solver_on_repeated_blocks(n_blocks: int, seed: int, fraction: float) -> None:
    """Graphs made of identical blocks, which the block-structured solvers accept."""
    graph = repeated_blocks(n_blocks, seed)
    keep, low = simulate(graph, Schedule()).peak_bytes, lowest_peak(graph)
    budget = low + int((keep - low) * fraction)
    results = {}
    for name in SOLVERS:
        if name in SMALL_ONLY and graph.number_of_nodes() > 9:
            continue
        result = run_solver(name, graph, budget)
        if result is not None:
            results[name] = result
    check_consistent(graph, budget, results)


@settings(
    max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(graph=dags(max_ops=8), low=st.floats(0.0, 1.0), high=st.floats(0.0, 1.0))
def test_exact_solvers_cost_less_as_the_budget_grows(
    graph: CostGraph, low: float, high: float
) -> None:
    """An optimal schedule for a budget also fits any larger budget, so the optimal extra
    compute never increases with the budget."""
    low, high = sorted((low, high))
    keep, lowest = simulate(graph, Schedule()).peak_bytes, lowest_peak(graph)
    for name in SOLVERS:
        small = run_solver(name, graph, lowest + int((keep - lowest) * low))
        large = run_solver(name, graph, lowest + int((keep - lowest) * high))
        if small is None or large is None:
            continue
        if small.status == SolveStatus.OPTIMAL and large.status == SolveStatus.OPTIMAL:
            assert large.objective <= small.objective * (1 + 1e-6) + EPS, name
        if small.feasible:  # what fits a smaller budget fits the larger one
            assert large.feasible or large.status == SolveStatus.TIMED_OUT, name


@pytest.mark.parametrize("name", SOLVERS)
def test_degenerate_graphs(name: str) -> None:
    """One op, a chain that saves nothing, zero-byte outputs, every cut forbidden."""
    cases: list[tuple[CostGraph, int]] = []
    cases.append((chain_graph(1), 0))
    cases.append((chain_graph(5, saves="none"), 0))
    cases.append((chain_graph(4, activation_bytes=[0, 0, 0, 0]), 0))
    forbidden = chain_graph(6)
    for node in forbidden:
        forbidden.nodes[node]["cut_after_ok"] = False
    cases.append((forbidden, simulate(forbidden, Schedule()).peak_bytes // 2))
    times = chain_graph(5, fwd_time_s=[0.0, 1e-9, 1.0, 1e6, 0.0])
    cases.append((times, simulate(times, Schedule()).peak_bytes // 2))
    for graph, budget in cases:
        run_solver(name, graph, budget)


@pytest.mark.parametrize("name", SOLVERS)
def test_unknown_settings_and_names_are_documented_errors(name: str) -> None:
    with pytest.raises(SolverError, match="does not take settings"):
        get_solver(name, no_such_setting=1)
    with pytest.raises(SolverError, match="unknown"):
        get_solver(name + "_nope")
