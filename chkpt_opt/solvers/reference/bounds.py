"""The smallest budget any schedule meets, and the most memory checkpointing can save.

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> g = chain_graph(6, activation_bytes=1000)
    >>> low = min_feasible_budget(g)
    >>> low.proven, low.peak_bytes <= max_saving(g) + low.peak_bytes
    (True, True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.schedule import Schedule
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.lowest_peak import lowest_peak
from chkpt_opt.solvers.prepare import prepare


@dataclass(frozen=True)
class FeasibleBudget:
    """The smallest peak found over the schedules of the model.

    Attributes:
        peak_bytes: the peak of ``schedule`` (forward and backward, no resident memory).
        proven: ``peak_bytes`` is proven to be the smallest peak of any valid schedule.
        lower_bound_bytes: a proven lower bound on the peak of any valid schedule
            (``== peak_bytes`` when proven).
        schedule: a schedule reaching ``peak_bytes``, the cheapest one found among those.
        solve_s: wall-clock seconds spent.
    """

    peak_bytes: int
    proven: bool
    lower_bound_bytes: int
    schedule: Schedule
    solve_s: float


def min_feasible_budget(
    graph: CostGraph, *, time_limit_s: float | None = None, max_positions: int | None = None
) -> FeasibleBudget:
    """The smallest activation budget any keep-set schedule of ``graph`` fits in.

    Exact (``proven``) when CP-SAT proves it within ``time_limit_s`` over every allowed cut
    position; with ``max_positions`` set and exceeded, the search covers only a candidate
    subset of cuts and the result is an upper bound (never ``proven``).
    """
    start = time.perf_counter()
    prepared = prepare(graph, max_positions=max_positions)
    schedule, profile, lower, proven = lowest_peak(
        graph, prepared, deadline=Deadline.after(time_limit_s)
    )
    return FeasibleBudget(
        peak_bytes=profile.peak_bytes,
        proven=proven,
        lower_bound_bytes=profile.peak_bytes if proven else min(lower, profile.peak_bytes),
        schedule=schedule,
        solve_s=time.perf_counter() - start,
    )


def max_saving(
    graph: CostGraph, *, time_limit_s: float | None = None, max_positions: int | None = None
) -> int:
    """Keep-all peak minus the minimum feasible budget: the most any schedule saves.

    Exact when :func:`min_feasible_budget` is proven for the same arguments; otherwise a
    lower bound on the true saving (the saving of the best schedule found).
    """
    low = min_feasible_budget(graph, time_limit_s=time_limit_s, max_positions=max_positions)
    return simulate(graph, Schedule()).peak_bytes - low.peak_bytes
