"""The one deadline value every solver, engine and model builder shares.

Example:
    >>> d = Deadline.after(None)
    >>> d.remaining_s() is None, d.expired()
    (True, False)
    >>> Deadline.after(10.0).share(0.5).limit_s
    5.0
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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

GRACE_S = 1.0
"""How long :func:`run_within` waits for a call past its deadline before leaving it."""

T = TypeVar("T")


def run_within(
    deadline: Deadline, call: Callable[[], T], *, what: str, grace_s: float = GRACE_S
) -> T:
    """Runs ``call`` and returns its value, or raises :class:`DeadlineExceeded` once
    ``deadline`` plus ``grace_s`` has passed with ``call`` still running.

    For a native solve that releases the GIL and takes a time limit of its own but may
    overrun it: HiGHS checks its limit only between presolve steps (Hugging Face BERT at 35%
    of its keep-all peak, a MILP of 5,774 binaries given 5.2 s, returned after 6.5 s; the
    pruned search given 14.8 s took 19.3 s, and 15.9 s through this). ``call`` runs on a
    worker thread; one that is left keeps running until its own limit stops it, and its
    value is dropped. The thread is not a daemon, so an
    interpreter that exits meanwhile waits for it rather than tearing the solver down under
    it. Without a limit, ``call`` runs on the caller's thread.
    """
    remaining = deadline.remaining_s()
    if remaining is None:
        return call()
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # re-raised on the caller's thread
            outcome["error"] = err

    worker = threading.Thread(target=work, name=f"chkpt_opt: {what}")
    worker.start()
    worker.join(remaining + grace_s)
    if worker.is_alive():
        raise DeadlineExceeded(
            f"{what} was still running {grace_s:g} s after the time limit of "
            f"{deadline.limit_s:g} s and was left to stop on its own; give a larger "
            "time_limit_s, or a smaller graph."
        )
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
