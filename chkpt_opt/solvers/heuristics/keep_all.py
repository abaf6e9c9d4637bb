"""The baseline: keep every activation, recompute nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.schedule import Schedule
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers.base import SolveResult, result_from_profile
from chkpt_opt.solvers.registry import register


@register("keep_all", "store every activation, recompute nothing (the baseline)")
@dataclass(frozen=True)
class KeepAll:
    """Stores everything. Optimal (zero extra compute) whenever it fits."""

    name: str = "keep_all"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        schedule = Schedule()
        profile = simulate(graph, schedule)
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            bound=0.0,
        )
