"""Chen et al.'s budget-driven greedy segmentation: the heuristic behind solver ``greedy``
and the warm start of the exact solvers (:mod:`chkpt_opt.solvers.keepset.warm_start`).

For a segment-size threshold ``b``, walk the ops in order adding up the bytes their
backward keeps; at the first candidate cut after the sum passes ``b``, cut and restart the
sum. Each segment becomes a recompute region (optionally all but the last, whose
recomputation would follow its forward pass at once). The thresholds are swept over a
geometric grid and every segmentation is judged by the simulator; the result is the
cheapest one that fits the budget, or the lowest-peak one when none does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.graphs.frozen import frozen_memo
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, lowest_ranked, result_from_profile
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.segments import candidate_cuts, spans_between

DEFAULT_THRESHOLDS = 48
"""Segment-size thresholds tried by default."""


def greedy_cuts(sizes: list[int], candidates: list[int], threshold: float) -> list[int]:
    """Cuts at the first candidate position after every ``threshold`` bytes of kept data."""
    cuts: list[int] = []
    is_candidate = set(candidates)
    acc = 0
    for p in range(1, len(sizes)):
        acc += sizes[p - 1]
        if acc > threshold and p in is_candidate:
            cuts.append(p)
            acc = 0
    return cuts


def greedy_sweep(
    graph: CostGraph,
    budget_bytes: int,
    *,
    n_thresholds: int = DEFAULT_THRESHOLDS,
    time_limit_s: float | None = None,
    solver: str = "greedy",
) -> SolveResult:
    """The threshold sweep of the module docstring, judged by the simulator.

    Args:
        graph: the cost graph.
        budget_bytes: the activation budget.
        n_thresholds: number of segment-size thresholds tried.
        time_limit_s: the sweep stops after the threshold at which this has passed.
        solver: the name the result carries.
    """
    deadline = Deadline.after(time_limit_s)
    # Inside a frozen block (auto's solve) a sweep that ran to its end is kept: auto's
    # keep-set stage and its cached-op search both start from it (a 2,248-op decoder: 7 s).
    memo = frozen_memo(graph)
    key = f"greedy_sweep:{budget_bytes}:{n_thresholds}"
    if memo is not None and key in memo:
        return dataclasses.replace(memo[key], solver=solver, solve_s=deadline.elapsed_s())
    order = ordered_nodes(graph)
    n = len(order)
    sizes = [graph.nodes[v]["saved_bytes"] + graph.nodes[v]["output_bytes"] for v in order]
    candidates = candidate_cuts(graph)
    total = max(1, sum(sizes))
    smallest = max(1, min((s for s in sizes if s > 0), default=1))
    tried: set[tuple[tuple[int, int], ...]] = set()
    steps = max(2, n_thresholds)
    timed_out = False

    def simulated() -> Iterator[tuple[Schedule, MemoryProfile]]:
        nonlocal timed_out
        for k in range(steps):
            threshold = smallest * (total / smallest) ** (k / (steps - 1))
            cuts = greedy_cuts(sizes, candidates, threshold)
            for skip_last in (False, True):
                spans = tuple(spans_between(cuts, n, skip_last=skip_last))
                if spans not in tried:
                    tried.add(spans)
                    schedule = Schedule.from_spans(graph, list(spans))
                    yield schedule, simulate(graph, schedule, check=False)
            if deadline.expired():
                timed_out = True
                return

    chosen = lowest_ranked(simulated(), budget_bytes)
    assert chosen is not None  # the first threshold is always judged
    keep_all = Schedule()
    base = simulate(graph, keep_all, check=False)
    if base.peak_bytes <= budget_bytes:
        chosen = (keep_all, base)
    schedule, profile = chosen
    result = result_from_profile(
        schedule,
        profile,
        budget_bytes=budget_bytes,
        solver=solver,
        solve_s=deadline.elapsed_s(),
        bound=0.0 if profile.recompute_s == 0 else None,
        stats={
            "segmentations": len(tried),
            "candidates": len(candidates),
            "timed_out": timed_out,
        },
    )
    if memo is not None and not timed_out:
        memo[key] = result
    return result
