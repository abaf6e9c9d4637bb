"""Brute force: every valid keep-set schedule, judged by the simulator.

The reference the exact solvers are tested against. A schedule is a path through the
positions ``0..n``: from each position either the op there stays outside every region, or a
region starts there (at an allowed cut) and ends at a later allowed cut. Every such path is
simulated; the cheapest schedule that fits wins (ties: lower peak, then earlier regions), and
the lowest peak over all of them is the exact minimum feasible budget. The number of
schedules grows like 2.6**n, so this is for graphs of up to about 12-14 ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule, cut_positions
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, SolveStatus, result_from_profile
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.keepset.choice import count_schedules
from chkpt_opt.solvers.registry import register

Spans = tuple[tuple[int, int], ...]


def all_spans(graph: CostGraph) -> Iterator[Spans]:
    """Every valid schedule as its ``[start, stop)`` region spans, in a fixed order."""
    ok = cut_positions(graph)
    n = len(ok) - 1

    def walk(p: int) -> Iterator[Spans]:
        if p == n:
            yield ()
            return
        yield from walk(p + 1)
        if ok[p]:
            for q in range(p + 1, n + 1):
                if ok[q]:
                    for rest in walk(q):
                        yield ((p, q), *rest)

    yield from walk(0)


@dataclass(frozen=True)
class Evaluated:
    """One enumerated schedule and what the simulator says of it."""

    spans: Spans
    peak_bytes: int
    recompute_s: float


def evaluate_all(
    graph: CostGraph, *, time_limit_s: float | None = None
) -> tuple[list[Evaluated], bool]:
    """Simulates every valid schedule.

    Returns:
        ``(evaluated, complete)``: the schedules in enumeration order, and False when the time
        limit stopped the enumeration early.
    """
    deadline = Deadline.after(time_limit_s)
    out: list[Evaluated] = []
    for k, spans in enumerate(all_spans(graph)):
        if k % 256 == 0 and deadline.expired():
            return out, False
        profile = simulate(graph, Schedule.from_spans(graph, list(spans)), check=False)
        out.append(Evaluated(spans, profile.peak_bytes, profile.recompute_s))
    return out, True


def pareto_front(evaluated: list[Evaluated]) -> list[Evaluated]:
    """The schedules no other beats on both peak and recompute time, by increasing peak."""
    front: list[Evaluated] = []
    for e in sorted(evaluated, key=lambda e: (e.peak_bytes, e.recompute_s, e.spans)):
        if not front or e.recompute_s < front[-1].recompute_s:
            front.append(e)
    return front


def best_for_budget(evaluated: list[Evaluated], budget_bytes: int) -> Evaluated | None:
    """The cheapest schedule that fits (ties: lower peak, then the spans), or None."""
    fits = [e for e in evaluated if e.peak_bytes <= budget_bytes]
    if not fits:
        return None
    return min(fits, key=lambda e: (e.recompute_s, e.peak_bytes, e.spans))


@register("enumerate", "brute force over every schedule through the simulator (tiny graphs)")
@dataclass(frozen=True)
class EnumerateSolver:
    """Exhaustive search: proven optimal, or proven infeasible with the exact minimum peak.

    Attributes:
        max_schedules: refuse graphs with more valid schedules than this.
    """

    max_schedules: int = 2_000_000
    name: str = "enumerate"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        deadline = Deadline.after(time_limit_s)
        count = count_schedules(graph)
        if count > self.max_schedules:
            raise SolverError(
                f"graph {graph.graph.get('name', '')!r} has {count} valid schedules, more than "
                f"max_schedules={self.max_schedules}; use solver 'cpsat' (or 'auto'), or raise "
                "max_schedules."
            )
        evaluated, complete = evaluate_all(graph, time_limit_s=deadline.remaining_s())
        stats = {"schedules": count, "evaluated": len(evaluated), "complete": complete}
        best = best_for_budget(evaluated, budget_bytes)
        if evaluated:
            lowest = min(evaluated, key=lambda e: (e.peak_bytes, e.recompute_s, e.spans))
            stats["min_peak_bytes"] = lowest.peak_bytes
            if best is None:  # recorded as the other exact solvers record it
                stats["min_feasible_bytes"] = lowest.peak_bytes
                stats["min_feasible_proven"] = complete
                stats["min_feasible_lower_bytes"] = lowest.peak_bytes if complete else None
        chosen = best or (lowest if evaluated else Evaluated((), 0, 0.0))
        schedule = Schedule.from_spans(graph, list(chosen.spans))
        profile: MemoryProfile = simulate(graph, schedule)
        result = result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=deadline.elapsed_s(),
            bound=profile.recompute_s if complete and best else None,
            proven_optimal=complete,
            proven_infeasible=complete,
            stats=stats,
        )
        if not complete and not result.feasible:
            result = dataclasses.replace(result, status=SolveStatus.TIMED_OUT)
        return result
