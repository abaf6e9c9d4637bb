"""The LP engine: the LP relaxation of the interval program, solved by GLOP.

Its optimum is a proven lower bound on the recompute time of every schedule the program
holds (:func:`lp_bound_s` takes GLOP's tolerance off); its solution is what ``lp_round``
rounds and what the reduced-cost fixing of ``pruned`` reads. The rows are the MILP engine's
(:func:`~chkpt_opt.solvers.engines.milp_engine.build_milp` with ``relax=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.engines.milp_engine import MilpVariables, build_milp
from chkpt_opt.solvers.interval.model import IntervalModel
from chkpt_opt.solvers.interval.program import IntervalProgram

LP_TOLERANCE = 1e-7
"""Relative allowance for GLOP's tolerances when its optimum is reported as a bound."""

OPTIMAL = pywraplp.Solver.OPTIMAL
INFEASIBLE = pywraplp.Solver.INFEASIBLE


def lp_bound_s(lp_value_s: float, model: IntervalModel) -> float:
    """A proven lower bound from an LP optimum of ``lp_value_s`` seconds (the LP solver's
    tolerance taken off, relative and on the scale of the whole forward time)."""
    return max(0.0, lp_value_s * (1 - LP_TOLERANCE) - LP_TOLERANCE * model.total_fwd_s)


@dataclass
class LpRelaxation:
    """The LP relaxation of one interval program under one budget, in a GLOP model.

    Attributes:
        program: the interval program.
        solver: the GLOP model (solved in place; bounds may be fixed by :meth:`fix`).
        v: its variables.
    """

    program: IntervalProgram
    solver: pywraplp.Solver
    v: MilpVariables

    @classmethod
    def build(
        cls, program: IntervalProgram, budget_bytes: int, *, deadline: Deadline = NO_DEADLINE
    ) -> LpRelaxation:
        """The relaxation of ``program`` under ``budget_bytes``.

        Raises:
            DeadlineExceeded: if building the rows runs past ``deadline``.
        """
        lp, v = build_milp(
            program, program.budget_units(budget_bytes), relax=True, deadline=deadline
        )
        lp.SuppressOutput()
        return cls(program, lp, v)

    def limit_time(self, deadline: Deadline) -> None:
        """Limits every later solve to what is left of ``deadline`` (at least 1 ms)."""
        left = deadline.remaining_s()
        if left is not None:
            self.solver.SetTimeLimit(max(1, int(left * 1000)))

    def solve(self) -> int:
        """Solves (again); returns the pywraplp status."""
        return self.solver.Solve()

    def objective_units(self) -> float:
        """The optimum in float objective units."""
        return self.solver.Objective().Value()

    def value_s(self) -> float:
        """The optimum in seconds (not yet lowered by the tolerance: see :func:`lp_bound_s`)."""
        return self.objective_units() / self.program.float_scale

    def x(self) -> list[float]:
        """Values of the region variables."""
        return [var.solution_value() for var in self.v.x]

    def z(self) -> list[float]:
        """Values of the outside variables."""
        return [var.solution_value() for var in self.v.z]

    def reduced_costs(self) -> list[float]:
        """Reduced costs of the region variables (float objective units)."""
        return [var.reduced_cost() for var in self.v.x]

    def fix(self, k: int, value: float) -> None:
        """Fixes region variable ``k`` to ``value``."""
        self.v.x[k].SetBounds(value, value)
