"""The baseline: keep every activation, recompute nothing (:func:`~chkpt_opt.solvers.base.keep_all`,
also the shortcut every exact solver takes first)."""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult, keep_all
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.registry import register


@register("keep_all", "store every activation, recompute nothing (the baseline)")
@dataclass(frozen=True)
class KeepAll:
    """Stores everything. Optimal (zero extra compute) whenever it fits."""

    name: str = "keep_all"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        return keep_all(graph, budget_bytes, solver=self.name, deadline=Deadline.after(None))
