"""``solver="milp"``: the interval program as a MILP, solved by a backend bundled with
OR-Tools (:mod:`~chkpt_opt.solvers.engines.milp_engine`: HiGHS by default, or SCIP); exact,
with a proven bound. The greedy schedule is the warm start where the backend takes hints.
"""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.engines.milp_engine import DEFAULT_BACKEND, check_backend, milp_engine
from chkpt_opt.solvers.interval.prepare import DEFAULT_MAX_POSITIONS
from chkpt_opt.solvers.keepset.flat import solve_flat
from chkpt_opt.solvers.keepset.pruned_search import PrunedSearch
from chkpt_opt.solvers.registry import register


@register("milp", "MILP over the interval model (HiGHS or SCIP): optimal schedule, proven bound")
@dataclass(frozen=True)
class MilpSolver:
    """Exact solver: the interval program as a MILP.

    Attributes:
        backend: ``"highs"`` (default, faster here) or ``"scip"``.
        seed: backend random seed (SCIP).
        max_positions: see :class:`~chkpt_opt.solvers.keepset.cpsat.CpSatSolver`.
        warm_start: hint the greedy schedule (where the backend takes hints).
        prune: on graphs with more than ``max_positions`` allowed cuts, solve over every cut
            after exact pruning (:class:`~chkpt_opt.solvers.keepset.pruned_search.PrunedSearch` with
            this backend and these settings) instead of over a subset of cuts. Measured on the
            corpus graphs of 184-298 ops: proven optimal in 60 s at budgets 0.9-0.3, where
            the subset gave no bound.
    """

    backend: str = DEFAULT_BACKEND
    seed: int = 0
    max_positions: int | None = DEFAULT_MAX_POSITIONS
    warm_start: bool = True
    prune: bool = True
    name: str = "milp"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        deadline = Deadline.after(time_limit_s)
        check_backend(self.backend)
        pruned = PrunedSearch(backend=self.backend, seed=self.seed, warm_start=self.warm_start)
        return solve_flat(
            self.name,
            graph,
            budget_bytes,
            deadline=deadline,
            engine=milp_engine(self.backend, self.seed),
            max_positions=self.max_positions,
            pruned=pruned if self.prune else None,
            warm_start_hint=self.warm_start,
            lowest_settings={"seed": self.seed},
        )
