"""Exceptions raised by chkpt_opt.

Every error names the offending value, says what is wrong with it and what to do instead.
All of them derive from :class:`ChkptOptError`, so callers can catch the whole family.
"""

from __future__ import annotations


class ChkptOptError(Exception):
    """Base class of every error chkpt_opt raises on purpose."""


class BudgetError(ChkptOptError, ValueError):
    """A memory budget that cannot be parsed or cannot be met."""


class InfeasibleBudgetError(BudgetError):
    """No schedule fits the budget.

    Attributes:
        budget_bytes: the budget asked for (activation part, in bytes).
        min_feasible_bytes: the smallest budget known to be feasible for this graph, or None.
        exact: whether ``min_feasible_bytes`` is proven to be the minimum over all schedules
            of the schedule model, or only the smallest a heuristic reached.
    """

    def __init__(
        self,
        message: str,
        *,
        budget_bytes: int,
        min_feasible_bytes: int | None,
        exact: bool = False,
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.exact = exact


class TraceError(ChkptOptError):
    """The model or its example inputs cannot be traced."""


class GraphFormatError(ChkptOptError, ValueError):
    """A cost graph (in memory or in a file) is malformed."""


class ScheduleError(ChkptOptError, ValueError):
    """A schedule is malformed or does not fit the graph it is applied to."""


class SolverError(ChkptOptError):
    """A solver name is unknown or a solver failed."""


class SweepError(ChkptOptError, ValueError):
    """A benchmark sweep cannot start: its results file or its cluster is not usable."""


def short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, so that a hostile file cannot make a
    megabyte-long error message."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}… ({len(text)} characters)"
