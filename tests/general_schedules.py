"""Random general schedules (nested regions, cached ops) of a cost graph, for tests."""

from __future__ import annotations

import random
from collections.abc import Iterator

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.schedule import (
    Schedule,
    cache_candidates,
    cut_positions,
)
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate


def random_general_schedule(
    graph: CostGraph, rng: random.Random, *, depth: int = 3, cache_share: float = 0.3
) -> Schedule:
    """A valid schedule with random outermost regions, regions nested inside them up to
    ``depth`` levels, and a random share of cacheable ops cached."""
    order = ordered_nodes(graph)
    ok = cut_positions(graph)
    cuts = [p for p in range(len(order) + 1) if ok[p]]

    def spans_in(lo: int, hi: int, proper: bool) -> list[tuple[int, int]]:
        inside = [p for p in cuts if lo <= p <= hi]
        picked = sorted(rng.sample(inside, min(len(inside), rng.randint(0, 4) * 2)))
        spans = [(a, b) for a, b in zip(picked[::2], picked[1::2]) if b > a]
        return [s for s in spans if not proper or s != (lo, hi)]

    top = spans_in(0, len(order), proper=False)
    nested: list[tuple[int, int]] = []
    frontier = list(top)
    for _ in range(depth - 1):
        found = [s for lo, hi in frontier for s in spans_in(lo, hi, proper=True)]
        nested += found
        frontier = found
    schedule = Schedule(
        regions=tuple(tuple(order[a:b]) for a, b in top),
        nested=tuple(
            tuple(order[a:b]) for a, b in sorted(set(nested), key=lambda s: (s[0], -s[1]))
        ),
    )
    saved = frozenset(n for n in cache_candidates(graph, schedule) if rng.random() < cache_share)
    return Schedule(regions=schedule.regions, nested=schedule.nested, saved=saved)


def schedules_and_profiles(
    graph: CostGraph, count: int, *, seed: int = 7
) -> Iterator[tuple[Schedule, MemoryProfile]]:
    """``count`` random general schedules of ``graph`` (every third caching nothing) with
    their simulated profiles: each is a schedule that fits a budget of its own peak."""
    rng = random.Random(seed)
    for k in range(count):
        schedule = random_general_schedule(graph, rng, cache_share=0.0 if k % 3 == 0 else 0.3)
        yield schedule, simulate(graph, schedule)
