"""Warm starts: the greedy sweep's schedule, as a fallback result and as interval ids an
engine can take as a hint; and the incumbent of the pruned search (the best of the greedy
sweep, the rounded recompute bound and, on graphs of repeated blocks, the block search).
These are heuristics under the solvers, not registered solvers: only ``auto`` composes
solvers."""

from __future__ import annotations

import logging

from chkpt_opt.errors import ScheduleError, SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult, best_of
from chkpt_opt.solvers.blocks.repeated import find_blocks
from chkpt_opt.solvers.blocks.search import BlockSearch
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.heuristics.greedy_sweep import greedy_sweep
from chkpt_opt.solvers.interval.model import IntervalModel
from chkpt_opt.solvers.keepset.bound_rounding import bound_rounding

log = logging.getLogger(__name__)


def warm_start(
    graph: CostGraph, budget_bytes: int, model: IntervalModel, *, time_limit_s: float | None
) -> tuple[SolveResult, list[int] | None]:
    """The greedy sweep's result, and its regions as interval ids when the model has them."""
    result = greedy_sweep(graph, budget_bytes, time_limit_s=time_limit_s)
    return result, hint_ids(graph, model, result)


def hint_ids(graph: CostGraph, model: IntervalModel, result: SolveResult) -> list[int] | None:
    """The regions of ``result`` as interval ids of ``model``, or None when it lacks one."""
    try:
        return model.interval_ids(result.schedule.spans(graph))
    except ScheduleError:
        return None


def incumbent(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None) -> SolveResult:
    """The best of the greedy sweep, the schedule rounded from the recompute bound's LP
    and, on graphs of repeated blocks, the block search, all within ``time_limit_s``
    together (in that order, each with the time the others left); the result names the
    one it came from (``greedy``, ``bound_rounding`` or ``hierarchical``)."""
    deadline = Deadline.after(time_limit_s)
    results = [greedy_sweep(graph, budget_bytes, time_limit_s=deadline.remaining_s())]
    results.append(bound_rounding(graph, budget_bytes, deadline=deadline))
    if find_blocks(graph) is not None and not deadline.expired():
        try:
            results.append(
                BlockSearch().search(
                    graph,
                    budget_bytes,
                    deadline=Deadline.after(deadline.remaining_s()),
                    solver="hierarchical",
                )
            )
        except SolverError as err:
            log.info("block-search incumbent refused: %s", err)
    return best_of(results)
