"""Solvers: each a value found by name in the registry. No torch here."""

from chkpt_opt.solvers.base import Solver, SolveResult, SolveStatus
from chkpt_opt.solvers.registry import available_solvers, get_solver, register

__all__ = ["SolveResult", "SolveStatus", "Solver", "available_solvers", "get_solver", "register"]
