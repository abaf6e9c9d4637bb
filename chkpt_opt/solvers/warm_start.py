"""Warm starts: the greedy heuristic's schedule, as a fallback result and as interval ids an
engine can take as a hint."""

from __future__ import annotations

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult
from chkpt_opt.solvers.greedy import GreedySolver
from chkpt_opt.solvers.interval_model import IntervalModel


def warm_start(
    graph: CostGraph, budget_bytes: int, model: IntervalModel, *, time_limit_s: float | None
) -> tuple[SolveResult, list[int] | None]:
    """The greedy heuristic's result, and its regions as interval ids when the model has them."""
    result = GreedySolver()(graph, budget_bytes, time_limit_s=time_limit_s)
    return result, hint_ids(graph, model, result)


def hint_ids(graph: CostGraph, model: IntervalModel, result: SolveResult) -> list[int] | None:
    """The regions of ``result`` as interval ids of ``model``, or None when it lacks one."""
    try:
        return model.interval_ids(result.schedule.spans(graph))
    except ScheduleError:
        return None
