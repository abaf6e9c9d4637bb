"""Multi-level schedules: regions nested inside regions, searched over a family of shapes.

One level of regions keeps about ``2 sqrt(n)`` segments' worth of memory on a chain.
Nested non-reentrant checkpoints go lower: a region whose inner regions tile it keeps, while
one inner region is differentiated, only the inputs of the others (recomputed with it), and
an inner region nested at the start of its parent (a *prefix*) is recomputed from the
parent's input each time the parent's later ops need their inputs, which costs quadratic
compute for constant memory, as Revolve does with one checkpoint.

The family: the allowed cut positions of :func:`~chkpt_opt.solvers.segments.candidate_cuts`
split the graph into ``k`` outermost regions; each is split into ``m1`` inner regions, each
of those into ``m2``, and so on (``levels``); at the bottom, a region of more than one
segment may be unrolled into prefixes of ``prefix`` segments each. Every shape is judged by
the simulator (the one memory model), and the cheapest that fits wins; none fitting, the
lowest peak. The search is a heuristic over that family: its result is ``feasible`` (or
``infeasible``) and never claims a bound.

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> g = chain_graph(16, activation_bytes=1000)
    >>> r = NestedSolver()(g, 6000)
    >>> r.feasible, r.peak_bytes <= 6000
    (True, True)
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.replay_cost import recomputed_ops
from chkpt_opt.memory_model.schedule import Schedule, check_schedule, nesting_allowed
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, lowest_ranked, result_from_profile
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.registry import register
from chkpt_opt.solvers.segments import candidate_cuts

Span = tuple[int, int]


@dataclass(frozen=True)
class Shape:
    """One member of the family.

    Attributes:
        outer: number of outermost regions.
        levels: inner regions per region, level by level from the outside in.
        prefix: segments per prefix at the bottom (0: no prefixes).
    """

    outer: int
    levels: tuple[int, ...]
    prefix: int


def _even(cuts: list[int], lo: int, hi: int, parts: int) -> list[Span]:
    """``[lo, hi)`` split into ``parts`` spans at cut positions spread evenly among those
    strictly inside it (fewer spans when there are not enough cuts)."""
    inside = [c for c in cuts if lo < c < hi]
    if parts <= 1 or not inside:
        return [(lo, hi)]
    step = len(inside) / parts
    chosen = sorted({inside[min(len(inside) - 1, round(step * j) - 1)] for j in range(1, parts)})
    bounds = [lo, *chosen, hi]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def shape_spans(cuts: list[int], n: int, shape: Shape) -> tuple[list[Span], list[Span]]:
    """The outermost and the nested spans of ``shape`` over ``n`` ops."""
    outer = _even(cuts, 0, n, shape.outer)
    nested: list[Span] = []
    frontier = outer
    for parts in shape.levels:
        below: list[Span] = []
        for lo, hi in frontier:
            children = _even(cuts, lo, hi, parts)
            if len(children) > 1:
                below += children
        nested += below
        frontier = below
    if shape.prefix:
        for lo, hi in frontier if shape.levels else outer:
            inside = [c for c in cuts if lo < c < hi]
            ends = inside[shape.prefix - 1 :: shape.prefix]
            nested += [(lo, end) for end in ends]
    return outer, sorted(set(nested), key=lambda s: (s[0], -s[1]))


def shapes(n_cuts: int, *, max_levels: int, max_branch: int) -> Iterator[Shape]:
    """The family, shallow shapes first."""
    outer_counts = sorted({max(1, round(math.sqrt(n_cuts + 1) * f)) for f in (0.25, 0.5, 1.0)})
    outer_counts = sorted(set(outer_counts) | {1, 2, 3, 4})
    for depth in range(max_levels + 1):
        for levels in itertools.product(range(2, max_branch + 1), repeat=depth):
            for prefix in (0, 1, 2, 4):
                for outer in outer_counts:
                    if outer <= n_cuts + 1:
                        yield Shape(outer, levels, prefix)


@register("nested", "multi-level schedules: nested regions and prefixes over a family of shapes")
@dataclass(frozen=True)
class NestedSolver:
    """The cheapest schedule that fits among nested shapes (a heuristic; no bound).

    Attributes:
        max_levels: most levels of inner regions below the outermost ones.
        max_branch: most inner regions per region and level.
    """

    max_levels: int = 3
    max_branch: int = 4
    name: str = "nested"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        deadline = Deadline.after(time_limit_s)
        order = ordered_nodes(graph)
        n = len(order)
        cuts = candidate_cuts(graph)
        tried = skipped = 0
        seen: set[tuple[tuple[Span, ...], tuple[Span, ...]]] = set()
        timed_out = False
        may_nest = nesting_allowed(graph)
        # Seconds per op-sequence step of the shapes simulated so far: a shape whose
        # sequence would take longer to simulate than the time left is skipped (a prefix
        # shape of a 32-layer decoder runs 370,000 recomputations).
        simulated_s, simulated_steps = 0.0, 0

        def simulated() -> Iterator[tuple[tuple[Schedule, Shape], MemoryProfile]]:
            nonlocal tried, skipped, timed_out, simulated_s, simulated_steps
            for shape in shapes(len(cuts), max_levels=self.max_levels, max_branch=self.max_branch):
                if deadline.expired():
                    timed_out = True
                    return
                if not may_nest and (shape.levels or shape.prefix):
                    continue  # see nesting_allowed: one level of regions only
                outer, nested = shape_spans(cuts, n, shape)
                key = (tuple(outer), tuple(nested))
                if key in seen:
                    continue
                seen.add(key)
                schedule = Schedule(
                    regions=tuple(tuple(order[a:b]) for a, b in outer),
                    nested=tuple(tuple(order[a:b]) for a, b in nested),
                )
                try:
                    check_schedule(graph, schedule)
                except ScheduleError:
                    continue
                steps = 2 * n + len(recomputed_ops(graph, schedule))  # forward, backward, replays
                left_s = deadline.remaining_s()
                if (
                    left_s is not None
                    and simulated_steps
                    and simulated_s / simulated_steps * steps > left_s
                ):
                    skipped += 1
                    continue
                tried += 1
                clock = time.perf_counter()
                profile = simulate(graph, schedule, check=False)
                simulated_s += time.perf_counter() - clock
                simulated_steps += steps
                yield (schedule, shape), profile

        best = lowest_ranked(simulated(), budget_bytes)
        if best is None:
            best = ((Schedule(), Shape(0, (), 0)), simulate(graph, Schedule()))
        (schedule, shape), profile = best
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            stats={
                "space": "general",
                "shapes_tried": tried,
                "outer": shape.outer,
                "levels": list(shape.levels),
                "prefix": shape.prefix,
                "nested_regions": len(schedule.nested),
                "nesting_allowed": may_nest,
                "search_cut_by_time_limit": timed_out or skipped > 0,
                "shapes_skipped_for_time": skipped,
            },
        )
