"""The recompute bound's program in integers: a tighter lower bound over every schedule.

The variables of :mod:`~chkpt_opt.solvers.bounds.recompute_bound`'s LP (an op recomputed
after a step, a storage alive at it) are yes or no in every schedule, so the same program
with every variable 0 or 1 is a relaxation of every schedule too, and its optimum a bound
at least as high as the LP's over the same rows. :func:`integer_cover_bound` solves it in
SCIP with the LP's cutting planes (the rows the integer solution violates added until none
is); where the deadline cuts a solve short, SCIP's proven bound of that solve is returned
(a bound over the rows added so far, so over every schedule). Tolerances are taken off as
for the LP.

Measured (``benchmarks/results/bound_looseness/``, the Hugging Face families of
``benchmarks/hf_gaps.py`` at the layers' peak and halfway to the floor): 0.0-3.7% above the
LP, in 0.7-19 s (113 s for Mixtral halfway); on ViT at its layers' peak it meets the staged
plan's recompute, 65.23 ms: that plan is optimal over every schedule the lowering executes.
"""

from __future__ import annotations

import dataclasses

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.bounds.recompute_bound import (
    RecomputeBound,
    _CoverLp,
    cutting_planes,
    keep_all_rows,
)
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, DeadlineExceeded


def integer_cover_bound(
    graph: CostGraph,
    budget_bytes: int,
    *,
    deadline: Deadline = NO_DEADLINE,
    steps_per_round: int = 8,
) -> float | None:
    """A proven lower bound, in seconds, on the extra compute of every schedule of ``graph``
    that peaks at most ``budget_bytes`` (activation bytes, as the simulator counts them):
    the recompute bound's program in integers (module docstring). 0.0 where keep-all fits;
    None where the budget is below the floor (nothing fits: see
    :func:`~chkpt_opt.solvers.bounds.recompute_bound.recompute_bound`) or the deadline
    passed before a first bound."""
    try:
        rows = keep_all_rows(graph, deadline)
    except DeadlineExceeded:
        return None
    if budget_bytes < rows.floor_bytes:
        return None
    over = [r for r in rows.rows if r.during_bytes > budget_bytes]
    if not over:
        return 0.0
    program = _CoverLp(rows, budget_bytes, integer=True)
    return cutting_planes(program, over, deadline, steps_per_round)[0]


def with_integer_bound(
    graph: CostGraph, budget_bytes: int, cover: RecomputeBound, deadline: Deadline
) -> RecomputeBound:
    """``cover`` (the recompute bound at ``budget_bytes``) with the integer bound beside it
    and its ``bound_s`` raised to it where higher; ``cover`` itself where it has no bound
    or nothing was found within ``deadline``."""
    if cover.bound_s is None or cover.proves_infeasible or cover.bound_s == 0.0:
        return cover
    found = integer_cover_bound(graph, budget_bytes, deadline=deadline)
    if found is None:
        return cover
    return dataclasses.replace(cover, bound_s=max(cover.bound_s, found), integer_bound_s=found)
