"""What the solvers over the interval model share: the candidate cut positions, the warm start
from the greedy heuristic, and an honest result judged by the simulator.

Every schedule an integer program returns is simulated; its simulated peak and recompute
time must equal what the interval model predicts, else the model has a bug and
:class:`~chkpt_opt.errors.SolverError` is raised (never papered over).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chkpt_opt.errors import ScheduleError, SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.schedule import Schedule, cut_positions
from chkpt_opt.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, SolveStatus, result_from_profile
from chkpt_opt.solvers.greedy import GreedySolver
from chkpt_opt.solvers.interval_model import IntervalModel, build_interval_model
from chkpt_opt.solvers.interval_program import IntervalProgram, build_program
from chkpt_opt.solvers.segments import candidate_cuts

log = logging.getLogger(__name__)

DEFAULT_MAX_POSITIONS = 96
"""Graphs with more allowed cut positions than this are solved over every cut after exact
pruning (:mod:`chkpt_opt.solvers.pruning`; ``cpsat`` and ``milp`` with ``prune=True``, the
default), or over a candidate subset of cuts (``lp_round``, and ``prune=False``)."""


def candidate_positions(graph: CostGraph, *, max_positions: int | None) -> list[int] | None:
    """The cut positions regions may start and stop at.

    Returns None (every allowed cut: the exact model) when the graph has at most
    ``max_positions`` interior allowed cuts or ``max_positions`` is None; otherwise the
    low-crossing cuts of :func:`~chkpt_opt.solvers.segments.candidate_cuts`, thinned evenly
    to ``max_positions`` (the model is then exact only over schedules with boundaries there).
    """
    ok = cut_positions(graph)
    n = len(ok) - 1
    interior = [p for p in range(1, n) if ok[p]]
    if max_positions is None or len(interior) <= max_positions:
        return None
    chosen = candidate_cuts(graph)
    if len(chosen) > max_positions:
        step = len(chosen) / max_positions
        chosen = sorted({chosen[int(k * step)] for k in range(max_positions)})
    return [0, *chosen, n]


@dataclass(frozen=True)
class Prepared:
    """An interval model with its integer program.

    Attributes:
        model: the interval model.
        program: its integer program.
        build_s: seconds spent building both.
    """

    model: IntervalModel
    program: IntervalProgram
    build_s: float


MAX_FLAT_OPS = 800
"""Largest graph the flat model is built for: its size grows with ops x candidate intervals;
over every cut the 586-op gpt_large has 515 cut positions, up to 132,000 intervals; a
1,162-op decoder exhausted 24 GiB. Larger graphs go to the hierarchical solver (``auto``
does this)."""


def check_flat_size(graph: CostGraph) -> None:
    """Refuses graphs of more than :data:`MAX_FLAT_OPS` ops (SolverError, naming the fix)."""
    if graph.number_of_nodes() > MAX_FLAT_OPS:
        raise SolverError(
            f"graph {graph.graph.get('name', '')!r} has {graph.number_of_nodes()} ops; the flat "
            f"integer program is built for at most {MAX_FLAT_OPS}. Use solver='hierarchical' "
            "(repeated blocks) or 'auto', which picks it."
        )


def prepare(
    graph: CostGraph, *, max_positions: int | None = DEFAULT_MAX_POSITIONS, tight: bool = True
) -> Prepared:
    """Builds the interval model and program of ``graph`` (see :func:`candidate_positions`).

    Raises:
        SolverError: for graphs of more than :data:`MAX_FLAT_OPS` ops.
    """
    check_flat_size(graph)
    start = time.perf_counter()
    positions = candidate_positions(graph, max_positions=max_positions)
    model = build_interval_model(graph, positions=positions)
    program = build_program(model, tight=tight)
    return Prepared(model, program, time.perf_counter() - start)


def keep_all_result(
    graph: CostGraph, budget_bytes: int, *, solver: str, start: float
) -> SolveResult | None:
    """The keep-all schedule when it fits (optimal: it recomputes nothing), else None."""
    profile = simulate(graph, Schedule())
    if profile.peak_bytes > budget_bytes:
        return None
    return result_from_profile(
        Schedule(),
        profile,
        budget_bytes=budget_bytes,
        solver=solver,
        solve_s=time.perf_counter() - start,
        bound=0.0,
        proven_optimal=True,
        stats={"trivial": "keep_all fits"},
    )


def warm_start(
    graph: CostGraph, budget_bytes: int, model: IntervalModel, *, time_limit_s: float | None
) -> tuple[SolveResult, list[int] | None]:
    """The greedy heuristic's result, and its regions as interval ids when the model has them."""
    result = GreedySolver()(graph, budget_bytes, time_limit_s=time_limit_s)
    try:
        return result, model.interval_ids(result.schedule.spans(graph))
    except ScheduleError:
        return result, None


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
    predicted = model.peak_bytes(chosen)
    cost = model.cost_s(chosen)
    if predicted != profile.peak_bytes or abs(cost - profile.recompute_s) > 1e-9 * max(1.0, cost):
        raise SolverError(
            f"interval model and simulator disagree on graph {graph.graph.get('name', '')!r} "
            f"for regions {schedule.spans(graph)}: model peak {predicted} B, recompute "
            f"{cost:.6g} s; simulator peak {profile.peak_bytes} B, recompute "
            f"{profile.recompute_s:.6g} s. This is a bug in chkpt_opt; please report it."
        )
    return schedule, profile


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
    start: float,
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
        start: ``time.perf_counter()`` when the solve began.
        fallback: the heuristic result (returned when it beats the solver's, e.g. on a
            time-out). When the model left out intervals by cost (``max_cost_s``), the
            solver's bound and proof hold for the whole schedule model only if ``fallback``
            fits and costs at most ``max_cost_s`` (then the optimum is in the model).
        lowest: the lowest-peak schedule known, returned when the budget is infeasible.
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
    elapsed = time.perf_counter() - start
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
            solve_s=time.perf_counter() - start,
            bound=bound,
            proven_optimal=proven,
            stats=stats,
        )
    if outcome.proven_infeasible or not fallback.feasible:
        schedule = lowest[0] if lowest is not None else fallback.schedule
        profile = lowest[1] if lowest is not None else simulate(graph, fallback.schedule)
        result = result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=solver,
            solve_s=elapsed,
            stats=stats,
        )
        if result.feasible:  # the heuristic's lowest-peak schedule fits after all
            return result
        if not (outcome.proven_infeasible and exact):
            return dataclasses.replace(result, status=SolveStatus.TIMED_OUT)
        return result
    stats["chosen_from"] = fallback.solver
    return result_from_profile(
        fallback.schedule,
        simulate(graph, fallback.schedule),
        budget_bytes=budget_bytes,
        solver=solver,
        solve_s=time.perf_counter() - start,
        bound=bound,
        stats=stats,
    )


def remaining_s(time_limit_s: float | None, start: float) -> float | None:
    """Seconds left of ``time_limit_s`` since ``start`` (``perf_counter``); None: no limit."""
    if time_limit_s is None:
        return None
    return max(0.0, time_limit_s - (time.perf_counter() - start))
