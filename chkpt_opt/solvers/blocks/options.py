"""The block level of the hierarchical solver: one CP-SAT program per distinct segment (its
recompute, own peak ``P`` and kept bytes ``K``), the option sweeps over them, the chain DP
that picks one option per segment, and the final polish over every segment at once (see
:mod:`chkpt_opt.solvers.blocks.hierarchical`).

A block program states the rows of :mod:`~chkpt_opt.solvers.interval.program` (tight holds)
for the slots of one segment, in bytes, with the same variables type; its objective scaling is
:func:`~chkpt_opt.solvers.interval.program.block_cost_scale`, defined next to the flat
program's. It adds the peak ``P`` as a variable, which the flat program does not have.

Time limits: a block program's build checks its deadline (the two distinct blocks of a
separator chain of a 270-op Llama, whose programs ``dp_nested``'s block options build, held
36 million terms between them and took 100 s to build, where their share of a 20 s limit
was 5 s), and its solves run as the engine's
(:func:`~chkpt_opt.solvers.engines.cpsat_engine.run_cp`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from chkpt_opt.solvers.blocks.repeated import Segment, evaluate
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, DeadlineExceeded
from chkpt_opt.solvers.engines.cpsat_engine import make_solver, run_cp
from chkpt_opt.solvers.interval.model import IntervalModel
from chkpt_opt.solvers.interval.program import ProgramVariables, block_cost_scale

Spans = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Option:
    """A segment's schedule and what it costs there.

    Attributes:
        chosen: interval ids of its regions.
        cost_s: recompute time.
        kept_bytes: ``K``: bytes kept through every later segment.
        peak_bytes: ``P``: the peak over the segment's own slots.
    """

    chosen: tuple[int, ...]
    cost_s: float
    kept_bytes: int
    peak_bytes: int


class BlockProgram:
    """CP-SAT model of one segment: its recompute, own peak ``P`` and kept bytes ``K`` (in a
    model of its own, or added to a shared one).

    Raises (when built):
        DeadlineExceeded: once ``deadline`` has expired, while building.
    """

    def __init__(
        self,
        model: IntervalModel,
        seg: Segment,
        m: cp_model.CpModel | None = None,
        *,
        deadline: Deadline = NO_DEADLINE,
    ) -> None:
        m = m if m is not None else cp_model.CpModel()
        last = model.end_slot - 1
        scale = block_cost_scale(model.total_fwd_s)

        # z[i]: op i lies outside every region.
        z = {i: m.new_bool_var(f"z{i}") for i in range(seg.lo, seg.hi)}
        # x[k]: candidate interval k is a region.
        x = {k: m.new_bool_var(f"x{k}") for k in seg.intervals}
        # y[lt, k]: lifetime lt is held at least until its end k.
        y = {
            (lt, k): m.new_bool_var(f"y{lt}_{k}")
            for lt in seg.lifetimes
            for k in range(len(model.lifetimes[lt].ends))
        }
        # peak: the segment's own peak P.
        top = sum(model.base_bytes[s] for s in seg.slots) + sum(
            model.lifetimes[lt].size_bytes for lt in seg.lifetimes
        )
        top += sum(model.intervals[k].replay_peak_bytes for k in seg.intervals)
        peak = m.new_int_var(0, 2 * top + 1, f"peak{seg.lo}")

        starts: dict[int, list[int]] = {}
        stops: dict[int, list[int]] = {}
        for k in seg.intervals:
            starts.setdefault(model.intervals[k].start, []).append(k)
            stops.setdefault(model.intervals[k].stop, []).append(k)
        for p in range(seg.lo, seg.hi + 1):
            out = ([z[p]] if p < seg.hi else []) + [x[k] for k in starts.get(p, [])]
            into = ([z[p - 1]] if p > seg.lo else []) + [x[k] for k in stops.get(p, [])]
            if p == seg.lo:
                m.add_exactly_one(out)
            elif p == seg.hi:
                m.add_exactly_one(into)
            else:
                m.add(sum(out) == sum(into))
        rows: dict[int, list[Any]] = {s: [] for s in seg.slots}
        for lt in seg.lifetimes:
            life = model.lifetimes[lt]
            for holder in life.holders:
                for k, end in enumerate(life.ends):
                    deadline.check("building a block program's hold rows")
                    rhs = [x[kk] for kk, e in holder.region_ends if e >= end]
                    if holder.outside_end is not None and holder.outside_end >= end:
                        rhs.append(z[holder.node])
                    if rhs:
                        m.add(y[lt, k] >= sum(rhs))
            lo = life.fixed_end
            for k, end in enumerate(life.ends):
                deadline.check("building a block program's lifetimes")
                for s in range(lo + 1, min(end, last) + 1):
                    if s in rows:
                        rows[s].append(life.size_bytes * y[lt, k])
                lo = end
        for count, k in enumerate(seg.intervals):
            if count % 16 == 0:
                deadline.check("building a block program's replays")
            iv = model.intervals[k]
            if iv.replay_slot is None:
                continue
            rows[iv.replay_slot].append(iv.replay_peak_bytes * x[k])
            for end, nbytes in iv.held_after_replay:
                for s in range(iv.replay_slot + 1, min(end, last) + 1):
                    rows[s].append(nbytes * x[k])
        for count, (s, row) in enumerate(rows.items()):
            if count % 16 == 0:
                deadline.check("building a block program's memory rows")
            m.add(model.base_bytes[s] + sum(row) <= peak)
        self.terms = sum(map(len, rows.values()))

        self.model, self.seg, self.m = model, seg, m
        self.v = ProgramVariables(z, x, y)
        self.objectives = {
            "peak": peak,
            "kept": sum(
                model.lifetimes[lt].size_bytes * y[lt, k]
                for lt, k in zip(seg.lifetimes, seg.kept_end)
                if k is not None
            ),
            "cost": sum(round(model.intervals[k].cost_s * scale) * x[k] for k in x),
        }

    def solve(
        self,
        *,
        peak_cap: int | None,
        kept_cap: int | None,
        minimize: str,
        seed: int,
        time_limit_s: float | None = None,
        feasible: bool = False,
    ) -> list[int] | None:
        """The chosen intervals of an optimal solution under the caps, or None (also when
        no optimum is proven within ``time_limit_s``; with ``feasible``, the best solution
        found by then, proven optimal or not)."""
        m = self.m.clone()
        if peak_cap is not None:
            m.add(self.objectives["peak"] <= peak_cap)
        if kept_cap is not None:
            m.add(self.objectives["kept"] <= kept_cap)
        m.minimize(self.objectives[minimize])
        solver = make_solver(time_limit_s=time_limit_s, seed=seed, workers=1, terms=self.terms)
        deadline = Deadline.after(time_limit_s)
        status = run_cp(solver, m, deadline=deadline, what="a block solve")
        if status != cp_model.OPTIMAL and not (feasible and status == cp_model.FEASIBLE):
            return None
        return sorted(k for k, var in self.v.x.items() if solver.boolean_value(var))


class OptionPool:
    """The options found so far for one distinct segment, and the sweeps that find more."""

    def __init__(
        self,
        model: IntervalModel,
        seg: Segment,
        *,
        seed: int,
        deadline: Deadline | None = None,
        first_deadline: Deadline | None = None,
    ) -> None:
        """``first_deadline`` (``deadline`` when None) limits the first solve, the lowest
        peak; the sweeps after it run to ``deadline``.

        Raises:
            DeadlineExceeded: when ``deadline`` passes while the block program is built.
        """
        self.model, self.seg, self.seed = model, seg, seed
        self.deadline = first_deadline if first_deadline is not None else deadline
        self.program = BlockProgram(model, seg, deadline=deadline or NO_DEADLINE)
        self.found: dict[Spans, None] = {(): None}
        self.swept: set[int] = set()
        self.solves = 0
        self.p_high, _, _ = evaluate(model, seg, [])
        self.p_low = self.p_high
        # The whole block as one region (what per-layer checkpointing runs), found without
        # a solve: the chain always has that option, however little time the sweeps get.
        whole = [
            k
            for k in seg.intervals
            if (model.intervals[k].start, model.intervals[k].stop) == (seg.lo, seg.hi)
        ]
        if whole:
            self._add(whole)
        # The lowest peak found in the first solve's share, proven lowest or not: where an
        # optimum only counted, a solve cut by its share left the sweeps at the keep-all
        # peak alone (the padded Llama of tests/data/hf_padded, its first layer's solve cut
        # at 2.2 s inside auto: 41.3 ms recomputed, where the sweeps reach 36.7).
        lowest = self._solve(peak_cap=None, kept_cap=None, minimize="peak", feasible=True)
        if lowest is not None:
            self.p_low, _, _ = evaluate(model, seg, lowest)
            self._add(lowest)
        self.deadline = deadline

    def _solve(self, **kwargs: Any) -> list[int] | None:
        """One block solve; none once the deadline has passed (the pool keeps what it has)."""
        remaining = None if self.deadline is None else self.deadline.remaining_s()
        if remaining is not None and remaining <= 0:
            return None
        self.solves += 1
        return self.program.solve(seed=self.seed, time_limit_s=remaining, **kwargs)

    def _add(self, chosen: Sequence[int]) -> None:
        intervals = self.model.intervals
        self.found[
            tuple(
                sorted(
                    (intervals[k].start - self.seg.lo, intervals[k].stop - self.seg.lo)
                    for k in chosen
                )
            )
        ] = None

    def sweep(self, peak_cap: int, *, n_kept: int) -> None:
        """Least recompute under ``P <= peak_cap`` for ``n_kept`` bounds on ``K`` spread
        evenly between the cheapest option's ``K`` and the least ``K`` possible."""
        peak_cap = max(self.p_low, min(self.p_high, peak_cap))
        if peak_cap in self.swept:
            return
        self.swept.add(peak_cap)
        cheapest = self._solve(peak_cap=peak_cap, kept_cap=None, minimize="cost")
        leanest = self._solve(peak_cap=peak_cap, kept_cap=None, minimize="kept")
        if cheapest is None or leanest is None:
            return
        self._add(cheapest)
        _, k_high, _ = evaluate(self.model, self.seg, cheapest)
        _, k_low, _ = evaluate(self.model, self.seg, leanest)
        steps = max(1, n_kept - 1)
        caps = sorted({k_low + (k_high - 1 - k_low) * t // steps for t in range(n_kept)})
        for kept_cap in reversed(caps):
            if kept_cap >= k_low:
                chosen = self._solve(peak_cap=peak_cap, kept_cap=kept_cap, minimize="cost")
                if chosen is not None:
                    self._add(chosen)

    def sweep_levels(self, levels: int, *, n_kept: int) -> None:
        """Sweeps ``levels`` caps spread evenly between the lowest and the keep-all peak."""
        for t in range(levels):
            self.sweep_level(t, levels, n_kept=n_kept)

    def sweep_level(self, t: int, levels: int, *, n_kept: int) -> None:
        """Sweeps the ``t``-th of ``levels`` caps spread evenly between the lowest and the
        keep-all peak."""
        span = self.p_high - self.p_low
        self.sweep(self.p_low + span * t // max(1, levels - 1), n_kept=n_kept)


def coarse_to_fine(levels: int) -> list[int]:
    """``0 .. levels - 1`` with both ends first, then the midpoints of the widest gaps left:
    every prefix spreads over the whole range."""
    order = list(dict.fromkeys([0, levels - 1])) if levels > 0 else []
    gaps = [(0, levels - 1)]
    while gaps:
        wider = [(lo, hi) for lo, hi in gaps if hi - lo > 1]
        order += [(lo + hi) // 2 for lo, hi in wider]
        gaps = [g for lo, hi in wider for g in ((lo, (lo + hi) // 2), ((lo + hi) // 2, hi))]
    return order


def sweep_together(pools: Sequence[OptionPool], levels: int, *, n_kept: int) -> None:
    """Every pool's :meth:`OptionPool.sweep_levels`, interleaved: level by level in
    :func:`coarse_to_fine` order, every pool at each level, so sweeps cut by a deadline
    leave every block options spread over its range (one pool after another left the last
    blocks their lowest-peak option alone, and the chain DP little to choose from)."""
    for t in coarse_to_fine(levels):
        for pool in pools:
            pool.sweep_level(t, levels, n_kept=n_kept)


def chain_dp(options: list[list[Option]], budget_bytes: int) -> tuple[float, list[int]] | None:
    """Least total cost with ``P_j + sum_{i<j} K_i <= budget`` for every segment ``j``.

    Returns ``(cost, option index per segment)``, or None when no combination fits.
    """
    states: dict[int, tuple[float, int, int]] = {0: (0.0, -1, -1)}  # kept -> (cost, prev, o)
    history = []
    for seg_options in options:
        new: dict[int, tuple[float, int, int]] = {}
        for kept, (cost, _, _) in states.items():
            for o, option in enumerate(seg_options):
                if option.peak_bytes + kept > budget_bytes:
                    continue
                key = kept + option.kept_bytes
                value = (cost + option.cost_s, kept, o)
                if key not in new or value < new[key]:
                    new[key] = value
        states = {}
        best = float("inf")
        for key in sorted(new):  # Pareto front: more kept bytes only for less cost
            if new[key][0] < best:
                states[key], best = new[key], new[key][0]
        if not states:
            return None
        history.append(states)
    key = min(states, key=lambda k: (states[k][0], k))
    total, picks = states[key][0], []
    for layer in reversed(history):
        _, key, o = layer[key]
        picks.append(o)
    return total, picks[::-1]


def polish(
    model: IntervalModel,
    segments: list[Segment],
    budget_bytes: int,
    *,
    hint: list[int] | None,
    time_limit_s: float,
    seed: int,
) -> tuple[list[int], bool] | None:
    """One CP-SAT over every segment at once: ``P_j + sum_{i<j} K_i <= budget`` with each
    segment's own rows, hinted with the chain's solution.

    Returns ``(chosen intervals, proven optimal for regions inside segments)``, or None when
    it finds nothing in time (building the programs counts).
    """
    deadline = Deadline.after(time_limit_s)
    m = cp_model.CpModel()
    try:
        programs = [BlockProgram(model, seg, m, deadline=deadline) for seg in segments]
    except DeadlineExceeded:
        return None
    kept_before = 0
    for program in programs:
        m.add(program.objectives["peak"] + kept_before <= budget_bytes)
        kept_before = kept_before + program.objectives["kept"]
    m.minimize(sum(program.objectives["cost"] for program in programs))
    if hint is not None:
        chosen = set(hint)
        inside = {
            i for k in chosen for i in range(model.intervals[k].start, model.intervals[k].stop)
        }
        ends = model.lifetime_ends(hint)
        for program in programs:
            for k, var in program.v.x.items():
                m.add_hint(var, k in chosen)
            for i, var in program.v.z.items():
                m.add_hint(var, i not in inside)
            for (lt, k), var in program.v.y.items():
                m.add_hint(var, ends[lt] >= model.lifetimes[lt].ends[k])
    terms = sum(program.terms for program in programs)
    solver = make_solver(time_limit_s=deadline.remaining_s(), seed=seed, workers=1, terms=terms)
    status = run_cp(solver, m, deadline=deadline, what="the block polish")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    chosen = [k for p in programs for k, var in p.v.x.items() if solver.boolean_value(var)]
    return sorted(chosen), status == cp_model.OPTIMAL
