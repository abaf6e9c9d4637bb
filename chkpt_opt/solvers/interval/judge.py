"""Judging an engine's outcome: every schedule an integer program returns is simulated; its
simulated peak and recompute time must equal what the interval model predicts, else the
model has a bug and :class:`~chkpt_opt.errors.SolverError` is raised (never papered over).
:func:`finish` turns the outcome into an honest :class:`~chkpt_opt.solvers.base.SolveResult`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, SolveStatus, result_from_profile
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.interval.model import IntervalModel
from chkpt_opt.solvers.interval.prepare import Prepared


@dataclass(frozen=True)
class Outcome:
    """What an integer program solver reports, before the simulator judges it.

    Attributes:
        chosen: interval ids of the best solution found, or None when none was found.
        proven_optimal: the solver proved ``chosen`` optimal for the program.
        proven_infeasible: the solver proved that no solution fits the budget.
        bound_units: proven lower bound on the program's objective (cost units), or None.
        stats: solver-specific numbers.
    """

    chosen: list[int] | None
    proven_optimal: bool
    proven_infeasible: bool
    bound_units: float | None
    stats: Mapping[str, Any] = field(default_factory=dict)


def judged(
    graph: CostGraph, model: IntervalModel, chosen: list[int]
) -> tuple[Schedule, MemoryProfile]:
    """Simulates the chosen intervals and checks the model's prediction.

    Raises:
        SolverError: if the simulator and the interval model disagree on the peak or the
            recompute time (a bug in the model).
    """
    schedule = model.schedule(graph, chosen)
    profile = simulate(graph, schedule)
    check_prediction(
        graph,
        profile,
        peak_bytes=model.peak_bytes(chosen),
        cost_s=model.cost_s(chosen),
        model="the interval model",
        what=f"regions {schedule.spans(graph)}",
    )
    return schedule, profile


def check_prediction(
    graph: CostGraph,
    profile: MemoryProfile,
    *,
    peak_bytes: int,
    cost_s: float,
    model: str,
    what: str,
) -> None:
    """Checks a solver model's predicted peak and recompute time of a schedule (``what``)
    against the simulator's ``profile`` of it: the one place every model is held to the
    op sequence.

    Raises:
        SolverError: if they disagree (a bug in ``model``).
    """
    if peak_bytes != profile.peak_bytes or abs(cost_s - profile.recompute_s) > 1e-9 * max(
        1.0, cost_s
    ):
        raise SolverError(
            f"{model} and the simulator disagree on graph {graph.graph.get('name', '')!r} "
            f"for {what}: predicted peak {peak_bytes} B, recompute {cost_s:.6g} s; simulated "
            f"peak {profile.peak_bytes} B, recompute {profile.recompute_s:.6g} s. This is a "
            "bug in chkpt_opt; please report it."
        )


def record_lowest(
    stats: dict[str, Any],
    schedule: Schedule,
    profile: MemoryProfile,
    *,
    lower_bytes: int | None,
    proven: bool,
) -> tuple[Schedule, MemoryProfile]:
    """Notes in ``stats`` the lowest-peak schedule found for an infeasible budget (its peak,
    whether that peak is proven minimal, and the proven lower bound), and returns the pair
    as :func:`finish` takes it."""
    stats["min_feasible_bytes"] = profile.peak_bytes
    stats["min_feasible_proven"] = proven
    stats["min_feasible_lower_bytes"] = lower_bytes
    return schedule, profile


def finish(
    graph: CostGraph,
    budget_bytes: int,
    prepared: Prepared,
    outcome: Outcome,
    *,
    solver: str,
    deadline: Deadline,
    fallback: SolveResult,
    lowest: tuple[Schedule, MemoryProfile] | None = None,
) -> SolveResult:
    """Turns a solver's outcome into an honest :class:`SolveResult`.

    Args:
        graph: the cost graph.
        budget_bytes: the budget.
        prepared: the model and program solved.
        outcome: what the solver reported.
        solver: the solver's name.
        deadline: the solve's deadline (its start times the result).
        fallback: the heuristic result (returned when it beats the solver's, e.g. on a
            time-out). When the model left out intervals by cost (``max_cost_s``), the
            solver's bound and proof hold for the whole schedule model only if ``fallback``
            fits and costs at most ``max_cost_s`` (then the optimum is in the model).
        lowest: the lowest-peak schedule found by a search, returned when the budget is
            infeasible (``fallback``'s where that peaks lower: a search the time limit cut).
    """
    model, program = prepared.model, prepared.program
    exact = model.complete and (
        model.max_cost_s is None or (fallback.feasible and fallback.objective <= model.max_cost_s)
    )
    stats: dict[str, Any] = {
        "candidate_positions": len(model.positions),
        "complete_model": model.complete,
        "intervals": len(model.intervals),
        "lifetimes": len(model.lifetimes),
        "memory_rows": len(program.memory_rows),
        "build_s": prepared.build_s,
        **outcome.stats,
    }
    if model.max_cost_s is not None:
        stats["max_interval_cost_s"] = model.max_cost_s
    if not exact:
        stats["optimal_in_candidate_subset"] = outcome.proven_optimal
    bound = None
    if exact and outcome.bound_units is not None:
        # Costs are rounded to 1/cost_scale s per interval: allow for it so the bound holds.
        slack = 0.5 * model.n_ops / program.cost_scale
        bound = max(0.0, outcome.bound_units / program.cost_scale - slack)
    proven = exact and outcome.proven_optimal
    elapsed = deadline.elapsed_s()
    if outcome.chosen is not None:
        schedule, profile = judged(graph, model, outcome.chosen)
        if (
            fallback.feasible
            and profile.peak_bytes <= budget_bytes
            and fallback.objective < profile.recompute_s
            and not proven
        ):
            schedule, profile = fallback.schedule, simulate(graph, fallback.schedule)
            stats["chosen_from"] = fallback.solver
        if proven:
            bound = profile.recompute_s
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=solver,
            solve_s=deadline.elapsed_s(),
            bound=bound,
            proven_optimal=proven,
            stats=stats,
        )
    if outcome.proven_infeasible or not fallback.feasible:
        if lowest is None or (not fallback.feasible and fallback.peak_bytes < lowest[1].peak_bytes):
            # No lowest-peak search, or one cut short by the time limit above the fallback.
            schedule, profile = fallback.schedule, simulate(graph, fallback.schedule)
            if lowest is not None:
                stats.update(min_feasible_bytes=profile.peak_bytes, chosen_from=fallback.solver)
        else:
            schedule, profile = lowest
        result = result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=solver,
            solve_s=elapsed,
            # The lowest peak was searched for over the whole schedule model.
            proven_infeasible=lowest is not None and model.complete,
            stats=stats,
        )
        if result.feasible:  # the heuristic's lowest-peak schedule fits after all
            return result
        if not (outcome.proven_infeasible and exact):
            return dataclasses.replace(
                result, status=SolveStatus.TIMED_OUT, proves_infeasible=False
            )
        return result
    stats["chosen_from"] = fallback.solver
    return result_from_profile(
        fallback.schedule,
        simulate(graph, fallback.schedule),
        budget_bytes=budget_bytes,
        solver=solver,
        solve_s=deadline.elapsed_s(),
        bound=bound,
        stats=stats,
    )
