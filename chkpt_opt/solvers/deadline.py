"""The one deadline value every solver, engine and model builder shares, and planning's
stages with it (:func:`stage`: logged at INFO, timed).

A native solve runs within it so that nothing is left running when it returns: on the
caller's thread with a watchdog that interrupts it past the deadline (:func:`run_stoppable`:
CP-SAT, SCIP), or, where the solver cannot be interrupted (HiGHS through OR-Tools), in a
child process killed past the deadline (:func:`run_child`).

Example:
    >>> d = Deadline.after(None)
    >>> d.remaining_s() is None, d.expired()
    (True, False)
    >>> Deadline.after(10.0).share(0.5).limit_s
    5.0
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from chkpt_opt.errors import SolverError

log = logging.getLogger(__name__)


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

    def capped(self, limit_s: float | None) -> Deadline:
        """The earlier of this deadline and ``limit_s`` seconds from now (None: this one)."""
        if limit_s is None:
            return self
        left = self.remaining_s()
        return Deadline.after(limit_s if left is None else min(limit_s, left))

    def check(self, what: str) -> None:
        """Raises :class:`DeadlineExceeded`, naming ``what`` was cut short, once expired."""
        if self.expired():
            raise DeadlineExceeded(
                f"{what} ran past the time limit of {self.limit_s:g} s; give a larger "
                "time_limit_s, or a smaller graph."
            )


NO_DEADLINE = Deadline(0.0, None)
"""A deadline that never expires."""


@contextlib.contextmanager
def stage(name: str, deadline: Deadline, seconds: dict[str, float] | None = None) -> Iterator[None]:
    """Logs the start and the end of planning stage ``name`` at INFO, with its seconds and
    what is left of ``deadline``, and adds its seconds to ``seconds[name]``."""
    left = deadline.remaining_s()
    log.info(
        "planning: %s started (%s)",
        name,
        "no time limit" if left is None else f"{left:.1f} s of {deadline.limit_s:g} s left",
    )
    start = time.perf_counter()
    try:
        yield
    finally:
        took_s = time.perf_counter() - start
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + took_s
        log.info("planning: %s finished in %.2f s", name, took_s)


def add_seconds(total: dict[str, float], seconds: Mapping[str, float]) -> None:
    """Adds each stage's ``seconds`` into ``total`` (what :func:`stage` recorded)."""
    for name, stage_s in seconds.items():
        total[name] = total.get(name, 0.0) + stage_s


GRACE_S = 1.0
"""How long past its deadline a solve runs before it is stopped (:func:`run_stoppable`)
or killed (:func:`run_child`)."""

T = TypeVar("T")


def run_stoppable(
    deadline: Deadline,
    call: Callable[[], T],
    *,
    stop: Callable[[], object],
    what: str,
    grace_s: float = GRACE_S,
) -> T:
    """Runs ``call`` on the caller's thread and returns its value; once ``deadline`` plus
    ``grace_s`` has passed with ``call`` still running, a watchdog calls ``stop`` (the
    solver's own interruption: CP-SAT's ``stop_search``, SCIP's ``InterruptSolve``), and
    ``call`` returns what it has.

    For a native solve that releases the GIL and takes a time limit of its own but may
    overrun it (CP-SAT's presolve checks no limit in some steps; HiGHS, which cannot be
    interrupted, runs in a child process instead: :func:`run_child`). The watchdog is a
    thread that is joined before this returns, whatever happens: nothing started here
    outlives the call. Without a limit, no watchdog starts.
    """
    remaining = deadline.remaining_s()
    if remaining is None:
        return call()
    fired = threading.Event()

    def fire() -> None:
        fired.set()
        log.info(
            "%s ran %g s past its time limit of %g s: stopped", what, grace_s, deadline.limit_s
        )
        stop()

    watchdog = threading.Timer(remaining + grace_s, fire)
    watchdog.name = f"chkpt_opt watchdog: {what}"
    watchdog.daemon = True
    watchdog.start()
    try:
        return call()
    finally:
        watchdog.cancel()
        watchdog.join()


def run_child(
    deadline: Deadline,
    argv: Sequence[str],
    payload: bytes,
    *,
    what: str,
    grace_s: float = GRACE_S,
) -> bytes | None:
    """Runs the command ``argv`` as a child process with ``payload`` on its standard input
    and returns its standard output, or None where it was still running ``grace_s`` past
    ``deadline`` (it is killed and reaped then: no process is left behind).

    Raises:
        SolverError: the child failed (its exit status and the end of its error output).
    """
    remaining = deadline.remaining_s()
    timeout_s = None if remaining is None else remaining + grace_s
    child = subprocess.Popen(
        list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = child.communicate(payload, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        log.info("%s ran %g s past its time limit of %g s: killed", what, grace_s, deadline.limit_s)
        return None
    except BaseException:  # KeyboardInterrupt included: the child goes with the caller
        child.kill()
        child.communicate()
        raise
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip()[-2000:]
        raise SolverError(
            f"{what} failed in its child process (exit status {child.returncode}): {tail}; "
            "this is a bug, please report it with the graph."
        )
    return out
