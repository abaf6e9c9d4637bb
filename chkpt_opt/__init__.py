"""chkpt_opt: optimal activation-checkpointing schedules for PyTorch training, run for real.

Example:
    >>> import torch, chkpt_opt
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> optimized = chkpt_opt.optimize(net, (torch.randn(32, 64),), budget="1MB", optimizer=None)
"""

from chkpt_opt.api import (
    Plan,
    activation_budget,
    apply,
    optimize,
    plan,
    smallest_peak,
    solve,
    trace,
)
from chkpt_opt.budget import Budget, StaticMemory, format_bytes, parse_budget
from chkpt_opt.errors import (
    BudgetError,
    ChkptOptError,
    GraphFormatError,
    InfeasibleBudgetError,
    ScheduleError,
    SolverError,
    TraceError,
)
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph, save_graph
from chkpt_opt.schedule import Schedule
from chkpt_opt.simulate import MemoryProfile, simulate
from chkpt_opt.solvers import SolveResult, SolveStatus, available_solvers, get_solver
from chkpt_opt.validate import ValidationReport, validate

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # compile_module imports Inductor (about a second): only when asked for.
    if name == "compile_module":
        from chkpt_opt.export.partitioner import compile_module

        return compile_module
    raise AttributeError(f"module 'chkpt_opt' has no attribute {name!r}")


__all__ = [
    "Budget",
    "BudgetError",
    "ChkptOptError",
    "CostGraph",
    "GraphFormatError",
    "InfeasibleBudgetError",
    "MemoryProfile",
    "Plan",
    "Schedule",
    "ScheduleError",
    "SolveResult",
    "SolveStatus",
    "SolverError",
    "StaticMemory",
    "TraceError",
    "ValidationReport",
    "activation_budget",
    "apply",
    "available_solvers",
    "compile_module",
    "format_bytes",
    "get_solver",
    "load_graph",
    "optimize",
    "parse_budget",
    "plan",
    "save_graph",
    "simulate",
    "smallest_peak",
    "solve",
    "trace",
    "validate",
]
