"""``solver="cpsat"``: exact keep-set schedules with a proven bound, by CP-SAT over the
interval program (:mod:`~chkpt_opt.solvers.engines.cpsat_engine`), warm-started (a hint)
from the greedy schedule. With the default single worker the search is deterministic for a
fixed ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.engines.cpsat_engine import DEFAULT_FORMULATION, solve_cp
from chkpt_opt.solvers.interval.judge import Outcome
from chkpt_opt.solvers.interval.prepare import DEFAULT_MAX_POSITIONS
from chkpt_opt.solvers.interval.program import IntervalProgram
from chkpt_opt.solvers.keepset.flat import solve_flat
from chkpt_opt.solvers.keepset.pruned_search import PrunedSearch
from chkpt_opt.solvers.registry import register


@register("cpsat", "CP-SAT over the interval model: optimal keep-set schedule, proven bound")
@dataclass(frozen=True)
class CpSatSolver:
    """Exact solver: CP-SAT on the interval program, warm-started from greedy.

    Attributes:
        formulation: ``"linear"`` (time-indexed rows) or ``"cumulative"`` (Moccasin-style).
        workers: CP-SAT search workers (1 by default: deterministic; with more, the search
            is interleaved, which keeps it deterministic).
        seed: CP-SAT random seed.
        max_positions: above this many allowed cut positions, regions are restricted to a
            candidate subset of cuts (then the result is optimal only over that subset and
            the status is never ``optimal``); None: always every cut.
        warm_start: hint the greedy schedule.
        prune: on graphs with more than ``max_positions`` allowed cuts, solve over every cut
            after exact pruning (:class:`~chkpt_opt.solvers.keepset.pruned_search.PrunedSearch` with
            CP-SAT as its engine and these settings) instead of over a subset of cuts.
    """

    formulation: str = DEFAULT_FORMULATION
    workers: int = 1
    seed: int = 0
    max_positions: int | None = DEFAULT_MAX_POSITIONS
    warm_start: bool = True
    prune: bool = True
    name: str = "cpsat"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        settings = {"seed": self.seed, "workers": self.workers, "formulation": self.formulation}
        pruned = PrunedSearch(backend="cpsat", warm_start=self.warm_start, **settings)
        return solve_flat(
            self.name,
            graph,
            budget_bytes,
            deadline=Deadline.after(time_limit_s),
            engine=self._engine,
            max_positions=self.max_positions,
            pruned=pruned if self.prune else None,
            warm_start_hint=self.warm_start,
            lowest_settings=settings,
        )

    def _engine(
        self,
        program: IntervalProgram,
        budget_bytes: int,
        hint_ids: list[int] | None,
        deadline: Deadline,
    ) -> Outcome:
        return solve_cp(
            program,
            budget_bytes,
            formulation=self.formulation,
            seed=self.seed,
            workers=self.workers,
            hint_ids=hint_ids,
            deadline=deadline,
        )
