"""Warm starts: the greedy sweep's schedule, as a fallback result and as interval ids an
engine can take as a hint; and the incumbent of the pruned search (the better of the greedy
sweep and, on graphs of repeated blocks, the block search). These are heuristics under the
solvers, not registered solvers: only ``auto`` composes solvers."""

from __future__ import annotations

import logging

from chkpt_opt.errors import ScheduleError, SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult, best_of
from chkpt_opt.solvers.block_search import BlockSearch
from chkpt_opt.solvers.blocks import find_blocks
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.greedy_sweep import greedy_sweep
from chkpt_opt.solvers.interval_model import IntervalModel

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
    """The best of the greedy sweep and, on graphs of repeated blocks, the block search (each
    given ``time_limit_s``); the result names the one it came from (``greedy`` or
    ``hierarchical``)."""
    results = [greedy_sweep(graph, budget_bytes, time_limit_s=time_limit_s)]
    if find_blocks(graph) is not None:
        try:
            results.append(
                BlockSearch().search(
                    graph,
                    budget_bytes,
                    deadline=Deadline.after(time_limit_s),
                    solver="hierarchical",
                )
            )
        except SolverError as err:
            log.info("block-search incumbent refused: %s", err)
    return best_of(results)
