"""chkpt_opt: optimal activation-checkpointing schedules for PyTorch training, run for real.

Example:
    >>> import torch, chkpt_opt
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> net = chkpt_opt.optimize(net, budget="1MB", optimizer=None)  # the same object
    >>> net(torch.randn(32, 64)).sum().backward()  # plans on this first training batch

The names that need torch (tracing, planning, validating, compiling) are imported on first
use, so ``import chkpt_opt.solvers`` and ``chkpt_opt.graphs.io`` run without torch.
"""

import importlib
import sys

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
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers import (
    SolveResult,
    SolveStatus,
    available_solvers,
    get_solver,
    smallest_peak,
)
from chkpt_opt.step_budget.budget import Budget, StaticMemory, format_bytes, parse_budget
from chkpt_opt.step_budget.sharding import Sharding, sharding_of

__version__ = "0.1.0"

# Public names that import torch: name -> the module defining it, imported on first use.
_LAZY = {
    "Plan": "chkpt_opt.api",
    "activation_budget": "chkpt_opt.step_budget.whole_step",
    "apply": "chkpt_opt.api",
    "attachment_of": "chkpt_opt.attachment",
    "detach": "chkpt_opt.attachment",
    "optimize": "chkpt_opt.attachment",
    "plan": "chkpt_opt.api",
    "simulate_step": "chkpt_opt.step_budget.whole_step",
    "solve": "chkpt_opt.step_budget.whole_step",
    "StepProfile": "chkpt_opt.step_budget.whole_step",
    "StepSolveResult": "chkpt_opt.step_budget.whole_step",
    "trace": "chkpt_opt.api",
    "ValidationReport": "chkpt_opt.validation",
    "validate": "chkpt_opt.validation",
    # compile_module imports Inductor (about a second).
    "compile_module": "chkpt_opt.export.partitioner",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'chkpt_opt' has no attribute {name!r}")
    importlib.import_module(_LAZY[name])
    # Bind every lazy name whose module is loaded (no lazy name is also a submodule's name:
    # importing chkpt_opt.<name> would bind the module over it, which is why the checks
    # live in chkpt_opt.validation, not chkpt_opt.validate).
    for other, module_name in _LAZY.items():
        module = sys.modules.get(module_name)
        if module is not None:
            globals()[other] = getattr(module, other)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "Sharding",
    "SolveResult",
    "SolveStatus",
    "SolverError",
    "StaticMemory",
    "StepProfile",
    "StepSolveResult",
    "TraceError",
    "ValidationReport",
    "activation_budget",
    "apply",
    "attachment_of",
    "available_solvers",
    "compile_module",
    "detach",
    "format_bytes",
    "get_solver",
    "load_graph",
    "optimize",
    "parse_budget",
    "plan",
    "save_graph",
    "sharding_of",
    "simulate",
    "simulate_step",
    "smallest_peak",
    "solve",
    "trace",
    "validate",
]
