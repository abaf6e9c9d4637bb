"""``solver="hierarchical"``: graphs of repeated blocks (transformer layers, ResNet stages),
block sub-problems solved once per distinct block, then a DP over the chain of blocks
(:mod:`chkpt_opt.solvers.blocks.search`). Feasible, never reported optimal for the whole
schedule model: its regions stay inside blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult, keep_all_result
from chkpt_opt.solvers.blocks.search import BlockSearch
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.registry import register


@register("hierarchical", "repeated blocks: block sub-problems once, then a DP over the chain")
@dataclass(frozen=True)
class HierarchicalSolver(BlockSearch):
    """Two-level solver for graphs of repeated blocks; its settings are
    :class:`~chkpt_opt.solvers.blocks.search.BlockSearch`'s.

    Raises (when called):
        SolverError: for a graph without repeated blocks.
    """

    name: str = "hierarchical"
    proves_optimum: ClassVar[bool] = False  # its regions stay inside blocks

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        deadline = Deadline.after(time_limit_s)
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, deadline=deadline)
        if trivial is not None:
            return trivial
        return self.search(graph, budget_bytes, deadline=deadline, solver=self.name)
