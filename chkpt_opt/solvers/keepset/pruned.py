"""``solver="pruned"``: the every-cut interval program after exact cost and reduced-cost
pruning, from an incumbent (:mod:`chkpt_opt.solvers.keepset.pruned_search`). Proven optimal for the
whole schedule model when the solve finishes; out of time, the incumbent without a bound."""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.keepset.pruned_search import PrunedSearch
from chkpt_opt.solvers.registry import register


@register("pruned", "MILP over every cut after exact cost and reduced-cost pruning")
@dataclass(frozen=True)
class PrunedSolver(PrunedSearch):
    """Exact solver for mid-size graphs; its settings are
    :class:`~chkpt_opt.solvers.keepset.pruned_search.PrunedSearch`'s."""

    name: str = "pruned"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        return self.search(
            graph, budget_bytes, deadline=Deadline.after(time_limit_s), solver=self.name
        )
