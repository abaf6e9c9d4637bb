"""The integer program of the interval model, in a form any solver can read.

Variables (all 0/1):

* ``z[i]``: op ``i`` lies outside every region;
* ``x[k]``: candidate interval ``k`` of the model is a region;
* ``y[j]``: lifetime ``l`` is held at least until its end ``k`` (``(l, k) = y_keys[j]``).

Constraints:

* flow: the regions and the ops outside them form a path from position 0 to ``n_ops``; at
  every position the arcs in equal the arcs out (``z[i]`` is the arc ``i -> i+1``, ``x[k]``
  the arc ``start -> stop``), so regions are disjoint and every op is in at most one;
* holds: ``y[j] >= z[node] + sum x[k]`` for each holder of the lifetime (the op is outside
  every region and saves the storage, or lies in one of the listed regions); at most one
  term of the right side is 1, so the row is exact for 0/1 values. With ``tight=True`` a row
  lists every hold reaching the end (a stronger LP relaxation); otherwise only the holds
  ending exactly there, and ``chains`` (``y[l, k] >= y[l, k+1]``) carry them down;
* memory: at every slot, ``const + sum bytes * x + sum bytes * y <= budget``.

The objective is ``sum cost_units[k] * x[k]`` with the recompute time of interval ``k`` in
units of ``1 / cost_scale`` seconds, rounded to integers (``cost_scale`` is a power of ten
that keeps the largest possible objective under 2**40, so the rounding is below 1e-12 of
the whole forward time; :func:`cost_scale`). The float engines (MILP, LP) state the same
objective in seconds times :attr:`IntervalProgram.float_scale` (the whole forward time is
:data:`FLOAT_OBJECTIVE_UNITS`, which keeps their tolerances meaningful), and the hierarchical
solver's block programs in integer units of :func:`block_cost_scale` (the whole forward time
is :data:`BLOCK_OBJECTIVE_UNITS`). The three are defined here only; giving the block programs
:func:`cost_scale` as well was tried and changes which of equally cheap schedules they return
(gpt_small at 0.9 of its peak: same recompute time, other regions), so it waits for a change
that may move schedules. Byte counts are
divided by their greatest common divisor ``byte_unit`` (exact: every count is a multiple of
it, and the budget is rounded down).

Every engine holds the program's variables in one :class:`ProgramVariables`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.interval.model import Interval, IntervalModel

MAX_OBJECTIVE_UNITS = 2**40
FLOAT_OBJECTIVE_UNITS = 1e6
BLOCK_OBJECTIVE_UNITS = 1e12

V = TypeVar("V")


def cost_scale(total_fwd_s: float) -> float:
    """Integer objective units per second of recompute: a power of ten that keeps the
    largest possible objective (``total_fwd_s``) under :data:`MAX_OBJECTIVE_UNITS`."""
    if total_fwd_s <= 0:
        return 1.0
    return 10.0 ** math.floor(math.log10(MAX_OBJECTIVE_UNITS / total_fwd_s))


def block_cost_scale(total_fwd_s: float) -> float:
    """Integer objective units per second in a block program (before rounding): the whole
    forward time is :data:`BLOCK_OBJECTIVE_UNITS`."""
    return BLOCK_OBJECTIVE_UNITS / total_fwd_s if total_fwd_s > 0 else 1.0


@dataclass(frozen=True)
class ProgramVariables(Generic[V]):
    """The variables of an interval program in one engine's model (see the module docstring).

    Attributes:
        z: by op index: the op lies outside every region.
        x: by interval id: the interval is a region.
        y: by y variable (or ``(lifetime, end index)`` in a block program): the lifetime is
            held at least until that end.
    """

    z: Sequence[V] | Mapping[int, V]
    x: Sequence[V] | Mapping[int, V]
    y: Sequence[V] | Mapping[Any, V]


@dataclass(frozen=True)
class HoldRow:
    """``y[y_var] >= z[node] + sum x[k] for k in x_ids`` (no z term when ``node`` is None)."""

    y_var: int
    node: int | None
    x_ids: tuple[int, ...]


@dataclass(frozen=True)
class MemoryRow:
    """Bytes alive at one slot: ``const + sum(c * x[k]) + sum(c * y[j]) <= budget``.

    Attributes:
        slots: the slots whose rows are this one (identical rows are merged).
        const: schedule-independent bytes, in byte units.
        x_terms: ``(interval id, bytes in byte units)``.
        y_terms: ``(y variable, bytes in byte units)``.
    """

    slots: tuple[int, ...]
    const: int
    x_terms: tuple[tuple[int, int], ...]
    y_terms: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class IntervalProgram:
    """The rows of the integer program of one interval model.

    Attributes:
        model: the interval model.
        byte_unit: bytes per unit of the memory rows.
        cost_scale: objective units per second.
        cost_units: integer cost of every interval.
        y_keys: ``(lifetime, end index)`` of every y variable.
        holds: the hold rows.
        chains: ``(hi, lo)`` pairs meaning ``y[hi] >= y[lo]``.
        memory_rows: one row per distinct slot row with a variable term.
        fixed_bytes: largest schedule-independent slot total (a lower bound on any peak).
        starts: interval ids by start position.
        stops: interval ids by stop position.
    """

    model: IntervalModel
    byte_unit: int
    cost_scale: float
    cost_units: tuple[int, ...]
    y_keys: tuple[tuple[int, int], ...]
    holds: tuple[HoldRow, ...]
    chains: tuple[tuple[int, int], ...]
    memory_rows: tuple[MemoryRow, ...]
    fixed_bytes: int
    starts: tuple[tuple[int, ...], ...]
    stops: tuple[tuple[int, ...], ...]

    @property
    def float_scale(self) -> float:
        """Objective units per second for the float engines: the whole forward time is
        :data:`FLOAT_OBJECTIVE_UNITS`."""
        total = self.model.total_fwd_s
        return FLOAT_OBJECTIVE_UNITS / total if total > 0 else 1.0

    def budget_units(self, budget_bytes: int) -> int:
        """The budget in byte units, rounded down."""
        return budget_bytes // self.byte_unit

    def values(self, chosen: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Exact 0/1 values of ``z``, ``x`` and ``y`` for the chosen intervals (for hints)."""
        model = self.model
        x = [0] * len(model.intervals)
        z = [1] * model.n_ops
        for k in chosen:
            x[k] = 1
            for i in range(model.intervals[k].start, model.intervals[k].stop):
                z[i] = 0
        ends = model.lifetime_ends(chosen)
        y = [int(ends[lt] >= model.lifetimes[lt].ends[k]) for lt, k in self.y_keys]
        return z, x, y


def build_program(
    model: IntervalModel, *, tight: bool = True, deadline: Deadline = NO_DEADLINE
) -> IntervalProgram:
    """The integer program of ``model`` (see the module docstring).

    Raises:
        DeadlineExceeded: once ``deadline`` has expired.
    """
    intervals = model.intervals
    unit = 0
    for value in model.base_bytes:
        unit = math.gcd(unit, value)
    for life in model.lifetimes:
        unit = math.gcd(unit, life.size_bytes)
    for iv in intervals:
        unit = math.gcd(unit, iv.replay_peak_bytes)
        for _, nbytes in iv.held_after_replay:
            unit = math.gcd(unit, nbytes)
    unit = max(unit, 1)

    scale = cost_scale(model.total_fwd_s)
    cost_units = tuple(round(iv.cost_s * scale) for iv in intervals)

    y_keys: list[tuple[int, int]] = []
    y_of: dict[tuple[int, int], int] = {}
    holds: list[HoldRow] = []
    chains: list[tuple[int, int]] = []
    for lt, life in enumerate(model.lifetimes):
        if lt % _CHECK_EVERY == 0:
            deadline.check(_ROWS)
        for k in range(len(life.ends)):
            y_of[lt, k] = len(y_keys)
            y_keys.append((lt, k))
            if k and not tight:
                chains.append((y_of[lt, k - 1], y_of[lt, k]))
        for holder in life.holders:
            for k, end in enumerate(life.ends):
                reach = (lambda e, end=end: e >= end) if tight else (lambda e, end=end: e == end)
                node = (
                    holder.node
                    if holder.outside_end is not None and reach(holder.outside_end)
                    else None
                )
                x_ids = tuple(kk for kk, e in holder.region_ends if reach(e))
                if node is not None or x_ids:
                    holds.append(HoldRow(y_of[lt, k], node, x_ids))

    last = model.end_slot - 1
    consts = [v // unit for v in model.base_bytes]
    # The terms of every slot's row. Each variable comes at most once per slot (a lifetime's
    # ends cover disjoint slots, an interval's profile names each slot once) and they are
    # appended by ascending variable, so a slot's terms are its row as they stand (the
    # tests check rows for ascending variables and positive coefficients).
    x_terms: list[list[tuple[int, int]]] = [[] for _ in range(model.n_slots)]
    y_terms: list[list[tuple[int, int]]] = [[] for _ in range(model.n_slots)]
    for lt, life in enumerate(model.lifetimes):
        if lt % _CHECK_EVERY == 0:
            deadline.check(_ROWS)
        if not life.size_bytes:
            continue
        lo = life.fixed_end
        for k, end in enumerate(life.ends):
            term = (y_of[lt, k], life.size_bytes // unit)
            for s in range(lo + 1, min(end, last) + 1):
                y_terms[s].append(term)
            lo = end
    for k, iv in enumerate(intervals):
        if k % _CHECK_EVERY == 0:
            deadline.check(_ROWS)
        for first, stop, nbytes in _interval_segments(iv, last):
            term = (k, nbytes // unit)
            for s in range(first, stop + 1):
                x_terms[s].append(term)
    merged: dict[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], list[int]] = {}
    fixed = 0
    for s in range(model.n_slots):
        deadline.check(_ROWS)
        fixed = max(fixed, consts[s])
        if x_terms[s] or y_terms[s]:
            merged.setdefault((tuple(x_terms[s]), tuple(y_terms[s])), []).append(s)
        x_terms[s] = y_terms[s] = []  # (freed as the rows are made)
    rows = [
        MemoryRow(tuple(slots), max(consts[s] for s in slots), xs, ys)
        for (xs, ys), slots in merged.items()
    ]
    rows.sort(key=lambda r: r.slots[0])

    starts: list[list[int]] = [[] for _ in range(model.n_ops + 1)]
    stops: list[list[int]] = [[] for _ in range(model.n_ops + 1)]
    for k, iv in enumerate(intervals):
        starts[iv.start].append(k)
        stops[iv.stop].append(k)
    return IntervalProgram(
        model=model,
        byte_unit=unit,
        cost_scale=scale,
        cost_units=cost_units,
        y_keys=tuple(y_keys),
        holds=tuple(holds),
        chains=tuple(chains),
        memory_rows=tuple(rows),
        fixed_bytes=fixed * unit,
        starts=tuple(tuple(s) for s in starts),
        stops=tuple(tuple(s) for s in stops),
    )


def count_terms(model: IntervalModel) -> int:
    """The terms of :func:`build_program`'s hold rows (``tight``) and memory rows before
    identical rows are merged (an upper bound on what an engine builds), counted from
    ``model`` without building them: what sizes a program before its build is paid for."""
    last = model.end_slot - 1
    terms = 0
    for life in model.lifetimes:
        for holder in life.holders:
            region_ends = sorted(e for _, e in holder.region_ends)
            for end in life.ends:
                reaching = len(region_ends) - bisect.bisect_left(region_ends, end)
                outside = holder.outside_end is not None and holder.outside_end >= end
                terms += reaching + outside
        if life.size_bytes:
            lo = life.fixed_end
            for end in life.ends:
                terms += max(0, min(end, last) - lo)
                lo = end
    for iv in model.intervals:
        terms += sum(stop - first + 1 for first, stop, _ in _interval_segments(iv, last))
    return terms


_ROWS = "building the memory rows of the interval program"
_CHECK_EVERY = 64
"""The deadline is checked every this many lifetimes and intervals, and at every slot."""


def _interval_segments(iv: Interval, last: int) -> list[tuple[int, int, int]]:
    """``(first slot, last slot, bytes)`` of a chosen interval over the slots it adds bytes
    to, each slot once: its replay peak at the replay slot, and after it the recomputed
    storages it still holds (summed, dropping at each one's end)."""
    if iv.replay_slot is None:
        return []
    slot = iv.replay_slot
    segments = [(slot, slot, iv.replay_peak_bytes)] if iv.replay_peak_bytes else []
    # held_after_replay is sorted by end: the bytes held drop at each end.
    held = sum(nbytes for _, nbytes in iv.held_after_replay)
    s = slot + 1
    for end, nbytes in iv.held_after_replay:
        stop = min(end, last)
        if held and s <= stop:
            segments.append((s, stop, held))
        s = max(s, stop + 1)
        held -= nbytes
    return segments
