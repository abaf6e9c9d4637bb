"""The lowest-peak schedule of a prepared graph, judged by the simulator: what the exact
front-ends return (and record) when no schedule fits the budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.engines.cpsat_engine import DEFAULT_FORMULATION, solve_lowest_peak
from chkpt_opt.solvers.interval.judge import Outcome, judged, record_lowest
from chkpt_opt.solvers.interval.prepare import Prepared


def lowest_peak(
    graph: CostGraph,
    prepared: Prepared,
    *,
    deadline: Deadline = NO_DEADLINE,
    seed: int = 0,
    workers: int = 1,
    formulation: str = DEFAULT_FORMULATION,
) -> tuple[Schedule, MemoryProfile, int, bool]:
    """The lowest-peak schedule of the model, and among those the cheapest (CP-SAT).

    Returns:
        ``(schedule, profile, lower_bound_bytes, proven)``: the best schedule found, its
        simulated profile, a proven lower bound on the peak of every schedule (over the whole
        schedule model only when the model is complete; else the schedule-independent bytes),
        and whether the schedule's peak is proven minimal.
    """
    program = prepared.program
    keep_all = simulate(graph, Schedule())
    found = solve_lowest_peak(
        program,
        upper_bytes=keep_all.peak_bytes,
        deadline=deadline,
        seed=seed,
        workers=workers,
        formulation=formulation,
    )
    if found is None:
        return Schedule(), keep_all, program.fixed_bytes, False
    complete = prepared.model.complete
    proven = found.proven and complete
    lower = found.lower_bytes if complete else 0
    schedule, profile = judged(graph, prepared.model, found.chosen)
    if proven:
        lower = profile.peak_bytes
    return schedule, profile, max(lower, program.fixed_bytes), proven


def with_lowest_peak(
    graph: CostGraph,
    prepared: Prepared,
    outcome: Outcome,
    deadline: Deadline,
    settings: Mapping[str, Any],
) -> tuple[Outcome, tuple[Schedule, MemoryProfile] | None]:
    """Where the engine proved the budget infeasible, the lowest-peak schedule of the
    model (:func:`lowest_peak` with ``settings``), noted in the outcome's stats; else no
    schedule."""
    if not outcome.proven_infeasible:
        return outcome, None
    stats = dict(outcome.stats)
    schedule, profile, lower, proven = lowest_peak(graph, prepared, deadline=deadline, **settings)
    lowest = record_lowest(stats, schedule, profile, lower_bytes=lower, proven=proven)
    return dataclasses.replace(outcome, stats=stats), lowest
