"""Solvers: each a value found by name in the registry. No torch here.

One subpackage per family of schedule space, each saying what it searches and proves:
``interval`` (the keep-set interval model and its program), ``heuristics``, ``engines``,
``bounds``, ``chain`` (``dp_chain``), ``blocks`` (``hierarchical``), ``keepset`` (the exact
keep-set programs), ``nested``, ``cached``; the shared plumbing here, and ``auto``, the only
composer (docs/architecture.md draws the layers).

Units: a solver takes and reports activation bytes (what the forward and backward passes
create, ``simulate(graph, schedule).peak_bytes``); ``chkpt_opt.solve`` takes a whole-step
budget and reports both.
"""

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import Solver, SolveResult, SolveStatus
from chkpt_opt.solvers.registry import available_solvers, get_solver, register


def smallest_peak(
    graph: CostGraph,
    *,
    time_limit_s: float | None = None,
    general: bool = True,
    nesting: bool = True,
) -> SolveResult:
    """The lowest-peak schedule the registered solvers find: ``auto`` asked for a budget of
    0 bytes.

    Its ``peak_bytes`` is the smallest activation budget they meet, among keep-set
    schedules unless ``general`` (then cached ops and, with ``nesting``, nested regions go
    lower). For a keep-set result,
    ``stats["min_feasible_proven"]`` says whether no keep-set schedule has a lower peak, and
    ``stats["min_feasible_lower_bytes"]`` is a proven lower bound where one is known. A
    schedule beyond keep-set (nested regions) comes with the floor of
    :mod:`chkpt_opt.solvers.bounds.recompute_bound` as its lower bound, which holds over every
    schedule (``min_feasible_proven`` when the peak meets it).
    (``min_feasible_budget`` of the tests' ``tests/reference/bounds.py`` reads the keep-set
    result as a typed value.)
    """
    auto = get_solver("auto", general=general, nesting=nesting)
    return auto(graph, 0, time_limit_s=time_limit_s)


__all__ = [
    "SolveResult",
    "SolveStatus",
    "Solver",
    "available_solvers",
    "get_solver",
    "register",
    "smallest_peak",
]
