"""The smallest budget any schedule meets, and the most memory checkpointing can save, as
typed values for the tests: both read :func:`chkpt_opt.solvers.smallest_peak` (the one
implementation, ``auto`` at a budget of 0 bytes).

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> g = chain_graph(6, activation_bytes=1000)
    >>> low = min_feasible_budget(g)
    >>> low.proven, low.peak_bytes <= max_saving(g) + low.peak_bytes
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import smallest_peak


@dataclass(frozen=True)
class FeasibleBudget:
    """The smallest peak found over the schedules of the model.

    Attributes:
        peak_bytes: the peak of ``schedule`` (forward and backward, no resident memory).
        proven: ``peak_bytes`` is proven to be the smallest peak of any valid schedule.
        lower_bound_bytes: a proven lower bound on the peak of any valid schedule
            (``== peak_bytes`` when proven; 0 where none is known).
        schedule: a schedule reaching ``peak_bytes``, the cheapest one found among those.
        solve_s: wall-clock seconds spent.
    """

    peak_bytes: int
    proven: bool
    lower_bound_bytes: int
    schedule: Schedule
    solve_s: float


def min_feasible_budget(graph: CostGraph, *, time_limit_s: float | None = None) -> FeasibleBudget:
    """The smallest activation budget the solvers find a keep-set schedule of ``graph`` for
    (:func:`~chkpt_opt.solvers.smallest_peak`); ``proven`` when it is the smallest of any
    schedule (exact solvers within ``time_limit_s``)."""
    result = smallest_peak(graph, time_limit_s=time_limit_s, general=False)
    proven = bool(result.stats.get("min_feasible_proven"))
    lower = result.stats.get("min_feasible_lower_bytes")
    return FeasibleBudget(
        peak_bytes=result.peak_bytes,
        proven=proven,
        lower_bound_bytes=result.peak_bytes if proven else min(lower or 0, result.peak_bytes),
        schedule=result.schedule,
        solve_s=result.solve_s,
    )


def max_saving(graph: CostGraph, *, time_limit_s: float | None = None) -> int:
    """Keep-all peak minus the minimum feasible budget: the most any schedule saves.

    Exact when :func:`min_feasible_budget` is proven for the same arguments; otherwise a
    lower bound on the true saving (the saving of the best schedule found).
    """
    low = min_feasible_budget(graph, time_limit_s=time_limit_s)
    return simulate(graph, Schedule()).peak_bytes - low.peak_bytes
