"""A staged schedule rounded from the recompute bound's LP (``staged_rounding``).

The LP of :mod:`chkpt_opt.solvers.bounds.recompute_bound` says, op by op, how much of it the
cheapest relaxed schedule recomputes (``recompute_share``). On a decoder at its layer
checkpointing's peak it recomputes the norms, activations and rotary embeddings of every
layer and the MLP matmuls of some, and keeps the residual stream and attention's outputs: a
choice per op that regions with cached ops express only at the price of replaying
everything between a region's start and its last saved op, and of keeping each region's
inputs. A staged schedule (:mod:`chkpt_opt.memory_model.staged`) says it as it is: each op
the LP recomputes runs again just before the first backward op that needs it (one that
unpacks what it made, or the stage of another recomputation that reads it), once, and
what it makes is kept to its last use.

Rounding recomputes the ops whose share is at least a threshold (the distinct shares, from
the highest; ops a staged schedule may not recompute are kept). Where nothing fits, the LP
is solved again at a budget lowered by the lowest peak's excess, or halfway to the floor where
that excess would take it below (GPT-2 halfway to its floor: the roundings ended there with
nothing that fits), and rounded likewise (at most :data:`MAX_ROUNDS` LPs, until a rounding
fits as it is).

Each round's lowest rounding, where it peaks at most :data:`OUT_OF_REACH` times the budget,
is judged at once with its *pulled* values recomputed once more at their own first use
(:meth:`~chkpt_opt.solvers.staged.stager.Stager.pulled`: values a reader's recomputation
pulls to an earlier stage, and that would be held from there), the cheapest quarter of them
first, then half, three quarters and all, until one fits; the other roundings that do not
fit, likewise after the first trim. Those schedules do not end the rounds (they fit at a
price the lowered LPs often beat). From the cheapest schedule that fits, recomputed ops are
dropped one at a time, costliest first, while it still fits and costs less, then its extra
recomputations likewise (the trim). Then the lowest rounding of each round, as it is and with
its pulled values recomputed again, is repaired, in turn: split first, where a recomputed
value the peak (a backward step, or a recomputation in the stage before one) holds for a
later step is recomputed once more at that step instead (with the recomputed ops it reads),
one at a time while the peak falls; failing that, beside its ops, the shortest prefix that
fits of the other ops, fewest forward seconds per byte first (bisection). Last, the cheapest
fits not made by a trim are trimmed in turn (at most :data:`TRIM_STARTS` more): a trim ends
where no single op can go, and from another start it may end lower. The simulator judges
every schedule; the cheapest that fits wins, else the lowest peak. A heuristic: it claims no
bound.

What each part buys (``benchmarks/hf_gaps.py``'s families and budgets, the rounding alone):
the pulled values recomputed again, the 6-layer Llama halfway from its layers' peak to the
floor 233.42 -> 181.57 ms (bound 161.11) and BERT at its layers' peak 167.57 -> 132.83; the
trims from other fits, T5 at its layers' peak 133.04 -> 119.60 (bound 91.34; nothing fitted
before the repairs started from each round's lowest rounding: the roundings recompute the
decoder's residual stream at the first stage for the last layer's norm and held it through
the backward pass) and GPT-2 halfway 166.49 -> 158.70; the 32-layer Llama at its layers'
peak still within 1% of the bound in about 10 s of a 20 s ``auto``. The repairs once ran
after each LP; run after the lowered LPs and the trim they reach a fit sooner where the
repairs fail (the 32-layer Llama at its layers' peak, the bound given: within 5% of it after
3.9-4.3 s and 1% after 5.6-6.9 s, against 9.0 and 10.9 s with the repairs after each LP).

Measured (roofline costs, budget the peak of the model's own layer checkpointing, 2 shared
cores): Hugging Face Llama of 2 layers (156 ops): 38.4 ms of recompute in about 1 s, where
``auto`` at 20 s returned 56.9 ms (the LP's bound: 31.4 ms); of 6 layers (384 ops): 146.3 ms
(``auto``: 191.6 ms, bound 142.8 ms). The staged schedule of the 2-layer Llama, run by
codegen, gave the original gradients bitwise and a peak 8 KiB under the simulated one
(``tests/solvers/staged/test_rounding.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import (
    INF_BYTES,
    SolveResult,
    closes_gap,
    lowest_ranked,
    result_from_profile,
)
from chkpt_opt.solvers.bounds.recompute_bound import RecomputeBound, recompute_bound
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.staged.stager import Again, Stager

MAX_ROUNDS = 4
"""LPs solved at lowered budgets where no rounding of the first fits, at most."""

OUT_OF_REACH = 2.0
"""Where every rounding of the first LP peaks above this many times the budget, no round
or repair is tried: they lower a rounding's peak by a few percent each, and the space of
one recomputation per stage is far from the budget (the 32-layer LoRA Llama at 2 x 512
tokens: 240-517 MB against 30 MB, where nested regions fit; the rounds and repairs took
12 s of a 60 s limit)."""

MAX_THRESHOLDS = 24
"""Thresholds tried per LP, at most (spread over its distinct shares)."""

MIN_SHARE = 1e-6
"""Shares below this count as not recomputed."""

SPLIT_STEPS = 4
"""Shares of the pulled values recomputed again tried per rounding that does not fit."""

TRIM_STARTS = 4
"""Fits trimmed besides the first (the cheapest not made by a trim, in turn), at most."""

MAX_SPLITS = 16
"""Recomputations added again at a later use, at most (the split repair)."""

Judge = Callable[[frozenset[str], frozenset[Again]], "tuple[Schedule, MemoryProfile] | None"]
"""Simulates (and records) the staged schedule of recomputed ops and extra recomputations;
None once the deadline has passed."""


def _thresholds(shares: Iterable[float]) -> list[float]:
    """At most :data:`MAX_THRESHOLDS` of the distinct shares, highest first, spread evenly."""
    distinct = sorted({round(v, 6) for v in shares if v >= MIN_SHARE}, reverse=True)
    if len(distinct) <= MAX_THRESHOLDS:
        return distinct
    step = (len(distinct) - 1) / (MAX_THRESHOLDS - 1)
    return [distinct[round(k * step)] for k in range(MAX_THRESHOLDS)]


def _repaired(
    stager: Stager,
    ops: frozenset[str],
    again: frozenset[Again],
    budget_bytes: int,
    judge: Judge,
) -> bool:
    """Whether recomputing, beside ``ops``, the shortest prefix that fits of the other ops
    a backward step unpacks, fewest forward seconds per byte made first (found by
    bisection), fits; each schedule tried is judged."""
    graph, owner = stager.graph, stager.owner
    made: dict[str, int] = {}
    for sid, o in owner.items():
        if o not in ops and o in stager.allowed and o in stager.first_use:
            made[o] = made.get(o, 0) + stager.sizes.get(sid, 0)
    ranked = sorted(
        (o for o, nbytes in made.items() if nbytes > 0),
        key=lambda o: (graph.nodes[o]["fwd_time_s"] / made[o], o),
    )
    low, high = 0, len(ranked)  # the prefix of ``high`` ops is tried last
    fitted = False
    while low < high:
        mid = (low + high) // 2
        trial = judge(ops | frozenset(ranked[: mid + 1]), again)
        if trial is None:
            return fitted
        _, profile = trial
        if profile.peak_bytes <= budget_bytes:
            high, fitted = mid, True
        else:
            low = mid + 1
    return fitted


def _pulled_again(
    stager: Stager, ops: frozenset[str], budget_bytes: int, judge: Judge
) -> tuple[int, frozenset[Again]] | None:
    """Judges ``ops``'s rounding with the cheapest ``k / SPLIT_STEPS`` of its pulled values
    (:meth:`Stager.pulled`) recomputed again at their own first use, for ``k`` from 1 until
    one fits; the lowest peak judged and its extra recomputations (None: nothing judged). A
    value that a reader's recomputation pulls to an early stage is otherwise held from there
    to its own use: a residual stream recomputed for the last layer's norm is held through
    the whole backward pass."""
    pulled = stager.pulled(ops)
    lowest: tuple[int, frozenset[Again]] | None = None
    for count in sorted({-(-len(pulled) * k // SPLIT_STEPS) for k in range(1, SPLIT_STEPS + 1)}):
        again = frozenset(pulled[:count])
        trial = judge(ops, again)
        if trial is None:
            break
        if lowest is None or trial[1].peak_bytes < lowest[0]:
            lowest = (trial[1].peak_bytes, again)
        if lowest[0] <= budget_bytes:
            break
    return lowest


def _split(
    stager: Stager,
    ops: frozenset[str],
    again: frozenset[Again],
    budget_bytes: int,
    judge: Judge,
) -> bool:
    """Whether recomputing once more, at its next use, a value that the peak holds for a
    later step (the largest of the first three that lowers the peak; at most
    :data:`MAX_SPLITS` of them, one at a time) makes ``ops`` fit; each schedule is judged."""
    trial = judge(ops, again)
    if trial is None:
        return False
    schedule, profile = trial
    for _ in range(MAX_SPLITS):
        if profile.peak_bytes <= budget_bytes:
            return True
        for candidate in stager.held_at_peak(schedule, profile)[:3]:
            if candidate in again:
                continue
            trial = judge(ops, again | {candidate})
            if trial is None:
                return False
            if trial[1].peak_bytes < profile.peak_bytes:
                again, (schedule, profile) = again | {candidate}, trial
                break
        else:
            return False
    return profile.peak_bytes <= budget_bytes


Judged = tuple[tuple[Schedule, frozenset[str], frozenset[Again]], MemoryProfile]
"""A judged schedule: the schedule, its recomputed ops and extra recomputations, its profile."""


def _trim(
    best: Judged | None,
    budget_bytes: int,
    fwd_time_s: dict[str, float],
    judge: Judge,
) -> int:
    """How many recomputed ops of ``best`` (where it fits) could be kept instead, tried one
    at a time, costliest first, while the schedule still fits and costs less; each schedule
    tried is judged."""
    if best is None or best[1].peak_bytes > budget_bytes:
        return 0
    (_, ops, again), profile = best
    trimmed = 0
    for op in sorted(ops, key=lambda o: (-fwd_time_s[o], o)):  # the costliest first
        trial = judge(ops - {op}, again)
        if trial is None:
            return trimmed
        fewer = trial[1]
        if fewer.peak_bytes <= budget_bytes and fewer.recompute_s < profile.recompute_s:
            ops, profile, trimmed = ops - {op}, fewer, trimmed + 1
    for extra in sorted(again, key=lambda item: (-fwd_time_s[item[0]], item)):
        trial = judge(ops, again - {extra})
        if trial is None:
            return trimmed
        fewer = trial[1]
        if fewer.peak_bytes <= budget_bytes and fewer.recompute_s < profile.recompute_s:
            again, profile, trimmed = again - {extra}, fewer, trimmed + 1
    return trimmed


def staged_rounding(
    graph: CostGraph,
    budget_bytes: int,
    *,
    relaxed: RecomputeBound | None = None,
    deadline: Deadline = NO_DEADLINE,
    gap: float | None = None,
) -> SolveResult:
    """The rounded staged schedule of the module docstring.

    Args:
        graph: the cost graph.
        budget_bytes: the activation budget.
        relaxed: the recompute bound at this budget, if the caller has it (else it is
            solved within ``deadline``).
        deadline: no further schedule is judged, nor LP solved, once it has passed.
        gap: no further schedule is judged, nor LP solved, once one that fits is within
            this relative gap of the bound at ``budget_bytes`` (``stats["stopped_at_gap"]``;
            ``auto`` passes its own): the trim and the repairs could lower its cost by at
            most that. None: every stage runs.
    """
    clock = Deadline.after(None)
    stager = Stager(graph)
    judged: list[Judged] = []
    fwd = {n: graph.nodes[n]["fwd_time_s"] for n in stager.order}
    target = budget_bytes
    lp = relaxed if relaxed is not None else recompute_bound(graph, target, deadline=deadline)
    bound_s = lp.bound_s  # at the budget: the lowered LPs' bounds are not bounds here
    closed: list[float] = []  # the gap of the first fit within ``gap`` of ``bound_s``

    def judge(
        ops: frozenset[str], again: frozenset[Again]
    ) -> tuple[Schedule, MemoryProfile] | None:
        if deadline.expired() or closed:
            return None
        schedule = stager.schedule(ops, again)
        profile = simulate(graph, schedule)
        judged.append(((schedule, ops, again), profile))
        fits = profile.peak_bytes <= budget_bytes
        if fits and gap is not None and closes_gap(profile.recompute_s, bound_s, gap):
            closed.append(0.0 if not profile.recompute_s else 1 - bound_s / profile.recompute_s)
        return schedule, profile

    rounds = 0
    out_of_reach = False  # (OUT_OF_REACH)
    to_repair: list[tuple[frozenset[str], frozenset[Again]]] = []  # each round's lowest peak
    unfit: list[tuple[int, frozenset[str]]] = []  # the roundings within reach that do not fit
    # (round, rounding) -> its lowest peak with pulled values recomputed again, and those
    pulled: dict[tuple[int, frozenset[str]], tuple[int, frozenset[Again]] | None] = {}
    while rounds < MAX_ROUNDS and lp.bound_s is not None and not (deadline.expired() or closed):
        rounds += 1
        share = lp.recompute_share
        lowest: int | None = None
        lowest_ops = frozenset[str]()
        fits = False
        for threshold in _thresholds(share.values()):
            ops = frozenset(o for o, v in share.items() if v >= threshold)
            trial = judge(ops, frozenset())
            if trial is None:
                break
            peak = trial[1].peak_bytes
            if budget_bytes < peak <= OUT_OF_REACH * budget_bytes:
                unfit.append((rounds, ops))
            if lowest is None or peak < lowest:
                lowest, lowest_ops = peak, ops
            fits = fits or peak <= budget_bytes
        if fits or lowest is None:
            break
        if rounds == 1 and lowest > OUT_OF_REACH * budget_bytes:
            out_of_reach = True
            break
        to_repair.append((lowest_ops, frozenset()))
        if lowest <= OUT_OF_REACH * budget_bytes:  # the others' pulled values after the trim
            pulled[(rounds, lowest_ops)] = _pulled_again(stager, lowest_ops, budget_bytes, judge)
        lowered = target - max(lowest - budget_bytes, budget_bytes // 200)
        # Below the floor the LP has no solution and the rounds would end: halfway to it.
        target = lowered if lowered >= lp.floor_bytes else (target + lp.floor_bytes) // 2
        lp = recompute_bound(graph, target, deadline=deadline)
    # The cheapest fit so far first made cheaper; then the repairs of the roundings that did
    # not fit (a repaired rounding of a higher LP may beat the lowered LPs' roundings).
    made_by_trims: set[int] = set()  # (indices in ``judged``)
    trim_starts: set[tuple[frozenset[str], frozenset[Again]]] = set()

    def trim(start: Judged | None) -> int:
        if start is None:
            return 0
        before = len(judged)
        trim_starts.add(start[0][1:])
        count = _trim(start, budget_bytes, fwd, judge)
        made_by_trims.update(range(before, len(judged)))
        return count

    trimmed = trim(lowest_ranked(judged, budget_bytes))
    # Each rounding that did not fit with its pulled values recomputed again; the lowest
    # peak of each round's repaired too.
    for rounding in dict.fromkeys(unfit):
        if rounding not in pulled:
            pulled[rounding] = _pulled_again(stager, rounding[1], budget_bytes, judge)
    lowest_again: dict[int, tuple[int, frozenset[str], frozenset[Again]]] = {}
    for (k, ops), found in pulled.items():
        if found is not None and found[0] < lowest_again.get(k, (INF_BYTES,))[0]:
            lowest_again[k] = (found[0], ops, found[1])
    to_repair += [(ops, again) for _, ops, again in lowest_again.values()]
    for ops, again in dict.fromkeys(to_repair):
        if not _split(stager, ops, again, budget_bytes, judge):
            _repaired(stager, ops, again, budget_bytes, judge)
    # The cheapest other fits, trimmed in turn: a trim ends where no single op can go, and
    # from another start it may end lower (BERT at its layers' peak: 132.83 ms from a repaired
    # rounding with pulled values recomputed again, 168.96 from the first fit).
    starts = sorted(
        (
            pair
            for i, pair in enumerate(judged)
            if i not in made_by_trims and pair[1].peak_bytes <= budget_bytes
        ),
        key=lambda pair: pair[1].recompute_s,
    )
    for start in starts:
        if len(trim_starts) > TRIM_STARTS or deadline.expired() or closed:
            break
        if start[0][1:] not in trim_starts:
            trimmed += trim(start)
    best = lowest_ranked(judged, budget_bytes)
    if best is None:  # nothing judged in time: keep-all
        schedule, profile = Schedule(), simulate(graph, Schedule())
    else:
        (schedule, _, _), profile = best
    return result_from_profile(
        schedule,
        profile,
        budget_bytes=budget_bytes,
        solver="staged_rounding",
        solve_s=clock.elapsed_s(),
        stats={
            "schedules": len(judged),
            "lp_rounds": rounds,
            "trimmed": trimmed,
            **({"out_of_reach": True} if out_of_reach else {}),
            **({"stopped_at_gap": {"bound_s": bound_s, "gap": closed[0]}} if closed else {}),
        },
    )
