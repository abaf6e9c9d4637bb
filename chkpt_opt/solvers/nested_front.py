"""The bookkeeping of :mod:`chkpt_opt.solvers.nested_dp`'s DP: a frame's best plan, the DP's
entries and their Pareto fronts, and how an outer tensor alive on part of a frame's steps
passes to a child region."""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.solvers.nested_chain import Plan


@dataclass(frozen=True)
class FrameResult:
    """The best plan of a frame: the cheapest that fits (or, minimizing the peak, the one
    with the lowest peak).

    Attributes:
        cost_s: recompute time of the frame's replay and of every region inside it.
        peak: largest bytes of its steps above what the outside holds through all of them.
        plan: its child regions, each ``(start, stop, grandchildren)``.
    """

    cost_s: float
    peak: int
    plan: Plan


# A DP entry: (kept bytes K, value, peak so far, cost so far, previous entry, piece or None);
# the value is the cost, or the peak when minimizing the peak.
Entry = tuple


def prune(entries: list[Entry]) -> list[Entry]:
    """The Pareto front over (kept bytes, value): ascending bytes, strictly falling value
    (ties: the lower peak, then the entry found first)."""
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    front: list[Entry] = []
    for e in entries:
        if not front or e[1] < front[-1][1]:
            if front and front[-1][0] == e[0]:
                continue
            front.append(e)
    return front


def pieces(last: Entry) -> Plan:
    plan = []
    e = last
    while e is not None and e[4] is not None:
        if e[5] is not None:
            plan.append(e[5])
        e = e[4]
    return tuple(reversed(plan))


def split_outer(
    nbytes: int, th: int, p: int, q: int, const: int, ext: tuple[int, int]
) -> tuple[int, tuple[int, int]]:
    """Adds a tensor alive at the steps handling ops ``>= th`` to a child ``[p, q)``: to its
    constant bytes (all of its steps), to nothing, or as its one partial tensor."""
    if th <= p:
        return const + nbytes, ext
    if th >= q:
        return const, ext
    if ext[0]:
        raise SolverError("two outer tensors alive on part of a region's steps; a bug.")
    return const, (nbytes, th)
