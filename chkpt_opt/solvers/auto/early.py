"""``auto``'s early return (:func:`early_result`): a rounded schedule that closes the gap.

The roundings of the recompute bound's LP run right after the bound (on eager plans the
staged rounding, :mod:`~chkpt_opt.solvers.staged.rounding`, then the cached-op rounding
unless the staged one returned already). Where the better of them fits and its cost is
within ``auto``'s ``gap`` of the recompute bound, which holds over every schedule, nothing
the later stages find can be cheaper by more than the gap: ``auto`` returns it at once,
``optimal`` where it meets the bound, else ``feasible`` with that bound
(``stats["stopped_at_gap"]``), the keep-set stages not run (``stats["proofs_over"]`` is
``"every_schedule"``: the bound's space). Only on graphs of more than :data:`EARLY_MIN_OPS`
ops: on smaller ones the exact stages answer within seconds, and their proofs (over
keep-set schedules, and the staged program's over every schedule) say more.

:func:`proven_infeasible` is ``auto``'s result where the bound's floor, which holds over
every schedule, is above the budget: no search can find a schedule that fits, so ``auto``
returns at once (``infeasible`` with ``proves_infeasible``; the keep-all schedule, not the
lowest peak: ``smallest_peak`` searches that), where it would otherwise spend its whole
limit looking (``chkpt-opt max-batch`` at batches whose floor is above the budget). Only on
graphs of more than :data:`EARLY_MIN_OPS` ops, where budgets above 0 bytes ask: on smaller
ones the searches report the lowest peak within seconds.
"""

from __future__ import annotations

import dataclasses

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import (
    SolveResult,
    SolveStatus,
    best_of,
    closes_gap,
    keep_all,
    meets_bound,
)
from chkpt_opt.solvers.bounds.recompute_bound import RecomputeBound
from chkpt_opt.solvers.deadline import Deadline

EARLY_MIN_OPS = 80
"""Graphs of at most this many ops run every stage (the staged program's size in ``auto``,
:data:`~chkpt_opt.solvers.auto.beyond.STAGED_MAX_OPS`)."""


def early_result(
    graph_ops: int,
    found: list[SolveResult],
    cover: RecomputeBound,
    deadline: Deadline,
    gap: float,
    name: str,
) -> SolveResult | None:
    """The best of ``found`` as ``auto``'s result where it fits within ``gap`` of ``cover``'s
    bound on a graph of ``graph_ops`` ops (see the module docstring); None otherwise."""
    if not found or graph_ops <= EARLY_MIN_OPS:
        return None
    best = best_of(found)
    bound_s = cover.bound_s
    if not best.feasible or not closes_gap(best.objective, bound_s, gap):
        return None
    assert bound_s is not None  # closes_gap holds only with a bound
    optimal = meets_bound(best.objective, bound_s)
    stats = dict(
        best.stats,
        chosen=best.solver,
        tried={r.solver: r.status.value for r in found},
        recompute_bound=cover.summary(),
        proofs_over="every_schedule",
    )
    if not optimal:
        rel = (best.objective - bound_s) / best.objective
        stats["stopped_at_gap"] = {"bound_s": bound_s, "gap": rel, "over": "every_schedule"}
    return dataclasses.replace(
        best,
        status=SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE,
        bound=bound_s,
        solver=name,
        solve_s=deadline.elapsed_s(),
        stats=stats,
    )


def proven_infeasible(
    graph: CostGraph, budget_bytes: int, cover: RecomputeBound, deadline: Deadline, name: str
) -> SolveResult:
    """``auto``'s result where ``cover`` proves that no schedule fits ``budget_bytes``: the
    keep-all schedule, ``infeasible`` with ``proves_infeasible``, the floor in
    ``stats["min_feasible_lower_bytes"]`` (the smallest budget any schedule could meet is
    at least that; ``smallest_peak`` searches the lowest peak itself)."""
    assert cover.proves_infeasible
    result = keep_all(
        graph,
        budget_bytes,
        solver=name,
        deadline=deadline,
        stats={
            "stopped_at": "proven_infeasible",
            "recompute_bound": cover.summary(),
            "proofs_over": "every_schedule",
            "min_feasible_proven": False,
            "min_feasible_lower_bytes": cover.floor_bytes,
        },
    )
    assert result.status == SolveStatus.INFEASIBLE  # its peak is at least the floor
    return dataclasses.replace(result, proves_infeasible=True, solve_s=deadline.elapsed_s())
