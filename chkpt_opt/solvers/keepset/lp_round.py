"""Checkmate's two-phase approximation: solve the LP relaxation, round, judge by the simulator.

Phase one solves the LP relaxation of the interval program (GLOP); its optimum is a proven
lower bound on the recompute time of every schedule that fits (when the model is complete).
Phase two turns the fractional flow of regions into schedules:

* a deterministic threshold sweep: for every distinct value ``t`` of the region variables,
  keep the intervals with ``x >= t``, most fractional mass first, skipping overlaps;
* the heaviest path of the flow (at every position, the largest outgoing arc);
* ``n_samples`` random paths through the flow (each arc taken with probability proportional
  to its flow), from a fixed seed;
* the greedy heuristic's schedule, so the result is never worse than greedy's.

When no candidate fits, two repairs follow. A dive: fix the largest fractional region
variable to 1 (to 0 when that makes the LP infeasible), solve the LP again, and repeat until
the LP solution is integral (then it fits) or infeasible. A hill climb on the ``n_repair``
lowest-peak candidates: add the LP-support interval (dropping the chosen ones it overlaps)
that brings the peak down most, then drop intervals no longer needed, with the interval model
as the exact, fast judge. Every candidate is then simulated; the cheapest that fits wins,
else the lowest-peak one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, keep_all_result, lowest_ranked, result_from_profile
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.engines.lp_engine import INFEASIBLE, OPTIMAL, LpRelaxation, lp_bound_s
from chkpt_opt.solvers.interval.model import IntervalModel
from chkpt_opt.solvers.interval.prepare import DEFAULT_MAX_POSITIONS, prepare
from chkpt_opt.solvers.keepset.warm_start import warm_start
from chkpt_opt.solvers.registry import register


def threshold_rounds(model: IntervalModel, x: list[float]) -> list[tuple[int, ...]]:
    """One set of disjoint intervals per distinct positive LP value (see the module doc)."""
    support = sorted(
        (k for k, v in enumerate(x) if v > 1e-9), key=lambda k: (-x[k], model.intervals[k].start)
    )
    rounds = []
    for t in sorted({round(x[k], 9) for k in support}, reverse=True):
        taken: list[int] = []
        used = [False] * model.n_ops
        for k in support:
            if x[k] < t - 1e-9:
                break
            iv = model.intervals[k]
            if not any(used[iv.start : iv.stop]):
                taken.append(k)
                for i in range(iv.start, iv.stop):
                    used[i] = True
        rounds.append(tuple(sorted(taken)))
    return rounds


def path_rounds(
    model: IntervalModel,
    z: list[float],
    x: list[float],
    starts: tuple[tuple[int, ...], ...],
    *,
    n_samples: int,
    seed: int,
) -> list[tuple[int, ...]]:
    """The heaviest path of the flow, then ``n_samples`` random paths (fixed seed)."""
    rng = random.Random(seed)
    rounds = []
    for sample in range(n_samples + 1):
        p, taken = 0, []
        while p < model.n_ops:
            arcs = [(max(z[p], 0.0), None)] + [(max(x[k], 0.0), k) for k in starts[p]]
            if sample == 0:
                _, k = max(arcs, key=lambda a: (a[0], -1 if a[1] is None else -a[1]))
            else:
                total = sum(w for w, _ in arcs)
                r = rng.random() * total
                k = arcs[-1][1]
                for w, kk in arcs:
                    r -= w
                    if r <= 0:
                        k = kk
                        break
            if k is None:
                p += 1
            else:
                taken.append(k)
                p = model.intervals[k].stop
        rounds.append(tuple(taken))
    return rounds


def repair(
    model: IntervalModel,
    chosen: tuple[int, ...],
    budget_bytes: int,
    moves: list[int],
    *,
    max_steps: int = 32,
) -> tuple[int, ...]:
    """Hill climb from ``chosen`` towards a set of intervals that fits (see the module doc)."""
    current = list(chosen)
    peak = model.peak_bytes(current)
    for _ in range(max_steps):
        if peak <= budget_bytes:
            break
        best: tuple[tuple[int, float], list[int], int] | None = None
        for k in moves:
            if k in current:
                continue
            new = model.intervals[k]
            trial = [
                c
                for c in current
                if model.intervals[c].stop <= new.start or model.intervals[c].start >= new.stop
            ] + [k]
            trial_peak = model.peak_bytes(trial)
            key = (max(0, trial_peak - budget_bytes), model.cost_s(trial))
            if trial_peak < peak and (best is None or key < best[0]):
                best = (key, trial, trial_peak)
        if best is None:
            break
        current, peak = best[1], best[2]
    if peak <= budget_bytes:
        for k in sorted(current, key=lambda c: -model.intervals[c].cost_s):
            trial = [c for c in current if c != k]
            if model.peak_bytes(trial) <= budget_bytes:
                current = trial
    return tuple(sorted(current))


def dive(lp: LpRelaxation, *, deadline: Deadline, max_rounds: int = 64) -> tuple[int, ...] | None:
    """Fixes the largest fractional region to 1 (else 0) and re-solves until the LP is integral.

    Returns the intervals of the integral solution, or None if the dive fails (LP
    infeasible, rounds or time exhausted). The LP is modified in place.
    """
    for _ in range(max_rounds):
        if deadline.expired():
            return None
        x = lp.x()
        fractional = [k for k, value in enumerate(x) if 1e-6 < value < 1 - 1e-6]
        if not fractional:
            return tuple(k for k, value in enumerate(x) if value > 0.5)
        k = max(fractional, key=lambda kk: (x[kk], -kk))
        lp.fix(k, 1.0)
        if lp.solve() != OPTIMAL:
            lp.fix(k, 0.0)  # one step of backtracking: forbid it instead
            if lp.solve() != OPTIMAL:
                return None
    return None


@register("lp_round", "Checkmate two-phase: LP relaxation (a lower bound), rounded and simulated")
@dataclass(frozen=True)
class LpRoundSolver:
    """LP relaxation and rounding: fast, with a proven lower bound, no optimality proof.

    Attributes:
        n_samples: random paths drawn from the LP flow.
        n_repair: candidates over the budget that are repaired (the lowest-peak ones).
        seed: seed of the random rounding.
        max_positions: see :class:`~chkpt_opt.solvers.keepset.cpsat.CpSatSolver`.
    """

    n_samples: int = 64
    n_repair: int = 4
    seed: int = 0
    max_positions: int | None = DEFAULT_MAX_POSITIONS
    name: str = "lp_round"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        deadline = Deadline.after(time_limit_s)
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, deadline=deadline)
        if trivial is not None:
            return trivial
        prepared = prepare(graph, max_positions=self.max_positions)
        model, program = prepared.model, prepared.program
        fallback, _ = warm_start(graph, budget_bytes, model, time_limit_s=deadline.remaining_s())

        lp = LpRelaxation.build(program, budget_bytes)
        lp.limit_time(deadline)
        status = lp.solve()
        stats: dict[str, Any] = {
            "candidate_positions": len(model.positions),
            "complete_model": model.complete,
            "intervals": len(model.intervals),
            "build_s": prepared.build_s,
            "lp_status": status,
        }
        bound = None
        proven_infeasible = status == INFEASIBLE and model.complete
        candidates: list[tuple[int, ...]] = []
        if status == OPTIMAL:
            lp_value = lp.value_s()
            stats["lp_bound_s"] = lp_value
            if model.complete:
                bound = lp_bound_s(lp_value, model)
            z = lp.z()
            x = lp.x()
            candidates = threshold_rounds(model, x) + path_rounds(
                model, z, x, program.starts, n_samples=self.n_samples, seed=self.seed
            )
            candidates = list(dict.fromkeys(candidates))
            peaks = {c: model.peak_bytes(c) for c in candidates}
            if not any(p <= budget_bytes for p in peaks.values()):
                dived = dive(lp, deadline=deadline)
                stats["dive"] = dived is not None
                moves = [k for k, value in enumerate(x) if value > 1e-6]
                worst = sorted(candidates, key=lambda c: (peaks[c], model.cost_s(c)))
                if dived is not None:
                    candidates.append(dived)
                candidates += [
                    repair(model, c, budget_bytes, moves) for c in worst[: self.n_repair]
                ]

        judged = 0
        schedules = [model.schedule(graph, c) for c in dict.fromkeys(candidates)]

        def simulated() -> Iterator[tuple[Schedule, MemoryProfile]]:
            nonlocal judged
            for schedule in [*schedules, fallback.schedule]:
                if judged and deadline.expired():
                    return
                judged += 1
                yield schedule, simulate(graph, schedule, check=False)

        chosen = lowest_ranked(simulated(), budget_bytes)
        assert chosen is not None
        stats["candidates_judged"] = judged
        if chosen[1].peak_bytes > budget_bytes and fallback.feasible:
            chosen = (fallback.schedule, simulate(graph, fallback.schedule))
        stats["infeasible_proven"] = proven_infeasible
        schedule, profile = chosen
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=deadline.elapsed_s(),
            bound=bound,
            stats=stats,
        )
