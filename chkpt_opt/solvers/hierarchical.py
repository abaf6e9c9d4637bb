"""Hierarchical solving for graphs made of repeated blocks (transformer layers, ResNet stages).

Real models have thousands of ops, too many for one flat integer program, but they repeat a
block. With every region kept inside one segment (prologue, block, epilogue), the peak of the
step is ``max_j (P_j + sum_{i<j} K_i)`` (see :mod:`chkpt_opt.solvers.blocks`), and the
schedule is found in two levels:

1. **Blocks**: for every distinct segment (identical blocks share it) a CP-SAT sub-problem is
   solved once per cap on its own peak ``P``: the least recompute for a spread of bounds on
   ``K`` (an epsilon-constraint sweep). The caps are spread between the block's lowest and
   keep-all peaks, then refined at the caps the chain's solution imposes
   (``P_j <= budget - sum_{i<j} K_i``), for up to ``refine_rounds`` rounds.
2. **Chain**: dynamic programming over the chain of segments, with the bytes kept so far as
   the state (Pareto-pruned), picks one option per segment under the budget.

Both levels are repeated for up to ``max_phases`` shifted cuttings of the chain (the block
boundaries moved by a few ops, so regions may straddle the original ones); the best wins.

The result is optimal only among the schedules built from the block options; it is never
reported optimal for the full schedule model (status ``feasible``, no bound) and ``stats``
says so. The peak the chain predicts must equal the simulated one (checked).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.schedule import Schedule
from chkpt_opt.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, result_from_profile
from chkpt_opt.solvers.blocks import (
    Blocks,
    Segment,
    evaluate,
    find_blocks,
    fold_shared_lifetimes,
    phase_shifts,
    split_model,
)
from chkpt_opt.solvers.interval_model import IntervalModel, build_interval_model
from chkpt_opt.solvers.interval_solve import judged, keep_all_result, warm_start
from chkpt_opt.solvers.registry import register

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


class _BlockProgram:
    """CP-SAT model of one segment: its recompute, own peak ``P`` and kept bytes ``K`` (in a
    model of its own, or added to a shared one)."""

    def __init__(
        self, model: IntervalModel, seg: Segment, m: cp_model.CpModel | None = None
    ) -> None:
        m = m if m is not None else cp_model.CpModel()
        last = model.end_slot - 1
        scale = 1e12 / model.total_fwd_s if model.total_fwd_s > 0 else 1.0

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
                    rhs = [x[kk] for kk, e in holder.region_ends if e >= end]
                    if holder.outside_end is not None and holder.outside_end >= end:
                        rhs.append(z[holder.node])
                    if rhs:
                        m.add(y[lt, k] >= sum(rhs))
            lo = life.fixed_end
            for k, end in enumerate(life.ends):
                for s in range(lo + 1, min(end, last) + 1):
                    if s in rows:
                        rows[s].append(life.size_bytes * y[lt, k])
                lo = end
        for k in seg.intervals:
            iv = model.intervals[k]
            if iv.replay_slot is None:
                continue
            rows[iv.replay_slot].append(iv.replay_peak_bytes * x[k])
            for end, nbytes in iv.held_after_replay:
                for s in range(iv.replay_slot + 1, min(end, last) + 1):
                    rows[s].append(nbytes * x[k])
        for s, row in rows.items():
            m.add(model.base_bytes[s] + sum(row) <= peak)

        self.model, self.seg, self.m = model, seg, m
        self.x, self.y, self.z = x, y, z
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
        self, *, peak_cap: int | None, kept_cap: int | None, minimize: str, seed: int
    ) -> list[int] | None:
        """The chosen intervals of an optimal solution under the caps, or None."""
        m = self.m.clone()
        if peak_cap is not None:
            m.add(self.objectives["peak"] <= peak_cap)
        if kept_cap is not None:
            m.add(self.objectives["kept"] <= kept_cap)
        m.minimize(self.objectives[minimize])
        solver = cp_model.CpSolver()
        solver.parameters.random_seed = seed
        solver.parameters.num_workers = 1
        if solver.solve(m) != cp_model.OPTIMAL:
            return None
        return sorted(k for k, var in self.x.items() if solver.boolean_value(var))


class OptionPool:
    """The options found so far for one distinct segment, and the sweeps that find more."""

    def __init__(self, model: IntervalModel, seg: Segment, *, seed: int) -> None:
        self.model, self.seg, self.seed = model, seg, seed
        self.program = _BlockProgram(model, seg)
        self.found: dict[Spans, None] = {(): None}
        self.swept: set[int] = set()
        self.solves = 0
        self.p_high, _, _ = evaluate(model, seg, [])
        self.p_low = self.p_high
        lowest = self._solve(peak_cap=None, kept_cap=None, minimize="peak")
        if lowest is not None:
            self.p_low, _, _ = evaluate(model, seg, lowest)
            self._add(lowest)

    def _solve(self, **kwargs: Any) -> list[int] | None:
        self.solves += 1
        return self.program.solve(seed=self.seed, **kwargs)

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
        span = self.p_high - self.p_low
        for t in range(levels):
            self.sweep(self.p_low + span * t // max(1, levels - 1), n_kept=n_kept)


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
    it finds nothing in time.
    """
    m = cp_model.CpModel()
    programs = [_BlockProgram(model, seg, m) for seg in segments]
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
            for k, var in program.x.items():
                m.add_hint(var, k in chosen)
            for i, var in program.z.items():
                m.add_hint(var, i not in inside)
            for (lt, k), var in program.y.items():
                m.add_hint(var, ends[lt] >= model.lifetimes[lt].ends[k])
    solver = cp_model.CpSolver()
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    chosen = [k for p in programs for k, var in p.x.items() if solver.boolean_value(var)]
    return sorted(chosen), status == cp_model.OPTIMAL


@dataclass
class _Phase:
    """One cutting of the chain, solved."""

    blocks: Blocks
    model: IntervalModel
    segments: list[Segment]
    options: list[list[Option]]
    picked: tuple[float, list[int]] | None
    solves: int
    refine_rounds: int

    def chosen(self, picks: Sequence[int]) -> list[int]:
        return [k for j, o in enumerate(picks) for k in self.options[j][o].chosen]

    def predicted_peak(self, picks: Sequence[int]) -> int:
        kept, peak = 0, 0
        for j, o in enumerate(picks):
            peak = max(peak, self.options[j][o].peak_bytes + kept)
            kept += self.options[j][o].kept_bytes
        return peak


@register("hierarchical", "repeated blocks: block sub-problems once, then a DP over the chain")
@dataclass(frozen=True)
class HierarchicalSolver:
    """Two-level solver for graphs of repeated blocks (see the module docstring).

    Attributes:
        peak_levels: caps on a block's own peak swept per distinct segment at first.
        n_kept: bounds on the kept bytes swept per cap.
        refine_rounds: rounds of sweeps at the caps the chain's solution imposes.
        max_phases: shifted cuttings of the chain tried besides the module boundaries.
        polish_max_segments: chains of at most this many segments get a final CP-SAT over
            all segments at once, hinted with the chain's solution (see :func:`polish`).
        polish_s: time limit of that final solve.
        seed: CP-SAT seed of the block sub-problems.
    """

    peak_levels: int = 8
    n_kept: int = 12
    refine_rounds: int = 3
    max_phases: int = 3
    polish_max_segments: int = 16
    polish_s: float = 20.0
    seed: int = 0
    name: str = "hierarchical"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, start=start)
        if trivial is not None:
            return trivial
        blocks = find_blocks(graph)
        if blocks is None:
            raise SolverError(
                f"graph {graph.graph.get('name', '')!r} has no repeated blocks (no ops whose "
                "module_path has a '<name>.<k>' prefix repeated); use solver 'cpsat' or 'auto'."
            )
        phases: list[_Phase] = []
        refused: dict[int, str] = {}
        for cutting in [blocks, *phase_shifts(graph, blocks, max_phases=self.max_phases)]:
            if phases and _out_of_time(start, time_limit_s, fraction=0.5):
                break
            try:
                phases.append(self._solve_phase(graph, cutting, budget_bytes, start, time_limit_s))
            except SolverError as err:
                refused[cutting.phase] = str(err)
        if not phases:
            raise SolverError(f"no cutting of the graph into blocks splits its memory: {refused}")
        solved = [p for p in phases if p.picked is not None]
        stats: dict[str, Any] = {
            "optimal_over": "schedules with regions inside blocks, built from the block options",
            "phases_tried": [p.blocks.phase for p in phases],
            "phases_refused": refused,
            "segments": len(phases[0].blocks.bounds) - 1,
            "distinct_blocks": len(set(phases[0].blocks.kinds)),
            "block_solves": sum(p.solves for p in phases),
        }
        if solved:
            best = min(solved, key=lambda p: (p.picked[0], p.blocks.phase))
            picks = best.picked[1]
            chosen = best.chosen(picks)
            schedule, profile = judged(graph, best.model, chosen)
            if best.predicted_peak(picks) != profile.peak_bytes:
                raise SolverError(
                    f"the block split predicted a peak of {best.predicted_peak(picks)} B, the "
                    f"simulator {profile.peak_bytes} B; this is a bug in chkpt_opt, please "
                    "report it."
                )
            if len(best.segments) <= self.polish_max_segments:
                left = self.polish_s
                if time_limit_s is not None:
                    left = min(left, time_limit_s - (time.perf_counter() - start))
                polished = (
                    polish(
                        best.model,
                        best.segments,
                        budget_bytes,
                        hint=chosen,
                        time_limit_s=left,
                        seed=self.seed,
                    )
                    if left > 0
                    else None
                )
                if polished is not None:
                    stats["optimal_in_block_model"] = polished[1]
                    if best.model.cost_s(polished[0]) < profile.recompute_s:
                        schedule, profile = judged(graph, best.model, polished[0])
                        stats["polished"] = True
            stats["phase"] = best.blocks.phase
            stats["options"] = sum(len(o) for o in best.options)
            stats["refine_rounds"] = best.refine_rounds
        else:
            schedule, profile = self._lowest(graph, budget_bytes, phases[0], time_limit_s)
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            stats=stats,
        )

    def _solve_phase(
        self,
        graph: CostGraph,
        blocks: Blocks,
        budget_bytes: int,
        start: float,
        time_limit_s: float | None,
    ) -> _Phase:
        model, _ = fold_shared_lifetimes(
            build_interval_model(graph, segments=blocks.bounds), blocks
        )
        segments = split_model(model, blocks)
        pools: dict[int, OptionPool] = {}
        for seg, kind in zip(segments, blocks.kinds):
            if kind not in pools:
                pools[kind] = OptionPool(model, seg, seed=self.seed)
                pools[kind].sweep_levels(self.peak_levels, n_kept=self.n_kept)

        def tables() -> list[list[Option]]:
            index = {(iv.start, iv.stop): k for k, iv in enumerate(model.intervals)}
            options = []
            for seg, kind in zip(segments, blocks.kinds):
                row = []
                for spans in pools[kind].found:
                    chosen = tuple(index[a + seg.lo, b + seg.lo] for a, b in spans)
                    peak, kept, cost = evaluate(model, seg, chosen)
                    row.append(Option(chosen, cost, kept, peak))
                options.append(row)
            return options

        options = tables()
        picked = chain_dp(options, budget_bytes)
        rounds = 0
        while rounds < self.refine_rounds and not _out_of_time(start, time_limit_s):
            before = sum(len(pool.found) for pool in pools.values())
            if picked is None:
                for pool in pools.values():
                    pool.sweep_levels(2 * self.peak_levels, n_kept=self.n_kept)
            else:
                kept = 0
                for j, o in enumerate(picked[1]):
                    pools[blocks.kinds[j]].sweep(budget_bytes - kept, n_kept=self.n_kept)
                    kept += options[j][o].kept_bytes
            rounds += 1
            if sum(len(pool.found) for pool in pools.values()) == before:
                break
            options = tables()
            better = chain_dp(options, budget_bytes)
            improved = better is not None and (picked is None or better[0] < picked[0])
            picked = better if improved else picked
            if not improved:
                break
        solves = sum(pool.solves for pool in pools.values())
        return _Phase(blocks, model, segments, options, picked, solves, rounds)

    def _lowest(
        self, graph: CostGraph, budget_bytes: int, phase: _Phase, time_limit_s: float | None
    ) -> tuple[Schedule, MemoryProfile]:
        """The lowest-peak schedule known: per segment greedily, or greedy's if lower."""
        picks, kept = [], 0
        for row in phase.options:
            o = min(range(len(row)), key=lambda i: (row[i].peak_bytes + kept, row[i].kept_bytes))
            picks.append(o)
            kept += row[o].kept_bytes
        schedule, profile = judged(graph, phase.model, phase.chosen(picks))
        fallback, _ = warm_start(graph, budget_bytes, phase.model, time_limit_s=time_limit_s)
        if fallback.peak_bytes < profile.peak_bytes:
            return fallback.schedule, simulate(graph, fallback.schedule)
        return schedule, profile


def _out_of_time(start: float, time_limit_s: float | None, *, fraction: float = 1.0) -> bool:
    return time_limit_s is not None and time.perf_counter() - start > fraction * time_limit_s
