"""Warm starts: the greedy sweep's schedule, as a fallback result and as interval ids an
engine can take as a hint; and the incumbents of the pruned search (the better of the
greedy sweep and the rounded recompute bound; on graphs of repeated blocks, the block search).
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


def quick_incumbent(
    graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None
) -> SolveResult:
    """The better of the greedy sweep and the schedule rounded from the recompute bound's LP
    (each well under a second on graphs of a few hundred ops), within ``time_limit_s``
    together; the result names the one it came from (``greedy`` or ``bound_rounding``)."""
    deadline = Deadline.after(time_limit_s)
    results = [greedy_sweep(graph, budget_bytes, time_limit_s=deadline.remaining_s())]
    results.append(bound_rounding(graph, budget_bytes, deadline=deadline))
    return best_of(results)


def block_incumbent(
    graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None
) -> SolveResult | None:
    """The block search's result (named ``hierarchical``) on graphs of repeated blocks,
    within ``time_limit_s``; None on other graphs, with no time left, or where it refuses
    the graph."""
    if find_blocks(graph) is None or (time_limit_s is not None and time_limit_s <= 0):
        return None
    try:
        return BlockSearch().search(
            graph, budget_bytes, deadline=Deadline.after(time_limit_s), solver="hierarchical"
        )
    except SolverError as err:
        log.info("block-search incumbent refused: %s", err)
        return None
