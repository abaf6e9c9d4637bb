"""Brute force over general schedules of a tiny graph: the exact optimum beyond keep-set.

Every laminar family of regions over the allowed cut positions (outermost regions, regions
nested in them to any depth) with every subset of cacheable ops cached, judged by the
simulator. The count grows very fast: graphs of at most about six allowed segments only.
Tests compare the general-space solvers with it; it is not a registered solver.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.schedule import (
    Schedule,
    cache_candidates,
    check_schedule,
    cut_positions,
)
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate

Span = tuple[int, int]


def _laminar(cuts: list[int], lo: int, hi: int, proper: bool) -> Iterator[list[Span]]:
    """Every set of disjoint spans inside ``[lo, hi)`` (boundaries at ``cuts``), each with
    every laminar family inside it; ``proper`` excludes the span ``[lo, hi)`` itself."""
    inside = [c for c in cuts if lo <= c <= hi]
    spans = [
        (a, b) for a, b in itertools.combinations(inside, 2) if not (proper and (a, b) == (lo, hi))
    ]

    def chains(start: int) -> Iterator[list[Span]]:
        yield []
        for a, b in spans:
            if a >= start:
                for rest in chains(b):
                    yield [(a, b), *rest]

    for top in chains(lo):
        families: list[list[list[Span]]] = [
            [[s, *sub] for sub in _laminar(cuts, s[0], s[1], proper=True)] for s in top
        ]
        for combo in itertools.product(*families):
            yield [span for family in combo for span in family]


def general_schedules(
    graph: CostGraph, *, max_schedules: int = 200_000, cache: bool = True, nesting: bool = True
) -> Iterator[Schedule]:
    """Every valid general schedule of ``graph`` (raises past ``max_schedules``); with
    ``cache=False`` only those that cache nothing (nested regions alone), with
    ``nesting=False`` only those with one level of regions."""
    order = ordered_nodes(graph)
    ok = cut_positions(graph)
    cuts = [p for p in range(len(order) + 1) if ok[p]]
    count = 0
    for family in _laminar(cuts, 0, len(order), proper=False):
        family = sorted(family, key=lambda s: (s[0], -s[1]))
        outer = [
            s for s in family if not any(o[0] <= s[0] and s[1] <= o[1] and o != s for o in family)
        ]
        if not nesting and len(outer) < len(family):
            continue
        base = Schedule(
            regions=tuple(tuple(order[a:b]) for a, b in outer),
            nested=tuple(tuple(order[a:b]) for a, b in family if (a, b) not in outer),
        )
        choices = cache_candidates(graph, base) if cache else []
        for k in range(len(choices) + 1):
            for saved in itertools.combinations(choices, k):
                count += 1
                if count > max_schedules:
                    raise ScheduleError(
                        f"graph {graph.graph.get('name', '')!r} has more than {max_schedules} "
                        "general schedules; brute force is for tiny graphs."
                    )
                schedule = Schedule(base.regions, base.nested, frozenset(saved))
                check_schedule(graph, schedule)
                yield schedule


def general_optimum(
    graph: CostGraph,
    budget_bytes: int,
    *,
    cache: bool = True,
    nesting: bool = True,
    within: Callable[[Schedule], bool] | None = None,
) -> tuple[Schedule, MemoryProfile] | None:
    """The cheapest general schedule within ``budget_bytes`` (ties: lower peak), or None;
    ``cache=False``: among those that cache nothing; ``nesting=False``: among those with
    one level of regions; ``within``: among those it accepts."""
    best: tuple[Schedule, MemoryProfile] | None = None
    for schedule in general_schedules(graph, cache=cache, nesting=nesting):
        if within is not None and not within(schedule):
            continue
        profile = simulate(graph, schedule, check=False)
        if profile.peak_bytes > budget_bytes:
            continue
        key = (profile.recompute_s, profile.peak_bytes)
        if best is None or key < (best[1].recompute_s, best[1].peak_bytes):
            best = (schedule, profile)
    return best


def general_smallest_peak(graph: CostGraph, *, cache: bool = True) -> int:
    """The lowest peak of any general schedule of ``graph`` (``cache=False``: of those that
    cache nothing)."""
    return min(
        simulate(graph, s, check=False).peak_bytes for s in general_schedules(graph, cache=cache)
    )
