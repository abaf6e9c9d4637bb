"""A schedule with cached ops rounded from the recompute bound's LP: a start beyond keep-set.

The LP of :mod:`chkpt_opt.solvers.bounds.recompute_bound` says, op by op, how much of it the
cheapest relaxed schedule recomputes (``recompute_share``). On a transformer layer at a
loose budget it recomputes the cheap elementwise ops (norms, rotary embeddings,
activations) and keeps the matmuls' outputs: a schedule no keep-set region can say (an op
outside every region keeps its *inputs*), but one region per stretch that caches what the
LP keeps can. This is the schedule family of selective activation checkpointing (a
region per layer, matmuls saved), chosen by the LP instead of by op names.

Rounding makes regions of the runs of ops whose share exceeds a threshold (runs at most
``gap`` ops apart merged, widened to allowed cuts), and also tries the graph's blocks
(:func:`~chkpt_opt.solvers.blocks.repeated.find_blocks`) as regions; inside each region it
caches the ops the LP keeps (share at most a second threshold) where a region may cache
(:func:`~chkpt_opt.memory_model.schedule.cache_candidates`), or the densest of them (forward seconds
per output byte) in fixed shares, or the longest prefix that fits the budget of them
densest first and costliest first, found by bisection. The layouts tried first are the
graph's repeated blocks and the model's own layers
(:func:`~chkpt_opt.solvers.blocks.repeated.layer_spans`), so that the family holds the layouts
of a model's own checkpointing: a region per layer, and selective activation
checkpointing's region per layer caching its matmuls, which the costliest-first prefix
meets at its own peak where the matmuls are the costliest ops. The simulator judges
every schedule; the cheapest that fits wins, else the lowest peak. A heuristic: it
claims no bound.

On Hugging Face Llama (``chkpt_opt.zoo.huggingface.llama()``: 384 ops, 6 layers;
roofline costs) at 63% of the keep-all peak it finds 0.020 s of recompute in 2 s, where
``auto`` over keep-set schedules finds 0.115 s in 20 s::

    python -c "import chkpt_opt; from chkpt_opt.zoo import huggingface as h
    from chkpt_opt.solvers.auto import AutoSolver
    from chkpt_opt.solvers.cached.cache_rounding import cache_rounding
    m, a, _ = h.llama(); g = chkpt_opt.trace(m, a)
    b = int(0.63 * chkpt_opt.simulate(g, chkpt_opt.Schedule()).peak_bytes)
    print(cache_rounding(g, b).objective,
          AutoSolver(general=False)(g, b, time_limit_s=20).objective)"

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> g = chain_graph(12, activation_bytes=1000)
    >>> r = cache_rounding(g, 9000)
    >>> r.solver, r.peak_bytes <= 9000 or not r.feasible
    ('cache_rounding', True)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.schedule import Schedule, cache_candidates, cut_positions
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.base import SolveResult, best_simulated, result_from_profile
from chkpt_opt.solvers.blocks.repeated import find_blocks, layer_spans
from chkpt_opt.solvers.bounds.recompute_bound import RecomputeBound, recompute_bound
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.keepset.bound_rounding import rounded_spans

REGION_THRESHOLDS = (0.5, 0.1, 0.01)
"""Shares above which an op is in a region, tried in turn."""

GAPS = (0, 4, 16, 64)
"""Runs of such ops at most this many ops apart become one region."""

CACHE_THRESHOLDS = (0.01, 0.1, 0.5)
"""Shares at or below which an op inside a region is cached, tried in turn."""

DENSEST_SHARES = (0.1, 0.2, 0.35, 0.5)
"""Shares of a layout's cacheable ops cached densest first, tried in turn."""


def cache_rounding(
    graph: CostGraph,
    budget_bytes: int,
    *,
    relaxed: RecomputeBound | None = None,
    deadline: Deadline = NO_DEADLINE,
) -> SolveResult:
    """The rounded schedule of the module docstring (named ``cache_rounding``).

    Args:
        graph: the cost graph.
        budget_bytes: the activation budget.
        relaxed: the recompute bound at this budget, if the caller has it (else it is
            solved within ``deadline``).
        deadline: no further schedule is judged once it has passed.
    """
    clock = Deadline.after(None)
    order = ordered_nodes(graph)
    if relaxed is None:
        relaxed = recompute_bound(graph, budget_bytes, deadline=deadline)
    share = relaxed.recompute_share

    probes = [0]

    def candidates() -> Iterator[Schedule]:
        for spans in _region_spans(graph, order, share):
            regions = Schedule.from_spans(graph, spans)
            cacheable = cache_candidates(graph, regions)
            dense = _densest_first(graph, cacheable)
            for saved in _cache_choices(dense, share):
                yield Schedule(regions.regions, saved=saved)
            for ranked in (dense, _costliest_first(graph, cacheable)):
                fitting, simulated = _longest_fitting_prefix(
                    graph, regions, ranked, budget_bytes, deadline
                )
                probes[0] += simulated
                if fitting is not None:
                    yield fitting

    schedule, profile, judged = best_simulated(graph, budget_bytes, candidates(), deadline=deadline)
    return result_from_profile(
        schedule,
        profile,
        budget_bytes=budget_bytes,
        solver="cache_rounding",
        solve_s=clock.elapsed_s(),
        stats={"schedules": judged, "prefix_probes": probes[0], "cached_ops": len(schedule.saved)},
    )


def _densest_first(graph: CostGraph, candidates: list[str]) -> list[str]:
    """``candidates`` by forward seconds per output byte, densest first (a transformer
    layer's norms' statistics and matmuls first); stable, so ties keep execution order."""
    nodes = graph.nodes
    return sorted(
        candidates,
        key=lambda v: -nodes[v]["fwd_time_s"] / max(1, sum(nodes[v]["outputs"].values())),
    )


def _costliest_first(graph: CostGraph, candidates: list[str]) -> list[str]:
    """``candidates`` by forward seconds, costliest first (stable): where the budget is
    tight, the densest prefix that fits may leave out a matmul that its cheap, small
    outputs (a norm's statistics) crowd out; this order keeps the matmuls together."""
    nodes = graph.nodes
    return sorted(candidates, key=lambda v: -nodes[v]["fwd_time_s"])


def _longest_fitting_prefix(
    graph: CostGraph,
    regions: Schedule,
    ranked: list[str],
    budget_bytes: int,
    deadline: Deadline,
) -> tuple[Schedule | None, int]:
    """The layout ``regions`` caching the longest prefix of ``ranked`` whose simulated peak
    fits ``budget_bytes``, by bisection on the prefix length (caching more holds more of
    the forward pass's tensors, so the peak mostly grows with it; where it does not, the
    prefix found fits but may not be the longest), with how many schedules the bisection
    simulated; None where caching nothing does not fit, or the deadline passed first.

    The fixed shares of :data:`DENSEST_SHARES` fall on either side of a cliff where one
    more cached matmul no longer fits. On Hugging Face Llama (``llama()``, roofline
    costs) at the peak of selective checkpointing's layout (a region per layer caching
    its 42 matmuls), the densest 0.35 of its 198 cacheable ops peak 110,592 B over it and
    the densest 0.2 recompute 3.0 times what the layout does; the longest densest prefix
    that fits recomputes 1.14 times (its norms' statistics crowd out a matmul), the
    longest costliest-first prefix that fits is the layout's own cached set (T5 alike:
    1.24 times, and its own set)."""

    def fits(length: int) -> bool:
        saved = frozenset(ranked[:length])
        return simulate(graph, Schedule(regions.regions, saved=saved)).peak_bytes <= budget_bytes

    probes = 1
    if not fits(0):
        return None, probes
    low, high = 0, len(ranked)  # fits(low); the answer is in [low, high]
    while low < high:
        if deadline.expired():
            return None, probes
        middle = (low + high + 1) // 2
        probes += 1
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return Schedule(regions.regions, saved=frozenset(ranked[:low])), probes


def _cache_choices(dense: list[str], share: Mapping[str, float]) -> list[frozenset[str]]:
    """The sets of cached ops tried in one region layout whose cacheable ops are ``dense``
    (:func:`_densest_first`): none; those the LP keeps (share at most each of
    :data:`CACHE_THRESHOLDS`); the densest, in prefixes of :data:`DENSEST_SHARES` of
    them."""
    choices = [frozenset()]
    for threshold in CACHE_THRESHOLDS:
        choices.append(frozenset(v for v in dense if share.get(v, 1.0) <= threshold))
    for fraction in DENSEST_SHARES:
        choices.append(frozenset(dense[: max(1, round(fraction * len(dense)))]))
    return list(dict.fromkeys(choices))


def _region_spans(
    graph: CostGraph, order: list[str], share: Mapping[str, float]
) -> list[list[tuple[int, int]]]:
    """The region layouts tried: the graph's repeated blocks first, then the model's own
    layers (:func:`~chkpt_opt.solvers.blocks.repeated.layer_spans`: the layout of its own
    checkpointing), then the rounded runs of every threshold and gap (distinct layouts
    only, in that order)."""
    layouts: list[list[tuple[int, int]]] = []
    blocks = find_blocks(graph)
    if blocks is not None:  # every segment whose kind repeats (encoder and decoder layers)
        counts = Counter(blocks.kinds)
        layouts.append(
            [span for span, kind in zip(blocks.segments, blocks.kinds) if counts[kind] > 1]
        )
    layouts.append(layer_spans(graph))
    allowed = cut_positions(graph)
    for threshold in REGION_THRESHOLDS:
        recomputed = [share.get(v, 0.0) > threshold for v in order]
        for gap in GAPS:
            layouts.append(rounded_spans(recomputed, allowed, gap=gap))
    distinct: list[list[tuple[int, int]]] = []
    for spans in layouts:
        if spans and spans not in distinct:
            distinct.append(spans)
    return distinct
