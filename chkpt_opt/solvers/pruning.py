"""Exact reductions of the every-cut interval program, and the solver that uses them.

Over every allowed cut, the interval program of a graph of 200-300 ops has 10,000-35,000
candidate intervals and a million nonzeros; no MILP solves it in a minute. Most of those
intervals cannot be in any schedule better than a good known one, and two exact tests find
them:

1. **Cost**: a region costs at most the whole schedule it belongs to (costs are sums of
   non-negative forward times), so with an incumbent of cost ``UB`` that fits the budget,
   every interval costing more than ``UB`` is left out before the model is built
   (``build_interval_model(max_cost_s=...)``, which never builds them).
2. **Reduced costs**: with the LP relaxation's optimum ``LP`` and the reduced cost ``r_k`` of
   an interval at zero, every solution that chooses it costs at least ``LP + r_k``; when that
   exceeds ``UB`` (by a margin over the LP solver's tolerances) the interval is dropped
   (:func:`reduced_cost_fixing`, :func:`restrict`).

Neither drops a schedule costing at most ``UB``, and the incumbent's own intervals are always
kept, so the reduced program still holds an optimal schedule: its proven optimum is the
optimum of the whole schedule model, and its bound (or the LP's, which holds for the whole
model) is a proven bound. The incumbent comes from the greedy heuristic and, on graphs of
repeated blocks, the hierarchical solver with a share of the time limit (it is usually within
a few percent of the optimum, which is what makes the cost test bite). Building the model
stops at a deadline; on overrun the incumbent is returned as ``feasible`` without a bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ortools.linear_solver import pywraplp

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers.base import SolveResult, result_from_profile
from chkpt_opt.solvers.blocks import find_blocks
from chkpt_opt.solvers.cpsat import solve_cp, solve_min_peak
from chkpt_opt.solvers.greedy import GreedySolver
from chkpt_opt.solvers.hierarchical import HierarchicalSolver
from chkpt_opt.solvers.interval_model import (
    BuildTimeout,
    Holder,
    IntervalModel,
    Lifetime,
    build_interval_model,
)
from chkpt_opt.solvers.interval_program import IntervalProgram, build_program
from chkpt_opt.solvers.interval_solve import (
    Outcome,
    Prepared,
    check_flat_size,
    finish,
    keep_all_result,
    record_lowest,
    remaining_s,
)
from chkpt_opt.solvers.lp_round import lp_bound_s
from chkpt_opt.solvers.milp import (
    BACKENDS,
    DEFAULT_BACKEND,
    build_milp,
    objective_scale,
    solve_milp,
)
from chkpt_opt.solvers.registry import register

log = logging.getLogger(__name__)

ENGINES = (*BACKENDS, "cpsat")
"""What solves the pruned program: a MILP backend, or CP-SAT (at linearization level 2)."""

COST_TOLERANCE = 1e-9
"""Relative allowance between the model's and the simulator's sums of the same forward times."""

RC_MARGIN = 1e-4
"""Reduced-cost fixing drops an interval only when ``LP + r_k > UB * (1 + RC_MARGIN)`` plus
``RC_MARGIN`` objective units (1e-6 of the forward time each): far above GLOP's tolerances."""


def cost_cap(objective_s: float) -> float:
    """The largest interval cost kept for an incumbent of recompute time ``objective_s``.

    Slightly above the incumbent, so that its own regions (whose costs the model sums in
    another order than the simulator) are never left out.
    """
    return objective_s * (1 + COST_TOLERANCE) + 1e-15


def restrict(model: IntervalModel, keep: Iterable[int]) -> IntervalModel:
    """The model with only the intervals ``keep`` (renumbered in their order).

    Lifetimes lose the holds of dropped intervals; a lifetime no op or kept interval can
    extend any more is dropped (its fixed part is in the base bytes already). The result is
    what :func:`~chkpt_opt.solvers.interval_model.build_interval_model` would build from
    those intervals.
    """
    kept = sorted(set(keep))
    new_id = {k: j for j, k in enumerate(kept)}
    lifetimes: list[Lifetime] = []
    for life in model.lifetimes:
        holders = []
        ends: set[int] = set()
        for holder in life.holders:
            region_ends = tuple((new_id[k], e) for k, e in holder.region_ends if k in new_id)
            if holder.outside_end is None and not region_ends:
                continue
            holders.append(Holder(holder.node, holder.outside_end, region_ends))
            if holder.outside_end is not None:
                ends.add(holder.outside_end)
            ends.update(e for _, e in region_ends)
        if holders:
            lifetimes.append(replace(life, ends=tuple(sorted(ends)), holders=tuple(holders)))
    return replace(
        model,
        intervals=tuple(model.intervals[k] for k in kept),
        lifetimes=tuple(lifetimes),
    )


@dataclass(frozen=True)
class LpFixing:
    """What the LP relaxation says about an interval program.

    Attributes:
        status: GLOP's status name.
        bound_s: the LP optimum in seconds, lowered by its tolerance (a proven lower bound on
            every schedule the program holds), or None when the LP was not solved.
        keep: interval ids that may still be in a schedule costing at most the incumbent.
        lp_s: seconds spent.
    """

    status: str
    bound_s: float | None
    keep: tuple[int, ...]
    lp_s: float


def reduced_cost_fixing(
    program: IntervalProgram,
    budget_bytes: int,
    upper_s: float,
    *,
    protect: Iterable[int] = (),
    time_limit_s: float | None = None,
) -> LpFixing:
    """Solves the LP relaxation and keeps the intervals its reduced costs cannot rule out.

    Args:
        program: the interval program.
        budget_bytes: the budget.
        upper_s: the cost of a schedule the program holds that fits (the incumbent).
        protect: interval ids always kept (the incumbent's).
        time_limit_s: limit of building and solving the LP together.

    Returns:
        The LP's bound and the kept intervals (all of them when the LP is not solved or
        out of time).
    """
    start = time.perf_counter()
    model = program.model
    every = tuple(range(len(model.intervals)))
    deadline = None if time_limit_s is None else start + time_limit_s
    try:
        lp, v = build_milp(
            program, program.budget_units(budget_bytes), relax=True, deadline=deadline
        )
    except BuildTimeout:
        return LpFixing("BUILD_TIMED_OUT", None, every, time.perf_counter() - start)
    lp.SuppressOutput()
    if deadline is not None:
        lp.SetTimeLimit(max(1, int((deadline - time.perf_counter()) * 1000)))
    status = lp.Solve()
    name = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}.get(
        status, str(status)
    )
    if status != pywraplp.Solver.OPTIMAL:
        return LpFixing(name, None, every, time.perf_counter() - start)
    scale = objective_scale(model)
    lp_units = lp.Objective().Value()
    threshold = upper_s * scale * (1 + RC_MARGIN) + RC_MARGIN
    protected = set(protect)
    keep = tuple(
        k
        for k, var in enumerate(v.x)
        if k in protected
        or var.solution_value() > 1e-9
        or not lp_units + var.reduced_cost() > threshold
    )
    bound = lp_bound_s(lp_units / scale, model)
    return LpFixing(name, bound, keep, time.perf_counter() - start)


def incumbent(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None) -> SolveResult:
    """The best of greedy and, on graphs of repeated blocks, the hierarchical solver."""
    results = [GreedySolver()(graph, budget_bytes, time_limit_s=time_limit_s)]
    if find_blocks(graph) is not None:
        try:
            results.append(HierarchicalSolver()(graph, budget_bytes, time_limit_s=time_limit_s))
        except SolverError as err:
            log.info("hierarchical incumbent refused: %s", err)
    feasible = [r for r in results if r.feasible]
    if feasible:
        return min(feasible, key=lambda r: (r.objective, r.peak_bytes))
    return min(results, key=lambda r: (r.peak_bytes, r.objective))


@register("pruned", "MILP over every cut after exact cost and reduced-cost pruning")
@dataclass(frozen=True)
class PrunedSolver:
    """Exact solver for mid-size graphs: incumbent, exact pruning, MILP over every cut.

    Attributes:
        incumbent_share: share of the time limit given to the incumbent (greedy, then the
            hierarchical solver on graphs of repeated blocks).
        build_share: the model's build stops once this share of the time limit has passed
            (the incumbent is then returned, without a bound).
        min_milp_s: the final solve is skipped when less time than this is left after the LP
            (the incumbent is then returned with the LP's bound).
        reduced_costs: also drop intervals by LP reduced costs (see the module docstring).
        backend: what solves the pruned program: ``"highs"`` (default: measured fastest to
            a proof here), ``"scip"`` or ``"cpsat"``.
        seed: the backend's random seed.
    """

    incumbent_share: float = 0.35
    build_share: float = 0.7
    min_milp_s: float = 1.0
    reduced_costs: bool = True
    backend: str = DEFAULT_BACKEND
    seed: int = 0
    name: str = "pruned"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        if self.backend not in ENGINES:
            raise SolverError(
                f"backend {self.backend!r} is unknown; use one of {', '.join(ENGINES)}."
            )
        check_flat_size(graph)
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, start=start)
        if trivial is not None:
            return trivial
        share = None if time_limit_s is None else self.incumbent_share * time_limit_s
        best = incumbent(graph, budget_bytes, time_limit_s=share)
        stats: dict[str, Any] = {
            "incumbent_from": best.solver,
            "incumbent_s": best.objective if best.feasible else None,
            "incumbent_solve_s": time.perf_counter() - start,
        }
        cap = cost_cap(best.objective) if best.feasible else None
        deadline = None if time_limit_s is None else start + self.build_share * time_limit_s
        t0 = time.perf_counter()
        try:
            model = build_interval_model(graph, max_cost_s=cap, deadline=deadline)
            program = build_program(model, deadline=deadline)
        except BuildTimeout as err:
            log.info("pruned: %s Returning the incumbent.", err)
            stats["build_timed_out"] = True
            return self._incumbent_result(graph, best, budget_bytes, start, stats)
        stats["intervals_after_cost"] = len(model.intervals)
        prepared = Prepared(model, program, time.perf_counter() - t0)
        ids = model.interval_ids(best.schedule.spans(graph)) if best.feasible else None
        lp_bound_units = None
        if self.reduced_costs and best.feasible:
            fixing = reduced_cost_fixing(
                program,
                budget_bytes,
                best.objective,
                protect=ids or (),
                time_limit_s=remaining_s(time_limit_s, start),
            )
            stats.update(lp_status=fixing.status, lp_s=fixing.lp_s)
            if fixing.bound_s is not None:
                stats["lp_bound_s"] = fixing.bound_s
                lp_bound_units = fixing.bound_s * program.cost_scale
            if len(fixing.keep) < len(model.intervals) and self._time_left(time_limit_s, start):
                t0 = time.perf_counter()
                end = None if time_limit_s is None else start + time_limit_s
                try:
                    small = restrict(model, fixing.keep)
                    program = build_program(small, deadline=end)
                    model = small
                    prepared = Prepared(model, program, prepared.build_s + time.perf_counter() - t0)
                    ids = model.interval_ids(best.schedule.spans(graph))
                except BuildTimeout:
                    stats["build_timed_out"] = True
        stats["intervals_after_lp"] = len(model.intervals)
        if self._time_left(time_limit_s, start) and not stats.get("build_timed_out"):
            if self.backend == "cpsat":
                outcome = solve_cp(
                    prepared,
                    budget_bytes,
                    seed=self.seed,
                    hint_ids=ids,
                    time_limit_s=remaining_s(time_limit_s, start),
                    linearization_level=2,
                )
            else:
                outcome = solve_milp(
                    prepared,
                    budget_bytes,
                    backend=self.backend,
                    seed=self.seed,
                    hint_ids=ids,
                    time_limit_s=remaining_s(time_limit_s, start),
                )
        else:
            stats["milp_skipped"] = "out of time"
            outcome = Outcome(None, False, False, None)
        bound_units = outcome.bound_units
        if lp_bound_units is not None:
            # finish() lowers a bound by the cost rounding of an integer program; the LP's
            # is in seconds already, so it is raised by as much here.
            lp_units = lp_bound_units + 0.5 * model.n_ops
            bound_units = lp_units if bound_units is None else max(bound_units, lp_units)
        stats.update(outcome.stats)
        lowest = None
        if outcome.proven_infeasible and model.max_cost_s is None:
            schedule, profile, lower, proven = solve_min_peak(
                graph, prepared, time_limit_s=remaining_s(time_limit_s, start), seed=self.seed
            )
            lowest = record_lowest(stats, schedule, profile, lower_bytes=lower, proven=proven)
        outcome = replace(outcome, bound_units=bound_units, stats=stats)
        return finish(
            graph,
            budget_bytes,
            prepared,
            outcome,
            solver=self.name,
            start=start,
            fallback=best,
            lowest=lowest,
        )

    def _time_left(self, time_limit_s: float | None, start: float) -> bool:
        """Whether at least ``min_milp_s`` of the time limit is left."""
        left = remaining_s(time_limit_s, start)
        return left is None or left >= self.min_milp_s

    def _incumbent_result(
        self,
        graph: CostGraph,
        best: SolveResult,
        budget_bytes: int,
        start: float,
        stats: dict[str, Any],
    ) -> SolveResult:
        """The incumbent as this solver's result: no bound (the model was not solved)."""
        return result_from_profile(
            best.schedule,
            simulate(graph, best.schedule),
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            stats={**stats, "complete_model": False},
        )


def solve_pruned_as(
    name: str,
    graph: CostGraph,
    budget_bytes: int,
    *,
    backend: str,
    seed: int,
    time_limit_s: float | None,
    start: float,
) -> SolveResult:
    """:class:`PrunedSolver`'s result under another solver's name (``milp`` and ``cpsat``
    above their ``max_positions``), timed from ``start`` and marked ``pruned`` in its stats."""
    result = PrunedSolver(backend=backend, seed=seed)(
        graph, budget_bytes, time_limit_s=remaining_s(time_limit_s, start)
    )
    return replace(
        result,
        solver=name,
        solve_s=time.perf_counter() - start,
        stats={**result.stats, "pruned": True},
    )
