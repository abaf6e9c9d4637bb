"""``solver="greedy"``: Chen et al.'s budget-driven segmentation, thresholds swept and judged
by the simulator (:mod:`chkpt_opt.solvers.heuristics.greedy_sweep`)."""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult
from chkpt_opt.solvers.heuristics.greedy_sweep import DEFAULT_THRESHOLDS, greedy_sweep
from chkpt_opt.solvers.registry import register


@register("greedy", "Chen et al. 2016: budget-driven segmentation, thresholds swept and simulated")
@dataclass(frozen=True)
class GreedySolver:
    """Greedy segmentation with a threshold sweep.

    Attributes:
        n_thresholds: number of segment-size thresholds tried.
    """

    n_thresholds: int = DEFAULT_THRESHOLDS
    name: str = "greedy"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        return greedy_sweep(
            graph,
            budget_bytes,
            n_thresholds=self.n_thresholds,
            time_limit_s=time_limit_s,
            solver=self.name,
        )
