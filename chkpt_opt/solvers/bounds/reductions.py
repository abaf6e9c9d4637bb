"""Exact reductions of the every-cut interval program (what the ``pruned`` solver uses).

1. **Cost** (:func:`cost_cap`): with an incumbent of cost ``UB`` that fits the budget, every
   interval costing more than ``UB`` is left out before the model is built
   (``build_interval_model(max_cost_s=...)``).
2. **Reduced costs** (:func:`reduced_cost_fixing`, :func:`restrict`): with the LP
   relaxation's optimum ``LP`` and the reduced cost ``r_k`` of an interval at zero, every
   solution that chooses it costs at least ``LP + r_k``; when that exceeds ``UB`` (by a
   margin over the LP solver's tolerances) the interval is dropped.

Neither drops a schedule costing at most ``UB``; :mod:`chkpt_opt.solvers.keepset.pruned` says why
that keeps the optimum.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, DeadlineExceeded
from chkpt_opt.solvers.engines.lp_engine import INFEASIBLE, OPTIMAL, LpRelaxation, lp_bound_s
from chkpt_opt.solvers.interval.model import Holder, IntervalModel, Lifetime
from chkpt_opt.solvers.interval.program import IntervalProgram

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
    what :func:`~chkpt_opt.solvers.interval.builder.build_interval_model` would build from
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
    deadline: Deadline = NO_DEADLINE,
) -> LpFixing:
    """Solves the LP relaxation and keeps the intervals its reduced costs cannot rule out.

    Args:
        program: the interval program.
        budget_bytes: the budget.
        upper_s: the cost of a schedule the program holds that fits (the incumbent).
        protect: interval ids always kept (the incumbent's).
        deadline: the limit of building and solving the LP together.

    Returns:
        The LP's bound and the kept intervals (all of them when the LP is not solved or
        out of time).
    """
    start = time.perf_counter()
    model = program.model
    every = tuple(range(len(model.intervals)))
    try:
        lp = LpRelaxation.build(program, budget_bytes, deadline=deadline)
    except DeadlineExceeded:
        return LpFixing("BUILD_TIMED_OUT", None, every, time.perf_counter() - start)
    lp.limit_time(deadline)
    status = lp.solve()
    name = {OPTIMAL: "OPTIMAL", INFEASIBLE: "INFEASIBLE"}.get(status, str(status))
    if status != OPTIMAL:
        return LpFixing(name, None, every, time.perf_counter() - start)
    scale = program.float_scale
    lp_units = lp.objective_units()
    threshold = upper_s * scale * (1 + RC_MARGIN) + RC_MARGIN
    protected = set(protect)
    keep = tuple(
        k
        for k, (value, reduced) in enumerate(zip(lp.x(), lp.reduced_costs()))
        if k in protected or value > 1e-9 or not lp_units + reduced > threshold
    )
    bound = lp_bound_s(lp_units / scale, model)
    return LpFixing(name, bound, keep, time.perf_counter() - start)
