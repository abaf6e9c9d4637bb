"""Per-op save or recompute inside regions: local search from a schedule.

Outside every region an op keeps what its backward needs, which for a cheap op between two
expensive ones (a ReLU or a pool between convolutions) is a whole activation kept to save
almost no compute. A region that takes in that op *and caches the expensive consumer's
outputs* (a selective-checkpoint ``MUST_SAVE``) keeps only the consumer's output and
recomputes the cheap op from a tensor kept anyway. Keep-set schedules cannot say this.

Starting from a schedule (the caller's warm start, else the greedy heuristic's keep-set
schedule at the same budget), the search moves one step at a time to the best neighbour,
judged by the simulator: cache or uncache one op of a region, or move a boundary of an
outermost region to the next allowed cut (taking in or giving out ops, the ops taken in
cached or not), split a region right after one of its cached ops, or open a new region
between two allowed cuts, or drop a region; and unpack or stop unpacking one op outside
every region whose output ops outside every region save (recompute on unpack:
:mod:`chkpt_opt.memory_model.unpack`), or give ops out of a region unpacked. It searches from the
warm start, then from it with its cheap ops worth unpacking unpacked and with all of them
(:func:`unpacked_starts`), and keeps the best end. Each search stops when no neighbour is
better (cheaper while fitting; while nothing fits, the most peak lowered per second of
recompute added: :func:`best_move`) or at the time limit. The
start is a neighbour of itself, so the result
is never worse than the warm start. A heuristic: ``feasible`` at best, no bound.

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> g = chain_graph(8, activation_bytes=1000)
    >>> r = CachingSolver()(g, 10**9)
    >>> r.feasible
    True
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.graphs.frozen import frozen
from chkpt_opt.memory_model.replay_cost import recompute_s
from chkpt_opt.memory_model.schedule import (
    Schedule,
    cache_candidates,
    cacheable_ops,
    caching_allowed,
    check_schedule,
    cut_positions,
)
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.memory_model.unpack import unpack_candidates
from chkpt_opt.solvers.base import SolveResult, lowest_ranked, rank, result_from_profile
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.heuristics.greedy_sweep import greedy_sweep
from chkpt_opt.solvers.registry import register


def neighbours(
    graph: CostGraph, schedule: Schedule, allowed: frozenset[str], *, unpack: bool = True
) -> Iterator[Schedule]:
    """Schedules one move away from ``schedule`` (possibly invalid ones; the caller checks).

    A move that takes an unpacked op into a region stops unpacking it; with ``unpack``, a
    move that gives ops out of a region is also tried with those of them worth unpacking
    unpacked, and unpacking or no longer unpacking each op is a move of its own."""
    before = _in_regions(schedule)
    for moved in _region_moves(graph, schedule, allowed):
        inside = _in_regions(moved)
        kept = schedule.unpacked - inside
        yield moved.with_unpacked(kept)
        given = before - inside
        if unpack and given:
            new = frozenset(unpack_candidates(graph, inside)) & given
            if new:
                yield moved.with_unpacked(kept | new)
    if unpack:
        for name in unpack_candidates(graph, before, schedule.unpacked):
            if name not in schedule.unpacked:
                yield schedule.with_unpacked(schedule.unpacked | {name})
        for name in sorted(schedule.unpacked):
            yield schedule.with_unpacked(schedule.unpacked - {name})


def _in_regions(schedule: Schedule) -> frozenset[str]:
    return frozenset(n for region in schedule.regions for n in region)


def _region_moves(
    graph: CostGraph, schedule: Schedule, allowed: frozenset[str]
) -> Iterator[Schedule]:
    """The moves of regions and cached ops (the module docstring); they carry no unpacked
    op (:func:`neighbours` adds them)."""
    order = ordered_nodes(graph)
    n = len(order)
    for name in cache_candidates(graph, schedule):
        if name in schedule.saved:
            yield Schedule(schedule.regions, schedule.nested, schedule.saved - {name})
        else:
            yield Schedule(schedule.regions, schedule.nested, schedule.saved | {name})
    ok = cut_positions(graph)
    spans = schedule.spans(graph)
    # A new region over each run of ops between two allowed cuts outside every region,
    # plain or with its ops cached.
    free = [p for p in range(n + 1) if ok[p] and not any(a < p < b for a, b in spans)]
    for a, b in itertools.pairwise(free):
        if any(a < y and b > x for x, y in spans):
            continue
        regions = tuple(sorted((*schedule.regions, tuple(order[a:b])), key=_first(graph)))
        yield Schedule(regions, schedule.nested, schedule.saved)
        new = frozenset(order[i] for i in range(a, b) if order[i] in allowed)
        if new and caching_allowed(graph, a, b):
            yield Schedule(regions, schedule.nested, schedule.saved | new)
    for r, (start, stop) in enumerate(spans):
        lower = spans[r - 1][1] if r > 0 else 0
        upper = spans[r + 1][0] if r + 1 < len(spans) else n
        inside_nested = any(a < stop and b > start for a, b in _nested_spans(graph, schedule))
        moves = []
        grow_right = next((p for p in range(stop + 1, upper + 1) if ok[p]), None)
        grow_left = next((p for p in range(start - 1, lower - 1, -1) if ok[p]), None)
        if grow_right is not None:
            moves.append((start, grow_right, range(stop, grow_right)))
        if grow_left is not None:
            moves.append((grow_left, stop, range(grow_left, start)))
        if not inside_nested:
            shrink_right = next((p for p in range(stop - 1, start, -1) if ok[p]), None)
            shrink_left = next((p for p in range(start + 1, stop) if ok[p]), None)
            if shrink_right is not None:
                moves.append((start, shrink_right, range(0)))
            if shrink_left is not None:
                moves.append((shrink_left, stop, range(0)))
        if not inside_nested:  # drop the region
            rest = frozenset(
                s for s in schedule.saved if not start <= graph.nodes[s]["index"] < stop
            )
            regions = schedule.regions[:r] + schedule.regions[r + 1 :]
            yield Schedule(regions, schedule.nested, rest)
        if not inside_nested:  # split the region right after one of its cached ops
            for i in range(start, stop - 1):
                if order[i] in schedule.saved and ok[i + 1]:
                    regions = list(schedule.regions)
                    regions[r : r + 1] = [tuple(order[start : i + 1]), tuple(order[i + 1 : stop])]
                    yield Schedule(tuple(regions), schedule.nested, schedule.saved)
        for a, b, taken in moves:
            regions = list(schedule.regions)
            regions[r] = tuple(order[a:b])
            kept = frozenset(s for s in schedule.saved if a <= graph.nodes[s]["index"] < b)
            rest = frozenset(
                s
                for s in schedule.saved
                if not spans[r][0] <= graph.nodes[s]["index"] < spans[r][1]
            )
            base = Schedule(tuple(regions), schedule.nested, kept | rest)
            yield base
            new = frozenset(order[i] for i in taken if order[i] in allowed)
            if new and caching_allowed(graph, a, b):
                yield Schedule(base.regions, base.nested, base.saved | new)


def best_move(
    judged: list[tuple[Schedule, MemoryProfile]], profile: MemoryProfile, budget_bytes: int
) -> tuple[Schedule, MemoryProfile] | None:
    """The neighbour to move to from a schedule simulated as ``profile``, or None where no
    neighbour is better: the best ranked (:func:`~chkpt_opt.solvers.base.rank`) where it or
    the schedule fits; while neither fits, the one that lowers the peak most per second of
    recompute it adds (the most bytes where it adds none), so that a search from a start
    far above the budget does not buy its first bytes at any cost; where none lowers the
    peak, the cheapest of the same peak."""
    best = lowest_ranked(judged, budget_bytes)
    if best is None:
        return None
    if best[1].peak_bytes <= budget_bytes or profile.peak_bytes <= budget_bytes:
        return best if rank(best[1], budget_bytes) < rank(profile, budget_bytes) else None
    lower = [pair for pair in judged if pair[1].peak_bytes < profile.peak_bytes]

    def gain(pair: tuple[Schedule, MemoryProfile]) -> tuple[int, float]:
        added_s = pair[1].recompute_s - profile.recompute_s
        saved_bytes = profile.peak_bytes - pair[1].peak_bytes
        return (0, -saved_bytes) if added_s <= 0 else (1, -saved_bytes / added_s)

    if lower:
        return min(lower, key=gain)
    # the same peak, cheaper: a step aside that may open lower peaks
    return best if rank(best[1], budget_bytes) < rank(profile, budget_bytes) else None


def _above(cap_s: float) -> float:
    """Just above ``cap_s``: :func:`~chkpt_opt.memory_model.replay_cost.recompute_s` and the
    simulator add the same times in different orders."""
    return cap_s * (1 + 1e-9) + 1e-15


CHEAP_SHARE = 0.05
"""An op worth unpacking is *cheap* where its forward time is below this share of the
mean forward time of the graph's ops (pools, unpools, concats beside convolutions)."""


def unpacked_starts(graph: CostGraph, schedule: Schedule) -> list[Schedule]:
    """``schedule`` with more ops unpacked: its cheap ops worth unpacking
    (:func:`~chkpt_opt.memory_model.unpack.unpack_candidates`, :data:`CHEAP_SHARE`), and every op
    worth unpacking; and, where it has regions, no region and the cheap ops unpacked (the search
    then adds the regions it needs). Empty where no op is worth unpacking."""
    found = unpack_candidates(graph, _in_regions(schedule))
    if not found:
        return []
    # and the ops whose outputs those ops read, unpacked as well: chains of cheap ops
    while True:
        more = unpack_candidates(graph, _in_regions(schedule), frozenset(found))
        if len(more) == len(found):
            break
        found = more
    times = [a["fwd_time_s"] for _, a in graph.nodes(data=True)]
    cheap_s = CHEAP_SHARE * sum(times) / len(times)

    def times_s(node: str) -> float:
        return float(graph.nodes[node]["fwd_time_s"])

    cheap = frozenset(n for n in found if times_s(n) < cheap_s)
    starts = [schedule.with_unpacked(schedule.unpacked | cheap)] if cheap else []
    if len(cheap) < len(found):
        starts.append(schedule.with_unpacked(schedule.unpacked | frozenset(found)))
    if schedule.regions:  # no region: the cheap ops unpacked alone, the search adds regions
        alone = frozenset(n for n in unpack_candidates(graph, frozenset()) if times_s(n) < cheap_s)
        while alone:
            more = frozenset(
                n for n in unpack_candidates(graph, frozenset(), alone) if times_s(n) < cheap_s
            )
            if more == alone:
                break
            alone = more
        if alone:
            starts.append(Schedule(unpacked=alone))
    return starts


def _first(graph: CostGraph) -> Callable[[tuple[str, ...]], int]:
    return lambda region: graph.nodes[region[0]]["index"]


def _nested_spans(graph: CostGraph, schedule: Schedule) -> list[tuple[int, int]]:
    return [
        (graph.nodes[r[0]]["index"], graph.nodes[r[0]]["index"] + len(r)) for r in schedule.nested
    ]


@register("cached", "local search over cached ops and region boundaries from a warm start")
@dataclass(frozen=True)
class CachingSolver:
    """Per-op save/recompute decisions from a warm start (a heuristic; no bound).

    Attributes:
        warm_start: the schedule to start from; None: greedy's schedule at the budget.
        max_moves: most improving moves taken.
        unpack: also move unpacked ops (recompute on unpack), and search again from the
            warm start with the ops worth unpacking unpacked (:func:`unpacked_starts`),
            keeping the best end.
    """

    warm_start: Schedule | None = None
    max_moves: int = 200
    unpack: bool = True
    name: str = "cached"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        with frozen(graph):  # thousands of simulations of one graph: its facts once
            return self._search(graph, budget_bytes, time_limit_s)

    def _search(
        self, graph: CostGraph, budget_bytes: int, time_limit_s: float | None
    ) -> SolveResult:
        start = time.perf_counter()
        deadline = Deadline.after(time_limit_s)
        current = self.warm_start
        if current is None:
            current = greedy_sweep(
                graph, budget_bytes, time_limit_s=deadline.remaining_s()
            ).schedule
        check_schedule(graph, current)
        allowed = cacheable_ops(graph)
        starts = [current, *(unpacked_starts(graph, current) if self.unpack else [])]
        counts = {"moves": 0, "tried": 0, "passed_over": 0}
        timed_out = False

        def descend(current: Schedule) -> tuple[Schedule, MemoryProfile]:
            """The search from one start, until no neighbour is better."""
            nonlocal timed_out
            profile = simulate(graph, current, check=False)

            def simulated() -> Iterator[tuple[Schedule, MemoryProfile]]:
                nonlocal timed_out
                # Where the schedule fits, only a fitting neighbour at most as costly as
                # the cheapest fitting one so far can be the move (best_move): the others
                # are passed over on their recompute alone, which takes a fraction of a
                # simulation; the move chosen is the same.
                cap_s = profile.recompute_s if profile.peak_bytes <= budget_bytes else None
                for candidate in neighbours(graph, current, allowed, unpack=self.unpack):
                    if deadline.expired():
                        timed_out = True
                        return
                    try:
                        check_schedule(graph, candidate)
                    except ScheduleError:
                        continue
                    counts["tried"] += 1
                    if cap_s is not None and recompute_s(graph, candidate) > _above(cap_s):
                        counts["passed_over"] += 1
                        continue
                    judged = simulate(graph, candidate, check=False)
                    if cap_s is not None and judged.peak_bytes <= budget_bytes:
                        cap_s = min(cap_s, judged.recompute_s)
                    yield candidate, judged

            for _ in range(self.max_moves):
                if timed_out:
                    break
                best = best_move(list(simulated()), profile, budget_bytes)
                if best is None:
                    break
                current, profile = best
                counts["moves"] += 1
            return current, profile

        # The warm start first: a search cut by the time limit keeps what it reached.
        ends = [descend(starts[0])]
        ends += [descend(s) for s in starts[1:] if not timed_out]
        found = lowest_ranked(ends, budget_bytes)
        assert found is not None  # the warm start's descent always ends
        current, profile = found
        moves, tried = counts["moves"], counts["tried"]
        return result_from_profile(
            current,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            stats={
                "space": "general",
                "moves": moves,
                "neighbours_tried": tried,
                "neighbours_passed_over": counts["passed_over"],
                "cached_ops": len(current.saved),
                "unpacked_ops": len(current.unpacked),
                "search_cut_by_time_limit": timed_out,
            },
        )
