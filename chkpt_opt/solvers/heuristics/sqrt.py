"""Chen et al.'s square-root segmentation.

The ops are cut into about sqrt(n) segments at low-crossing positions (the articulation
points of a chain); only the segment boundaries are kept and every segment is recomputed
in the backward pass. The schedule does not depend on the budget; the result says whether
it fits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.base import SolveResult, result_from_profile
from chkpt_opt.solvers.registry import register
from chkpt_opt.solvers.segments import candidate_cuts, spans_between


def sqrt_cuts(candidates: list[int], n_segments: int) -> list[int]:
    """Picks ``n_segments - 1`` cuts evenly spread over the candidate positions."""
    if n_segments <= 1 or not candidates:
        return []
    step = len(candidates) / n_segments
    return sorted(
        {candidates[min(len(candidates) - 1, round(step * k))] for k in range(1, n_segments)}
    )


@register("sqrt", "Chen et al. 2016: about sqrt(n) segments at articulation points, all recomputed")
@dataclass(frozen=True)
class SqrtSolver:
    """Square-root segmentation.

    Attributes:
        n_segments: number of segments; ``None`` means ``round(sqrt(#candidate cuts + 1))``.
    """

    n_segments: int | None = None
    name: str = "sqrt"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        n = graph.number_of_nodes()
        candidates = candidate_cuts(graph)
        k = self.n_segments or max(1, round(math.sqrt(len(candidates) + 1)))
        schedule = Schedule.from_spans(graph, spans_between(sqrt_cuts(candidates, k), n))
        profile = simulate(graph, schedule, check=False)
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            stats={"segments": len(schedule.regions), "candidates": len(candidates)},
        )
