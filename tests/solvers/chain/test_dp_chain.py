"""dp_chain, the exact DP over a chain of segments, and Revolve as a reference.

* The DP's piece-by-piece memory (``ChainModel.predict``) equals the simulator's peak and
  recompute time on random schedules of chains, DAGs and traced models.
* On chains (homogeneous and heterogeneous, saving inputs, outputs or nothing) and on DAGs
  whose allowed cuts are articulation points, at many budgets from below the minimum to
  keep-all, its objective equals brute-force enumeration's, CP-SAT's and the MILP's, with an
  honest status (``optimal`` when every allowed cut is a segment boundary; ``infeasible`` with
  the lowest-peak schedule below the minimum).
* Where some allowed cuts cannot be boundaries, it is exact over the schedules with boundaries
  in its cut set (equal to enumeration restricted to them, and to CP-SAT over those positions)
  and never claims optimality.
* It is deterministic, refuses what it does not model, and solves 300-op chains in seconds.
* Revolve's binomial formula equals the recursion and an exhaustive search of Griewank's
  model; on homogeneous chains Revolve recomputes no more than the keep-set optimum at matching
  memory (the same wherever one level suffices), and reaches memory the keep-set model cannot.
"""

from __future__ import annotations

import heapq
import random
import time
from pathlib import Path

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, check_graph, new_graph, node_attrs, ordered_nodes
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveStatus, available_solvers, get_solver
from chkpt_opt.solvers.chain.dp_chain import ChainModel, run_dp
from chkpt_opt.solvers.engines.cpsat_engine import build_cp_model, make_solver
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.interval.program import build_program
from chkpt_opt.solvers.keepset.enumerate import best_for_budget, evaluate_all, pareto_front
from tests.conftest import REL, assert_valid_result
from tests.reference.revolve import (
    homogeneous_chain,
    repetition_number,
    revolve_forward_steps,
    revolve_forward_steps_recursive,
    revolve_reference,
)

CORPUS = Path(__file__).resolve().parents[3] / "graphs"


# -- graphs -------------------------------------------------------------------------------


def _chain(n: int, *, saves: str, hetero: bool, seed: int = 0) -> CostGraph:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 8) << 12 for _ in range(n)] if hetero else 1 << 14
    times = [rng.uniform(1e-4, 2e-3) for _ in range(n)] if hetero else 1e-3
    kind = "het" if hetero else "hom"
    return chain_graph(
        n, activation_bytes=sizes, fwd_time_s=times, saves=saves, name=f"{kind}{n}_{saves}_s{seed}"
    )


def block_dag(n_blocks: int, *, seed: int) -> CostGraph:
    """Residual blocks of 2-4 ops: the last op of a block also reads the block's input (or its
    first op); only block boundaries are allowed cuts, so they are articulation points."""
    rng = random.Random(seed)
    graph = new_graph(f"blocks{n_blocks}_s{seed}")
    names: list[str] = []
    for _ in range(n_blocks):
        block_input = names[-1] if names else None
        first = len(names)
        length = rng.randint(2, 4)
        for k in range(length):
            i = len(names)
            name = f"n{i}"
            inputs = [names[-1]] if names else []
            if k == length - 1 and length > 2:
                skip = block_input if block_input and rng.random() < 0.6 else names[first]
                if skip not in inputs:
                    inputs.append(skip)
            saves = rng.choice(["input", "output", "none"] if inputs else ["output", "none"])
            out = rng.randint(1, 16) << 12
            saved: dict[str, int] = {}
            if saves == "input":
                for u in inputs:
                    saved.update(graph.nodes[u]["outputs"])
            elif saves == "output":
                saved[name] = out
            t = rng.uniform(1e-4, 2e-3)
            graph.add_node(
                name,
                **node_attrs(
                    index=i,
                    op=f"synthetic.{saves}",
                    outputs={name: out},
                    saved=saved,
                    grad_bytes=out,
                    fwd_flops=int(t * 1e9),
                    bwd_flops=int(2 * t * 1e9),
                    fwd_time_s=t,
                    bwd_time_s=2 * t,
                    cut_after_ok=k == length - 1,
                ),
            )
            for u in inputs:
                graph.add_edge(u, name)
            names.append(name)
    graph.graph["outputs"] = names[-1:]
    check_graph(graph)
    return graph


def articulated(graph: CostGraph) -> CostGraph:
    """A copy of ``graph`` whose allowed cuts are only those dp_chain can use (its articulation
    points), so that dp_chain is exact over the copy's whole schedule model."""
    cuts = set(ChainModel(graph).cuts)
    copy = graph.copy()
    copy.graph["name"] = f"{graph.graph['name']}_art"
    for i, v in enumerate(ordered_nodes(copy)[:-1]):
        copy.nodes[v]["cut_after_ok"] = copy.nodes[v]["cut_after_ok"] and (i + 1) in cuts
    assert ChainModel(copy).complete
    return copy


def _enumerable_graphs() -> list[CostGraph]:
    """Complete chains and DAGs small enough to enumerate."""
    graphs = [
        _chain(n, saves=saves, hetero=hetero, seed=n)
        for n, hetero in ((1, True), (2, True), (5, False), (8, True), (8, False), (10, True))
        for saves in ("input", "output", "none")
    ]
    graphs += [block_dag(k, seed=s) for k, s in ((4, 0), (4, 1), (5, 2), (6, 3), (6, 4))]
    graphs += [
        articulated(random_dag(n, seed=s, skip_prob=0.5, max_inputs=3))
        for n, s in ((9, 1), (9, 3), (12, 0), (12, 5))
    ]
    return graphs


class Reference:
    """Every schedule of a graph (with region boundaries in ``cuts`` if given), simulated."""

    def __init__(self, graph: CostGraph, cuts: set[int] | None = None) -> None:
        evaluated, complete = evaluate_all(graph)
        assert complete
        if cuts is not None:
            evaluated = [e for e in evaluated if all(a in cuts and b in cuts for a, b in e.spans)]
        self.evaluated = evaluated
        self.front = pareto_front(evaluated)
        self.min_peak = self.front[0].peak_bytes
        self.keep_all = simulate(graph, Schedule()).peak_bytes
        lo, hi = self.min_peak, self.keep_all
        budgets = {0, lo - 1, lo, hi, *(lo + (hi - lo) * k // 9 for k in range(10))}
        budgets |= {e.peak_bytes for e in self.front} | {e.peak_bytes - 1 for e in self.front}
        self.budgets = sorted(b for b in budgets if b >= 0)


def _budgets(graph: CostGraph, n: int) -> list[int]:
    """The exact minimum peak minus one, then ``n`` budgets from it to keep-all."""
    low = int(run_dp(ChainModel(graph), None).value)
    high = simulate(graph, Schedule()).peak_bytes
    return [low - 1, *sorted({low + (high - low) * k // (n - 1) for k in range(n)})]


def _cpsat_over(graph: CostGraph, positions: list[int], budget: int) -> float | None:
    """CP-SAT's optimum over the schedules whose region boundaries lie in ``positions``."""
    model = build_interval_model(graph, positions=positions)
    program = build_program(model)
    m, v = build_cp_model(program, program.budget_units(budget))
    m.minimize(sum(c * x for c, x in zip(program.cost_units, v.x)))
    solver = make_solver(time_limit_s=None, seed=0, workers=1)
    status = solver.solve(m)
    if solver.status_name(status) == "INFEASIBLE":
        return None
    assert solver.status_name(status) == "OPTIMAL"
    return model.cost_s([k for k, x in enumerate(v.x) if solver.boolean_value(x)])


def _random_spans(cuts: tuple[int, ...], rng: random.Random) -> list[tuple[int, int]]:
    spans, k = [], 0
    while k < len(cuts) - 1:
        if rng.random() < 0.5:
            j = rng.randint(k + 1, min(len(cuts) - 1, k + 8))
            spans.append((cuts[k], cuts[j]))
            k = j
        else:
            k += 1
    return spans


# -- the model ---------------------------------------------------------------------------


def test_prediction_matches_the_simulator() -> None:
    rng = random.Random(0)
    graphs = [
        _chain(n, saves=s, hetero=True, seed=n)
        for n in (1, 3, 12, 30)
        for s in ("input", "output", "none")
    ]
    graphs += [block_dag(6, seed=s) for s in range(3)]
    graphs += [
        random_dag(n, seed=s, skip_prob=0.4, max_inputs=3) for n in (8, 25) for s in range(3)
    ]
    graphs += [
        load_graph(CORPUS / f"{name}_small.json") for name in ("mlp", "vgg", "resnet", "gpt")
    ]
    checked = 0
    for graph in graphs:
        chain = ChainModel(graph)
        for trial in range(20):
            spans = [] if trial == 0 else _random_spans(chain.cuts, rng)
            profile = simulate(graph, Schedule.from_spans(graph, spans))
            peak, cost = chain.predict(spans)
            assert peak == profile.peak_bytes, (graph.graph["name"], spans)
            assert cost == pytest.approx(profile.recompute_s, rel=REL, abs=1e-15)
            checked += 1
    assert checked == 20 * len(graphs)


def test_chains_and_articulation_dags_use_every_cut() -> None:
    for graph in [_chain(10, saves=s, hetero=True) for s in ("input", "output", "none")]:
        chain = ChainModel(graph)
        assert chain.complete and chain.cuts == tuple(range(11))
    for seed in range(3):
        graph = block_dag(5, seed=seed)
        chain = ChainModel(graph)
        assert chain.complete and len(chain.cuts) == chain.allowed == 6
    skip = random_dag(20, seed=3, skip_prob=0.5, max_inputs=3)
    chain = ChainModel(skip)
    assert not chain.complete and 2 <= len(chain.cuts) < chain.allowed


# -- exactness -----------------------------------------------------------------------------


def test_dp_chain_equals_enumeration() -> None:
    solver = get_solver("dp_chain")
    n_graphs = n_budgets = 0
    for graph in _enumerable_graphs():
        ref = Reference(graph)
        assert ChainModel(graph).complete
        n_graphs += 1
        for budget in ref.budgets:
            result = solver(graph, budget)
            assert_valid_result(graph, result, budget)
            best = best_for_budget(ref.evaluated, budget)
            where = (graph.graph["name"], budget)
            if best is None:
                assert result.status == SolveStatus.INFEASIBLE, where
                assert result.peak_bytes == ref.min_peak, where
                assert result.stats["min_feasible_bytes"] == ref.min_peak
                assert result.stats["min_feasible_proven"] is True
                assert result.bound is None and result.gap is None
                cheapest = min(e.recompute_s for e in ref.evaluated if e.peak_bytes == ref.min_peak)
                assert result.objective == pytest.approx(cheapest, rel=REL, abs=1e-15)
            else:
                assert result.status == SolveStatus.OPTIMAL, where
                assert result.objective == pytest.approx(best.recompute_s, rel=REL, abs=1e-15)
                assert result.gap == 0.0
            n_budgets += 1
    assert n_graphs == 27 and n_budgets > 300


def test_enumerate_solver_agrees() -> None:
    for graph in (_chain(6, saves="output", hetero=True), block_dag(3, seed=4)):
        ref = Reference(graph)
        for budget in ref.budgets[::2]:
            a = get_solver("dp_chain")(graph, budget)
            b = get_solver("enumerate")(graph, budget)
            assert a.status == b.status
            assert a.peak_bytes <= budget or a.peak_bytes == b.peak_bytes
            assert a.objective == pytest.approx(b.objective, rel=REL, abs=1e-15)


def _exact_graphs() -> list[CostGraph]:
    """Larger complete graphs for the integer programs."""
    graphs = [
        _chain(24, saves="input", hetero=False),
        _chain(12, saves="output", hetero=False),  # CP-SAT is slow on longer symmetric ones
        _chain(24, saves="input", hetero=True, seed=1),
        _chain(24, saves="output", hetero=True, seed=2),
        _chain(20, saves="none", hetero=True, seed=3),
        block_dag(8, seed=5),
        block_dag(8, seed=6),
        articulated(random_dag(20, seed=2, skip_prob=0.5, max_inputs=3)),
    ]
    assert all(ChainModel(g).complete for g in graphs)
    return graphs


def test_dp_chain_equals_cpsat_and_milp() -> None:
    solvers = [get_solver(n) for n in ("dp_chain", "cpsat", "milp")]
    n_budgets = 0
    for graph in _exact_graphs():
        for budget in _budgets(graph, 7):
            results = [s(graph, budget) for s in solvers]
            for result in results:
                assert_valid_result(graph, result, budget)
            where = (graph.graph["name"], budget)
            statuses = {r.status for r in results}
            assert len(statuses) == 1, (where, [r.status for r in results])
            if results[0].feasible:
                assert statuses == {SolveStatus.OPTIMAL}, where
                objectives = [r.objective for r in results]
                assert max(objectives) - min(objectives) <= REL * max(objectives) + 1e-15, where
            else:
                assert len({r.peak_bytes for r in results}) == 1, where
            n_budgets += 1
    assert n_budgets >= 8 * 6


def test_restricted_cut_set_is_exact_there_and_never_called_optimal() -> None:
    for graph in [random_dag(n, seed=s, skip_prob=0.5, max_inputs=3) for n, s in ((8, 2), (9, 0))]:
        chain = ChainModel(graph)
        assert not chain.complete
        ref = Reference(graph, set(chain.cuts))
        for budget in ref.budgets:
            result = get_solver("dp_chain")(graph, budget)
            assert_valid_result(graph, result, budget)
            best = best_for_budget(ref.evaluated, budget)
            if best is None:
                assert result.status == SolveStatus.INFEASIBLE
                assert result.peak_bytes == ref.min_peak
                assert result.stats["min_feasible_proven"] is False
                continue
            assert result.objective == pytest.approx(best.recompute_s, rel=REL, abs=1e-15)
            if budget < ref.keep_all:
                assert result.status == SolveStatus.FEASIBLE and result.bound is None
                assert result.stats["complete_model"] is False
                assert "optimal_over" in result.stats
    for seed in range(3):
        graph = random_dag(22, seed=seed, skip_prob=0.5, max_inputs=3)
        chain = ChainModel(graph)
        for budget in _budgets(graph, 4)[1:-1]:
            result = get_solver("dp_chain")(graph, budget)
            expected = _cpsat_over(graph, list(chain.cuts), budget)
            assert expected is not None and result.feasible
            assert result.objective == pytest.approx(expected, rel=REL, abs=1e-15)
            assert result.status == SolveStatus.FEASIBLE


def test_infeasible_budgets_give_the_lowest_peak() -> None:
    graph = _chain(30, saves="output", hetero=True, seed=7)
    low = get_solver("cpsat")(graph, 0)
    assert low.status == SolveStatus.INFEASIBLE
    for budget in (0, low.peak_bytes // 2, low.peak_bytes - 1):
        result = get_solver("dp_chain")(graph, budget)
        assert_valid_result(graph, result, budget)
        assert result.status == SolveStatus.INFEASIBLE
        assert result.peak_bytes == low.peak_bytes == result.stats["min_feasible_bytes"]
    at_min = get_solver("dp_chain")(graph, low.peak_bytes)
    assert at_min.status == SolveStatus.OPTIMAL
    assert at_min.objective == pytest.approx(
        get_solver("cpsat")(graph, low.peak_bytes).objective, rel=REL
    )


def test_same_inputs_same_schedule() -> None:
    for graph in (_chain(40, saves="input", hetero=True), block_dag(10, seed=1)):
        for budget in _budgets(graph, 5):
            first = get_solver("dp_chain")(graph, budget)
            second = get_solver("dp_chain")(graph, budget)
            assert first.schedule == second.schedule
            assert first.status == second.status and first.objective == second.objective


def test_three_hundred_op_chains_solve_in_seconds() -> None:
    for graph, fraction in (
        (chain_graph(300, activation_bytes=1 << 20, fwd_time_s=1e-3), 0.3),
        (_chain(300, saves="output", hetero=True, seed=11), 0.4),
    ):
        budget = int(simulate(graph, Schedule()).peak_bytes * fraction)
        start = time.perf_counter()
        result = get_solver("dp_chain")(graph, budget)
        assert time.perf_counter() - start < 60.0
        assert_valid_result(graph, result, budget)
        assert result.status == SolveStatus.OPTIMAL and result.stats["cuts"] == 301
        greedy = get_solver("greedy")(graph, budget)
        if greedy.feasible:
            assert result.objective <= greedy.objective * (1 + REL)


@pytest.mark.slow
def test_longer_chains_equal_milp() -> None:
    for graph in (
        _chain(60, saves="input", hetero=True, seed=21),
        _chain(60, saves="output", hetero=True, seed=22),
        block_dag(20, seed=23),
    ):
        for budget in _budgets(graph, 6):
            a = get_solver("dp_chain")(graph, budget)
            b = get_solver("milp")(graph, budget)
            assert a.status == b.status
            if a.feasible:
                assert a.status == SolveStatus.OPTIMAL
                assert a.objective == pytest.approx(b.objective, rel=REL, abs=1e-15)


# -- refusals, limits, registry --------------------------------------------------------------


def test_refuses_what_it_does_not_model() -> None:
    graph = _chain(6, saves="output", hetero=True)
    graph.nodes["n3"]["has_backward"] = False  # keeps its output to the end of the step
    with pytest.raises(SolverError, match="never runs"):
        get_solver("dp_chain")(graph, 1 << 30)
    skip = random_dag(20, seed=3, skip_prob=0.5, max_inputs=3)
    with pytest.raises(SolverError, match="not a chain"):
        get_solver("dp_chain", require_complete=True)(skip, 1 << 30)
    with pytest.raises(SolverError, match="max_cuts"):
        get_solver("dp_chain", max_cuts=10)(_chain(20, saves="input", hetero=True), 1 << 30)
    with pytest.raises(SolverError, match="max_entries"):
        get_solver("dp_chain", max_entries=50)(_chain(40, saves="input", hetero=True), 1 << 18)


def test_time_limit_is_honest() -> None:
    graph = _chain(200, saves="input", hetero=True, seed=5)
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.5)
    result = get_solver("dp_chain")(graph, budget, time_limit_s=0.0)
    assert_valid_result(graph, result, budget)
    assert result.stats["timed_out"] is True
    assert result.status in (SolveStatus.FEASIBLE, SolveStatus.TIMED_OUT)


def test_auto_prefers_dp_chain_on_chains() -> None:
    graph = _chain(48, saves="output", hetero=True, seed=9)
    low = get_solver("dp_chain")(graph, 0)
    high = simulate(graph, Schedule()).peak_bytes
    budget = (low.peak_bytes + high) // 2
    result = get_solver("auto")(graph, budget, time_limit_s=6)  # dp_chain answers in 0.1 s
    assert_valid_result(graph, result, budget)
    assert result.stats["chosen"] == "dp_chain" and "cpsat" not in result.stats["tried"]
    assert result.status == SolveStatus.OPTIMAL
    assert result.objective == pytest.approx(get_solver("milp")(graph, budget).objective, rel=REL)
    # Below the keep-set floor: nothing keep-set fits (nested schedules may: general=True).
    below = get_solver("auto", general=False)(graph, low.peak_bytes - 1)
    assert below.status == SolveStatus.INFEASIBLE and below.peak_bytes == low.peak_bytes
    other = random_dag(30, seed=1, skip_prob=0.5, max_inputs=3)
    budget = int(simulate(other, Schedule()).peak_bytes * 0.8)
    assert "dp_chain" not in get_solver("auto")(other, budget, time_limit_s=5).stats["tried"]


def test_registered() -> None:
    assert "dp_chain" in available_solvers()
    assert get_solver("dp_chain", require_complete=True).require_complete


# -- Revolve ---------------------------------------------------------------------------------


def _griewank_search(steps: int, slots: int) -> int:
    """Exhaustive search of Griewank's model: least forward steps to reverse ``steps`` steps,
    holding at most ``slots`` checkpoints (the initial state in one) plus the current state.

    Moves: advance the current state one step (cost 1); store it; restore a stored state; drop
    a stored state; reverse the last unreversed step when the current state is its input
    (its forward is fused with the adjoint).
    """
    start = (frozenset({0}), 0, steps)
    best = {start: 0}
    queue = [(0, 0, start)]
    counter = 0
    while queue:
        cost, _, state = heapq.heappop(queue)
        stored, current, left = state
        if left == 0:
            return cost
        if cost > best[state]:
            continue
        moves = []
        if current + 1 <= left - 1:
            moves.append((1, (stored, current + 1, left)))
        if current < left and current not in stored and len(stored) < slots:
            moves.append((0, (stored | {current}, current, left)))
        moves += [(0, (stored, s, left)) for s in stored if s != current]
        moves += [(0, (stored - {s}, current, left)) for s in stored]
        if current == left - 1:
            kept = frozenset(s for s in stored if s < left - 1)
            moves.append((0, (kept, current, left - 1)))
        for step, nxt in moves:
            if cost + step < best.get(nxt, 1 << 30):
                best[nxt] = cost + step
                counter += 1
                heapq.heappush(queue, (cost + step, counter, nxt))
    raise AssertionError("no reversal found")


def test_binomial_formula_matches_the_recursion() -> None:
    for steps in range(1, 21):
        for slots in range(1, 6):
            assert revolve_forward_steps(steps, slots) == revolve_forward_steps_recursive(
                steps, slots
            ), (steps, slots)
    assert revolve_forward_steps(7, 1) == 21  # l (l - 1) / 2 with the initial state only
    assert revolve_forward_steps(20, 19) == 19  # every state stored: one forward sweep
    with pytest.raises(ValueError):
        revolve_forward_steps(0, 2)


def test_recursion_matches_an_exhaustive_search() -> None:
    for steps in range(1, 9):
        for slots in range(1, 4):
            assert _griewank_search(steps, slots) == revolve_forward_steps(steps, slots)


def test_revolve_reference_on_homogeneous_chains() -> None:
    for length in (6, 13, 24):
        graph = chain_graph(length, activation_bytes=1 << 12, fwd_time_s=2e-3)
        assert homogeneous_chain(graph) == (length, 1 << 12, 2e-3)
        rows = revolve_reference(graph)
        assert [r.slots for r in rows] == list(range(1, length))
        for row in rows:
            assert row.budget_bytes == (row.slots + 1) << 12
            assert row.repetitions == repetition_number(length, row.slots)
            if row.dp_extra_s is None:
                # Below the keep-set model's reach: Revolve nests (repeats steps >= 3 times).
                assert row.dp_status == SolveStatus.INFEASIBLE and row.repetitions >= 3
                continue
            assert row.dp_status == SolveStatus.OPTIMAL
            assert row.revolve_extra_s <= row.dp_extra_s * (1 + REL) + 1e-15
            # Where one level of recomputation suffices, the two optima coincide.
            assert row.repetitions <= 2
            assert row.dp_extra_s == pytest.approx(row.revolve_extra_s, rel=REL, abs=1e-15)
        assert rows[-1].revolve_extra_steps == 0 and rows[-1].dp_extra_s == 0.0
        assert any(r.dp_extra_s is None for r in rows)
    with pytest.raises(ValueError, match="homogeneous"):
        homogeneous_chain(_chain(5, saves="input", hetero=True))
