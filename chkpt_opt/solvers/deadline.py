"""The one deadline value every solver, engine and model builder shares.

Example:
    >>> d = Deadline.after(None)
    >>> d.remaining_s() is None, d.expired()
    (True, False)
    >>> Deadline.after(10.0).share(0.5).limit_s
    5.0
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from chkpt_opt.errors import SolverError


class DeadlineExceeded(SolverError):
    """A deadline passed while building or solving (the message says what was cut short)."""


@dataclass(frozen=True)
class Deadline:
    """A time limit counted from a start.

    Attributes:
        start: ``time.perf_counter()`` when the limit began.
        limit_s: seconds allowed from ``start``; None: no limit.
    """

    start: float
    limit_s: float | None

    @classmethod
    def after(cls, limit_s: float | None, *, start: float | None = None) -> Deadline:
        """A deadline ``limit_s`` seconds from ``start`` (now by default)."""
        return cls(time.perf_counter() if start is None else start, limit_s)

    def elapsed_s(self) -> float:
        """Seconds since ``start``."""
        return time.perf_counter() - self.start

    def remaining_s(self) -> float | None:
        """Seconds left (never negative); None without a limit."""
        if self.limit_s is None:
            return None
        return max(0.0, self.limit_s - self.elapsed_s())

    def expired(self) -> bool:
        """Whether more than ``limit_s`` seconds have passed since ``start``."""
        return self.limit_s is not None and self.elapsed_s() > self.limit_s

    def share(self, fraction: float) -> Deadline:
        """The deadline at ``fraction`` of this limit, from the same start."""
        return Deadline(self.start, None if self.limit_s is None else fraction * self.limit_s)

    def check(self, what: str) -> None:
        """Raises :class:`DeadlineExceeded`, naming ``what`` was cut short, once expired."""
        if self.expired():
            raise DeadlineExceeded(
                f"{what} ran past the time limit of {self.limit_s:g} s; give a larger "
                "time_limit_s, or a smaller graph."
            )


NO_DEADLINE = Deadline(0.0, None)
"""A deadline that never expires."""
