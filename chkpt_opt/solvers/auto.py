"""``solver="auto"``: the best schedule the available solvers find within the time limit."""

from __future__ import annotations

import time
from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult, SolveStatus
from chkpt_opt.solvers.registry import get_solver, register


def best_result(results: list[SolveResult]) -> SolveResult:
    """The cheapest feasible result, else the lowest-peak one."""
    feasible = [r for r in results if r.feasible]
    if feasible:
        return min(feasible, key=lambda r: (r.objective, r.peak_bytes))
    return min(results, key=lambda r: (r.peak_bytes, r.objective))


@register("auto", "keep everything if it fits, else the best of the available solvers")
@dataclass(frozen=True)
class AutoSolver:
    """Tries the solvers in order and keeps the best result, with an honest status."""

    solvers: tuple[str, ...] = ("keep_all", "greedy", "sqrt")
    name: str = "auto"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        results: list[SolveResult] = []
        for name in self.solvers:
            remaining = (
                None
                if time_limit_s is None
                else max(0.0, time_limit_s - (time.perf_counter() - start))
            )
            result = get_solver(name)(graph, budget_bytes, time_limit_s=remaining)
            results.append(result)
            if result.status == SolveStatus.OPTIMAL:
                break
        best = best_result(results)
        stats = dict(best.stats)
        stats["tried"] = {r.solver: r.status.value for r in results}
        stats["chosen"] = best.solver
        return SolveResult(
            schedule=best.schedule,
            status=best.status,
            objective=best.objective,
            bound=best.bound,
            peak_bytes=best.peak_bytes,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            stats=stats,
        )
