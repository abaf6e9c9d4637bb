"""The bookkeeping of :mod:`chkpt_opt.solvers.nested.recurrence`'s DP: a frame's best plan, the DP's
entries and their Pareto fronts, and how an outer tensor alive on part of a frame's steps
passes to a child region."""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

from chkpt_opt.errors import SolverError
from chkpt_opt.solvers.base import INF_BYTES
from chkpt_opt.solvers.nested.unit_chain import NestedChain, Plan, UnitOption


@dataclass(frozen=True)
class FrameResult:
    """The best plan of a frame: the cheapest that fits (or, minimizing the peak, the one
    with the lowest peak).

    Attributes:
        cost_s: recompute time of the frame's replay and of every region inside it.
        peak: largest bytes of its steps above what the outside holds through all of them.
        plan: its child regions, each ``(start, stop, grandchildren)``.
        run_peak: largest bytes while the region runs as a checkpoint inside an enclosing
            run (the forward pass, or an outer region's replay), above the caller's bytes
            and the region's input (:func:`run_peak`).
    """

    cost_s: float
    peak: int
    plan: Plan
    run_peak: int


def run_op_bytes(w: tuple[int, ...], a: tuple[int, ...], start: int, i: int) -> int:
    """Bytes of op ``i`` running in a run of a region that starts at ``start``: its
    workspace, its output and its input (the region's input, at ``start``, is the
    caller's)."""
    return w[i] + a[i] + (a[i - 1] if i > start else 0)


def run_peak(
    w: tuple[int, ...],
    a: tuple[int, ...],
    start: int,
    stop: int,
    plan: Plan,
    memo: dict,
    options: tuple[tuple[UnitOption, ...], ...] = (),
) -> int:
    """The largest bytes of region ``[start, stop)`` with child regions ``plan`` running as
    a checkpoint: every op runs, and each nested region's input is held by its caller's
    code until the nested region returns (see :func:`chkpt_opt.memory_model.op_sequence.lower`), on
    top of what its ops need; a unit running one of its ``options`` runs with that option's
    regions nested (never below its plain run). ``memo`` caches it per region and plan."""
    key = (start, stop, plan)
    if key in memo:
        return memo[key]
    best = 0
    i = start
    for piece in plan:
        if len(piece) == 2:
            p, k = piece
            best = max(best, options[p][k].w_run + a[p] + (a[p - 1] if p > start else 0))
            continue
        s, t, inner = piece
        held = a[s - 1] if s > start else 0
        best = max(
            best,
            tail_run_bytes(w, a, start, i, s),
            held + run_peak(w, a, s, t, inner, memo, options),
        )
        i = t
    best = max(best, tail_run_bytes(w, a, start, i, stop))
    memo[key] = best
    return best


# A DP entry: (kept bytes K, value, peak so far, cost so far, previous entry, piece or None);
# the value is the cost, or the peak when minimizing the peak.
Entry = tuple
_FRONT_ORDER = itemgetter(0, 1, 2)  # kept bytes, value, peak


def prune(entries: list[Entry]) -> list[Entry]:
    """The Pareto front over (kept bytes, value): ascending bytes, strictly falling value
    (ties: the lower peak, then the entry found first)."""
    entries.sort(key=_FRONT_ORDER)
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


def tail_run_bytes(w: tuple[int, ...], a: tuple[int, ...], start: int, i: int, stop: int) -> int:
    """The largest run bytes of the plain ops ``i..stop-1`` of a region at ``start``."""
    return max((run_op_bytes(w, a, start, j) for j in range(i, stop)), default=0)


def piece_end(entry: Entry, last: int) -> int:
    """Where the pieces of a frame's final entry end: past its last piece's region, or past
    the last packer when that is a plain op."""
    piece = entry[5]
    return piece[1] if piece is not None else last + 1


class FrameMemo:
    """The answers of frames already solved, per frame key: boxes of (budget, run room)
    where a result is optimal, and points at and below which nothing fits.

    A result solved with budget ``m`` and run room ``r`` that peaks at ``P`` and runs in
    ``R`` is optimal for every budget in ``[P, m]`` and room in ``[R, r]``; the caller
    widens either end to infinity where it knows more (a result at the frame's least
    cost; a room that turned nothing away).
    """

    def __init__(self) -> None:
        self.boxes: dict[tuple, list[tuple[int, int, int, int, FrameResult]]] = {}
        self.infeasible: dict[tuple, list[tuple[int, int]]] = {}

    def lookup(self, key: tuple, m: int, r: int) -> tuple[bool, FrameResult | None, int]:
        """(whether it is known, the answer, the largest run room it holds for)."""
        for mi, ri in self.infeasible.get(key, ()):
            if m <= mi and r <= ri:
                return True, None, ri
        for lo, hi, run_lo, run_hi, result in self.boxes.get(key, ()):
            if lo <= m <= hi and run_lo <= r <= run_hi:
                return True, result, run_hi
        return False, None, r

    def store(
        self, key: tuple, m: int, r_hi: int, result: FrameResult | None, *, least: bool
    ) -> None:
        """Records the answer for budget ``m``, valid up to run room ``r_hi``; ``least``: it
        costs the frame's least possible, so it holds for any larger budget and room."""
        if result is None:
            self.infeasible.setdefault(key, []).append((m, r_hi))
            return
        m_hi, r_hi = (INF_BYTES, INF_BYTES) if least else (m, r_hi)
        self.boxes.setdefault(key, []).append((result.peak, m_hi, result.run_peak, r_hi, result))


Way = tuple
"""How a unit runs as a plain piece of a frame: ``(piece, w, w_run, e, sin, sout, bwd,
cost_s)``, its bytes in the roles of :class:`~chkpt_opt.solvers.nested.unit_chain.NestedChain`'s
facts; ``piece`` is None for the unit as it is, ``(unit, k)`` for its option ``k``."""


def plain_ways(chain: NestedChain) -> tuple[list[list[Way]], list[list[Way]]]:
    """Per unit, its ways as a plain piece: as it is, then with each of its options,
    where it is not a region's last packer (the options only between a region's first op
    and its last packer, or at the top); and as a region's last packer (its replay stops
    there, running its owner only if that saves a storage of its own)."""
    c = chain
    inner = [
        [
            (None, c.w[i], c.w_run[i], c.e[i], c.sin[i], c.sout[i], c.bwd_base[i], c.t[i]),
            *(
                ((i, k), o.w, o.w_run, o.e, o.sin, o.sout, o.bwd, c.t[i] + o.cost_s)
                for k, o in enumerate(c.options_of(i))
            ),
        ]
        for i in range(c.n)
    ]
    last = [
        [
            (
                None,
                c.w_stop[i],
                c.w_run[i],
                c.e[i],
                c.sin[i],
                c.sout[i],
                c.bwd_post[i],
                c.t_own[i] if c.sown[i] else 0.0,
            )
        ]
        for i in range(c.n)
    ]
    return inner, last
