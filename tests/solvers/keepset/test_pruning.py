"""Exact pruning of the every-cut interval program (solvers.keepset.pruned,
solvers.bounds.reductions).

The cost-pruned model is the full model less its intervals over the cap, built without ever
building them; restricting a model to a set of intervals gives what the builder would build
from them; the pruned model and the reduced-cost fixing keep the incumbent; the solver over
the pruned program equals brute-force enumeration, also with the cap at the optimum itself
(the ``>`` against ``>=`` edge); every reported bound is at most the true optimum; the build
stops at its deadline.
"""

from __future__ import annotations

import dataclasses
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
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.bounds.reductions import cost_cap, reduced_cost_fixing, restrict
from chkpt_opt.solvers.deadline import Deadline, DeadlineExceeded
from chkpt_opt.solvers.engines.milp_engine import solve_milp
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.interval.judge import finish
from chkpt_opt.solvers.interval.prepare import Prepared
from chkpt_opt.solvers.interval.program import build_program, count_terms
from chkpt_opt.solvers.keepset import pruned_search
from chkpt_opt.solvers.keepset.enumerate import best_for_budget, evaluate_all, pareto_front
from chkpt_opt.solvers.keepset.warm_start import quick_incumbent
from tests.conftest import REL, assert_valid_result

CORPUS = Path(__file__).resolve().parents[3] / "graphs"


def _graphs() -> list[CostGraph]:
    graphs = [random_dag(8, seed=s, skip_prob=0.5, max_inputs=3) for s in (2, 3, 4)]
    graphs += [random_dag(10, seed=s, skip_prob=0.4, max_inputs=3) for s in (4, 6)]
    graphs.append(
        chain_graph(
            9,
            activation_bytes=[(k % 3 + 1) << 16 for k in range(9)],
            fwd_time_s=[1e-3 * (1 + k % 4) for k in range(9)],
            saves="input",
        )
    )
    return graphs


_BUDGETS: dict[str, tuple[list, list[int]]] = {}


def _budgets(graph: CostGraph) -> tuple[list, list[int]]:
    """Every schedule of ``graph`` evaluated (once per graph), and budgets along its front."""
    key = graph.graph["name"]
    if key not in _BUDGETS:
        _BUDGETS[key] = _evaluate(graph)
    return _BUDGETS[key]


def _evaluate(graph: CostGraph) -> tuple[list, list[int]]:
    evaluated, complete = evaluate_all(graph)
    assert complete
    front = pareto_front(evaluated)
    lo, hi = front[0].peak_bytes, simulate(graph, Schedule()).peak_bytes
    budgets = sorted(
        {lo, *(lo + (hi - lo) * k // 6 for k in range(6))} | {e.peak_bytes for e in front}
    )
    return evaluated, budgets


def _same_memory(full, pruned, rng: random.Random, n: int = 40) -> None:
    """Random disjoint choices of the pruned model's intervals have the same slot bytes in
    both models."""
    index = {(iv.start, iv.stop): k for k, iv in enumerate(full.intervals)}
    for _ in range(n):
        chosen, used = [], set()
        for k in rng.sample(range(len(pruned.intervals)), min(4, len(pruned.intervals))):
            iv = pruned.intervals[k]
            span = set(range(iv.start, iv.stop))
            if not span & used:
                chosen.append(k)
                used |= span
        mapped = [index[pruned.intervals[k].start, pruned.intervals[k].stop] for k in chosen]
        assert pruned.slot_bytes(chosen) == full.slot_bytes(mapped)


def test_cost_pruned_model_is_the_full_model_less_the_costly_intervals() -> None:
    rng = random.Random(0)
    for graph in [*_graphs(), random_dag(40, seed=1, skip_prob=0.5, max_inputs=3)]:
        full = build_interval_model(graph)
        costs = sorted({iv.cost_s for iv in full.intervals})
        for cap in (0.0, costs[len(costs) // 3], costs[2 * len(costs) // 3]):
            pruned = build_interval_model(graph, max_cost_s=cap)
            assert list(pruned.intervals) == [iv for iv in full.intervals if iv.cost_s <= cap]
            assert pruned.max_cost_s == cap
            keep = [k for k, iv in enumerate(full.intervals) if iv.cost_s <= cap]
            assert dataclasses.replace(restrict(full, keep), max_cost_s=cap) == pruned
            _same_memory(full, pruned, rng)


def test_pruned_models_hold_the_incumbent() -> None:
    for graph in _graphs():
        _, budgets = _budgets(graph)
        for budget in budgets:
            greedy = get_solver("greedy")(graph, budget)
            if not greedy.feasible:
                continue
            model = build_interval_model(graph, max_cost_s=cost_cap(greedy.objective))
            ids = model.interval_ids(greedy.schedule.spans(graph))  # raises if left out
            program = build_program(model)
            fixing = reduced_cost_fixing(program, budget, greedy.objective, protect=ids)
            assert set(ids) <= set(fixing.keep)
            restricted = restrict(model, fixing.keep)
            kept = restricted.interval_ids(greedy.schedule.spans(graph))  # raises if left out
            assert restricted.cost_s(kept) == pytest.approx(greedy.objective, rel=REL, abs=1e-15)
            assert restricted.peak_bytes(kept) == greedy.peak_bytes


@pytest.mark.parametrize("tight_cap", [False, True], ids=["greedy_cap", "cap_at_optimum"])
def test_pruned_program_equals_enumeration(tight_cap: bool) -> None:
    """With the cap at greedy's cost, or at the optimum itself (the edge case: intervals
    costing exactly the cap must stay), the MILP over the pruned program finds the optimum,
    proven, and its bound and the LP's are at most the optimum."""
    for graph in _graphs():
        evaluated, budgets = _budgets(graph)
        for budget in budgets:
            best = best_for_budget(evaluated, budget)
            greedy = get_solver("greedy")(graph, budget)
            if best is None or not greedy.feasible:
                continue
            upper = best.recompute_s if tight_cap else greedy.objective
            model = build_interval_model(graph, max_cost_s=cost_cap(upper))
            program = build_program(model)
            fixing = reduced_cost_fixing(program, budget, upper)
            assert fixing.bound_s is not None
            assert fixing.bound_s <= best.recompute_s * (1 + REL) + 1e-15
            model = restrict(model, fixing.keep)
            prepared = Prepared(model, build_program(model), 0.0)
            outcome = solve_milp(prepared.program, budget)
            # finish() trusts the pruned model only given an incumbent under the cap.
            incumbent = greedy if not tight_cap else _as_result(greedy, best.recompute_s)
            result = finish(
                graph,
                budget,
                prepared,
                outcome,
                solver="test",
                deadline=Deadline.after(None),
                fallback=incumbent,
            )
            where = (graph.graph["name"], budget, upper)
            assert result.status == SolveStatus.OPTIMAL, where
            assert result.objective == pytest.approx(best.recompute_s, rel=REL, abs=1e-15), where


def _as_result(result, objective: float):
    """``result`` claiming ``objective``: stands for an incumbent as good as the optimum."""
    return dataclasses.replace(result, objective=objective)


def test_pruned_solver_equals_enumeration() -> None:
    solver = get_solver("pruned")
    for graph in _graphs():
        evaluated, budgets = _budgets(graph)
        ref_low = pareto_front(evaluated)[0].peak_bytes
        for budget in [*budgets, ref_low - 1]:
            result = solver(graph, budget)
            assert_valid_result(graph, result, budget)
            best = best_for_budget(evaluated, budget)
            where = (graph.graph["name"], budget)
            if best is None:
                assert result.status == SolveStatus.INFEASIBLE, where
                assert result.peak_bytes == ref_low, where
                continue
            assert result.status == SolveStatus.OPTIMAL, where
            assert result.objective == pytest.approx(best.recompute_s, rel=REL, abs=1e-15)
            assert result.bound is not None
            assert result.bound <= best.recompute_s * (1 + REL) + 1e-15


def test_pruned_solver_agrees_with_the_every_cut_milp() -> None:
    graph = random_dag(40, seed=0, skip_prob=0.5, max_inputs=3)
    hi = simulate(graph, Schedule()).peak_bytes
    for fraction in (0.9, 0.8, 0.7):
        budget = int(hi * fraction)
        exact = get_solver("milp", max_positions=None)(graph, budget)
        pruned = get_solver("pruned")(graph, budget)
        assert_valid_result(graph, pruned, budget)
        assert pruned.status == exact.status != SolveStatus.FEASIBLE
        assert pruned.objective == pytest.approx(exact.objective, rel=REL, abs=1e-15)
        if pruned.status == SolveStatus.OPTIMAL:
            assert pruned.stats["intervals_after_lp"] <= pruned.stats["intervals_after_cost"]


def test_build_stops_at_its_deadline() -> None:
    graph = random_dag(160, seed=3, skip_prob=0.5, max_inputs=3)
    start = time.perf_counter()
    with pytest.raises(DeadlineExceeded):
        build_interval_model(graph, deadline=Deadline(start, 0.05))
    assert time.perf_counter() - start < 2.0


class _ExpiresAtCheck(Deadline):
    """A deadline that has expired from its ``n``-th check on (counts its checks)."""

    def __init__(self, n: int) -> None:
        super().__init__(time.perf_counter(), None)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "checks", [])

    def check(self, what: str) -> None:
        self.checks.append(what)
        if len(self.checks) >= self.n:
            raise DeadlineExceeded(f"{what}: expired at check {self.n}")


def test_program_build_checks_its_deadline_slot_by_slot() -> None:
    """The program's rows are built slot by slot with the deadline checked at each: on the
    586-op gpt_large at 0.3 of its peak the rows took 46 s, with the deadline checked only
    between phases, and the call ran 25 s past its limit."""
    graph = random_dag(60, seed=3, skip_prob=0.5, max_inputs=3)
    model = build_interval_model(graph)
    counting = _ExpiresAtCheck(10**9)
    build_program(model, deadline=counting)
    assert len(counting.checks) >= model.n_slots
    halfway = _ExpiresAtCheck(len(counting.checks) // 2)
    with pytest.raises(DeadlineExceeded):
        build_program(model, deadline=halfway)


def test_program_rows_name_each_variable_once_in_ascending_order() -> None:
    """What build_program relies on to make rows without summing terms: each interval and
    lifetime variable comes at most once per row, in ascending order, with bytes > 0."""
    for graph in (random_dag(40, seed=5, skip_prob=0.5, max_inputs=3), chain_graph(12)):
        for cache in ("none", "ranked"):
            program = build_program(build_interval_model(graph, cache=cache))
            for row in program.memory_rows:
                for terms in (row.x_terms, row.y_terms):
                    variables = [v for v, _ in terms]
                    assert variables == sorted(set(variables))
                    assert all(c > 0 for _, c in terms)


def test_count_terms_counts_the_rows_the_program_builds() -> None:
    """The count that sizes a program before it is built: every term of its hold rows and
    of its memory rows before identical ones merge."""
    for graph in (random_dag(40, seed=5, skip_prob=0.5, max_inputs=3), chain_graph(12)):
        model = build_interval_model(graph)
        program = build_program(model)
        built = sum((len(r.x_terms) + len(r.y_terms)) * len(r.slots) for r in program.memory_rows)
        built += sum(len(h.x_ids) + (h.node is not None) for h in program.holds)
        assert count_terms(model) == built > 0


def test_a_program_too_large_for_the_time_left_gives_the_block_search_that_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graph = load_graph(CORPUS / "gpt_small.json")  # repeated blocks
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.6)
    monkeypatch.setattr(pruned_search, "EXACT_BUILD_TERMS_PER_S", 1.0)
    start = time.perf_counter()
    result = get_solver("pruned")(graph, budget, time_limit_s=4)
    assert time.perf_counter() - start < 4 + 2
    assert_valid_result(graph, result, budget)
    assert "program terms" in result.stats["exact_skipped"]
    assert result.stats["incumbent_from"] == "hierarchical"
    assert result.status == SolveStatus.FEASIBLE and result.bound is None
    quick = quick_incumbent(graph, budget, time_limit_s=None)
    assert result.objective <= quick.objective + 1e-15


def test_a_skipped_exact_phase_ends_the_first_block_search_at_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """auto's setting: where the program is too large to build, the block search still
    ends at its share of the limit (it proves nothing; auto's cached-op search gets the
    rest), and the program is not sized again after it."""
    graph = load_graph(CORPUS / "gpt_small.json")  # repeated blocks
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.6)
    monkeypatch.setattr(pruned_search, "EXACT_BUILD_TERMS_PER_S", 1.0)
    sized: list[int] = []
    counted = pruned_search.program_terms_lower

    def counting(*args: object, **kwargs: object) -> int:
        sized.append(1)
        return counted(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pruned_search, "program_terms_lower", counting)
    start = time.perf_counter()
    result = get_solver("pruned", blocks_first=True, skipped_blocks_share=0.25)(
        graph, budget, time_limit_s=12
    )
    assert time.perf_counter() - start < 0.25 * 12 + 2
    assert_valid_result(graph, result, budget)
    assert "program terms" in result.stats["exact_skipped"]
    assert len(sized) == 1
    assert result.stats["incumbent_from"] in ("greedy", "hierarchical")
    assert result.status == SolveStatus.FEASIBLE and result.bound is None


def test_pruned_solver_returns_the_incumbent_when_out_of_time() -> None:
    graph = random_dag(160, seed=3, skip_prob=0.5, max_inputs=3)
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.9)  # greedy fits
    start = time.perf_counter()
    result = get_solver("pruned")(graph, budget, time_limit_s=0.3)
    assert time.perf_counter() - start < 3.0
    assert_valid_result(graph, result, budget)
    assert result.stats["build_timed_out"]
    assert result.status == SolveStatus.FEASIBLE and result.bound is None


@pytest.mark.parametrize("name", ["milp", "cpsat"])
def test_flat_solver_above_max_positions_solves_every_cut_after_pruning(name: str) -> None:
    graph = random_dag(40, seed=2, skip_prob=0.5, max_inputs=3)
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.85)
    result = get_solver(name, max_positions=16)(graph, budget)
    assert result.solver == name and result.stats["pruned"]
    assert_valid_result(graph, result, budget)
    exact = get_solver(name, max_positions=None)(graph, budget)
    assert result.status == exact.status == SolveStatus.OPTIMAL
    assert result.objective == pytest.approx(exact.objective, rel=REL, abs=1e-15)
    thinned = get_solver(name, max_positions=16, prune=False)(graph, budget)
    assert thinned.stats["complete_model"] is False


def test_an_exact_share_outside_zero_to_one_is_refused() -> None:
    graph = chain_graph(8, activation_bytes=1000)
    with pytest.raises(SolverError, match=r"exact_share must lie in \[0, 1\], got 1.5"):
        get_solver("pruned", exact_share=1.5)(graph, 6000, time_limit_s=5)


def test_the_block_search_first_leaves_the_exact_phase_its_proof() -> None:
    """With ``blocks_first`` (auto's setting) the block search runs before the model is
    built, and the exact phase after it, under its cost cap, proves the optimum the default
    order proves."""
    graph = load_graph(CORPUS / "resnet_large.json")  # repeated blocks, proven in seconds
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.7)
    default = get_solver("pruned")(graph, budget, time_limit_s=60)
    first = get_solver("pruned", blocks_first=True)(graph, budget, time_limit_s=60)
    assert_valid_result(graph, first, budget)
    assert default.status == first.status == SolveStatus.OPTIMAL
    assert first.objective == pytest.approx(default.objective, rel=1e-6)
    assert "exact_skipped" not in first.stats
