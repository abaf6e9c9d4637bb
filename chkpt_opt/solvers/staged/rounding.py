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
fits as it is). From the cheapest schedule
that fits, recomputed ops are dropped one at a time, costliest first, while the schedule
still fits (the trim). Then the lowest-peak rounding of each LP that did not fit is
repaired, in turn: split first, where a recomputed value the peak (a backward step, or a
recomputation in the stage before one) holds for a later step is
recomputed once more at that step instead (with the recomputed ops it reads), one at a time
while the peak falls (the 6-layer Llama halfway from its layers' peak to the floor: 234.9 ms
in 6 s, where ``auto`` had returned 1651 ms; bound 161.1 ms); failing that, beside its ops,
the shortest prefix that fits of the other ops, fewest forward seconds per byte first
(bisection). Where a repair is the cheapest, it is trimmed in turn. The repairs once ran
after each LP; run after the lowered LPs and the trim they reach a fit sooner where the
repairs fail (the 32-layer Llama at its layers' peak, the bound given: within 5% of it
after 3.9-4.3 s and 1% after 5.6-6.9 s, against 9.0 and 10.9 s with the repairs after each
LP) and return the same schedules on the Llama of 2, 6 and 8 layers, ViT, Mixtral, GPT-2,
BERT and T5 (``benchmarks/results/bound_at_depth/``). The simulator
judges every schedule; the cheapest that fits wins, else the lowest peak. A heuristic: it
claims no bound.

Measured (roofline costs, budget the peak of the model's own layer checkpointing, 2 shared
cores): Hugging Face Llama of 2 layers (156 ops): 38.4 ms of recompute in about 1 s, where
``auto`` at 20 s returned 56.9 ms (the LP's bound: 31.4 ms); of 6 layers (384 ops): 146.3 ms
(``auto``: 191.6 ms, bound 142.8 ms). The staged schedule of the 2-layer Llama, run by
codegen, gave the original gradients bitwise and a peak 8 KiB under the simulated one
(``tests/solvers/staged/test_rounding.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from chkpt_opt.graphs.costgraph import (
    CostGraph,
    ordered_nodes,
    storage_owners,
    storages_read,
)
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.memory_model.staged import recomputable_ops, staged_schedule
from chkpt_opt.memory_model.staged.rule import stage_ops
from chkpt_opt.solvers.base import SolveResult, closes_gap, lowest_ranked, result_from_profile
from chkpt_opt.solvers.bounds.recompute_bound import RecomputeBound, recompute_bound
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline

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

MAX_SPLITS = 16
"""Recomputations added again at a later use, at most (the split repair)."""

Again = tuple[str, int]
"""An op recomputed once more, at the backward step of this index."""

Judge = Callable[[frozenset[str], frozenset[Again]], "tuple[Schedule, MemoryProfile] | None"]
"""Simulates (and records) the staged schedule of recomputed ops and extra recomputations;
None once the deadline has passed."""


class _Stager:
    """Staged schedules recomputing given ops, each at its first use in the backward pass."""

    def __init__(self, graph: CostGraph) -> None:
        self.graph = graph
        self.order = ordered_nodes(graph)
        owner = self.owner = storage_owners(graph)
        self.sizes: dict[str, int] = {}
        for n in self.order:
            a = graph.nodes[n]
            self.sizes.update(a["saved"])
            self.sizes.update(a["outputs"])
        backward = [s.node for s in lower(graph, Schedule()) if s.kind == "bwd"]
        self.backward = backward
        self.hosts = stage_ops(graph)
        self.allowed = recomputable_ops(graph)
        # first_use[o]: the first backward step (its index in ``backward``) unpacking what
        # o made; readers[o]: the ops reading a storage o made.
        self.first_use: dict[str, int] = {}
        for k, b in enumerate(backward):
            for sid in graph.nodes[b]["saved"]:
                o = owner.get(sid)
                if o is not None and o not in self.first_use:
                    self.first_use[o] = k
        self.readers: dict[str, set[str]] = {o: set() for o in self.order}
        self.inputs: dict[str, set[str]] = {o: set() for o in self.order}
        for c in self.order:
            for sid in storages_read(graph, c, owner):
                o = owner.get(sid)
                if o is not None and o != c:
                    self.readers[o].add(c)
                    self.inputs[c].add(o)
        # unpacked_at[s]: the backward steps (indices in ``backward``) unpacking storage s.
        self.unpacked_at: dict[str, list[int]] = {}
        for k, b in enumerate(backward):
            for sid in graph.nodes[b]["saved"]:
                self.unpacked_at.setdefault(sid, []).append(k)
        self.position = {b: k for k, b in enumerate(backward)}

    def schedule(self, recomputed: Iterable[str], again: Iterable[Again] = ()) -> Schedule:
        """The staged schedule recomputing ``recomputed`` (those a staged schedule may), and
        each ``(op, k)`` of ``again`` once more at the ``k``-th backward step, with the ops of
        ``recomputed`` it reads (transitively), so that no earlier value is held for it."""
        chosen = set(recomputed) & self.allowed
        stages: dict[str, list[str]] = {}
        for op, k in again:
            todo, seen = [op], set()
            while todo:
                o = todo.pop()
                if o in seen or o not in chosen:
                    continue
                seen.add(o)
                todo.extend(self.inputs[o])
            self._place(stages, seen, k)
        at: dict[str, int] = {}
        for o in reversed(self.order):  # readers first: a recomputation's inputs precede it
            if o not in chosen:
                continue
            uses = [at[c] for c in self.readers[o] if c in at]
            if o in self.first_use:
                uses.append(self.first_use[o])
            if uses:
                at[o] = min(uses)
        for o, k in at.items():
            self._place(stages, {o}, k)
        return Schedule(staged=staged_schedule(self.graph, stages))

    def _place(self, stages: dict[str, list[str]], ops: Iterable[str], k: int) -> None:
        """Recomputes ``ops`` at the ``k``-th backward step, or the last stage before it."""
        while k >= 0 and self.backward[k] not in self.hosts:
            k -= 1  # an earlier stage is still in time
        if k >= 0:
            stages.setdefault(self.backward[k], []).extend(ops)

    def held_at_peak(self, schedule: Schedule, profile: MemoryProfile) -> list[Again]:
        """Where the peak is a backward step or a recomputation in its stage: each
        recomputed value alive there that neither the step nor the stage's recomputations
        still to run read, largest first, as ``(op, the next step unpacking it)``, once each."""
        timeline = profile.timeline
        host = profile.peak_index  # the backward step whose stage (or itself) peaks
        while host < len(timeline) and timeline[host].kind == "recompute":
            host += 1
        if host == len(timeline) or timeline[host].kind != "bwd":
            return []
        host_node = timeline[host].node
        if host_node not in self.position:
            return []
        read = set(self.graph.nodes[host_node]["saved"])
        for point in timeline[profile.peak_index : host]:  # the stage's ops still to run
            read.update(storages_read(self.graph, point.node, self.owner))
        live: dict[str, int] = {}
        for k, step in enumerate(lower(self.graph, schedule)):
            if k > profile.peak_index:
                break
            live.update(step.alloc)
            if k < profile.peak_index:
                for inst in step.free:
                    live.pop(inst, None)
        here = self.position[host_node]
        found: list[tuple[int, str, int]] = []
        for inst, nbytes in live.items():
            prefix, _, sid = inst.partition(":")
            if not prefix.startswith("s") or not prefix[1:].isdigit() or sid in read:
                continue
            later = [k for k in self.unpacked_at.get(sid, []) if k > here]
            if later and sid in self.owner:
                found.append((-nbytes, self.owner[sid], min(later)))
        return list(dict.fromkeys((op, k) for _, op, k in sorted(found)))


def _thresholds(shares: Iterable[float]) -> list[float]:
    """At most :data:`MAX_THRESHOLDS` of the distinct shares, highest first, spread evenly."""
    distinct = sorted({round(v, 6) for v in shares if v >= MIN_SHARE}, reverse=True)
    if len(distinct) <= MAX_THRESHOLDS:
        return distinct
    step = (len(distinct) - 1) / (MAX_THRESHOLDS - 1)
    return [distinct[round(k * step)] for k in range(MAX_THRESHOLDS)]


def _repaired(
    stager: _Stager,
    ops: frozenset[str],
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
        trial = judge(ops | frozenset(ranked[: mid + 1]), frozenset())
        if trial is None:
            return fitted
        _, profile = trial
        if profile.peak_bytes <= budget_bytes:
            high, fitted = mid, True
        else:
            low = mid + 1
    return fitted


def _split(
    stager: _Stager,
    ops: frozenset[str],
    budget_bytes: int,
    judge: Judge,
) -> bool:
    """Whether recomputing once more, at its next use, a value that the peak holds for a
    later step (the largest of the first three that lowers the peak; at most
    :data:`MAX_SPLITS` of them, one at a time) makes ``ops`` fit; each schedule is judged."""
    again: frozenset[Again] = frozenset()
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
            break
        fewer = trial[1]
        if fewer.peak_bytes <= budget_bytes and fewer.recompute_s < profile.recompute_s:
            ops, profile, trimmed = ops - {op}, fewer, trimmed + 1
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
    stager = _Stager(graph)
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
    to_repair: list[frozenset[str]] = []  # each round's lowest-peak rounding so far
    while rounds < MAX_ROUNDS and lp.bound_s is not None and not (deadline.expired() or closed):
        rounds += 1
        share = lp.recompute_share
        lowest: int | None = None
        fits = False
        for threshold in _thresholds(share.values()):
            ops = frozenset(o for o, v in share.items() if v >= threshold)
            trial = judge(ops, frozenset())
            if trial is None:
                break
            profile = trial[1]
            lowest = profile.peak_bytes if lowest is None else min(lowest, profile.peak_bytes)
            fits = fits or profile.peak_bytes <= budget_bytes
        if fits or lowest is None:
            break
        if rounds == 1 and lowest > OUT_OF_REACH * budget_bytes:
            out_of_reach = True
            break
        to_repair.append(min(judged, key=lambda pair: pair[1].peak_bytes)[0][1])
        lowered = target - max(lowest - budget_bytes, budget_bytes // 200)
        # Below the floor the LP has no solution and the rounds would end: halfway to it.
        target = lowered if lowered >= lp.floor_bytes else (target + lp.floor_bytes) // 2
        lp = recompute_bound(graph, target, deadline=deadline)
    # The cheapest fit so far first made cheaper; then the repairs of the roundings that did
    # not fit (a repaired rounding of a higher LP may beat the lowered LPs' roundings).
    trimmed = _trim(lowest_ranked(judged, budget_bytes), budget_bytes, fwd, judge)
    trimmed_best = lowest_ranked(judged, budget_bytes)
    for ops in dict.fromkeys(to_repair):
        if not _split(stager, ops, budget_bytes, judge):
            _repaired(stager, ops, budget_bytes, judge)
    best = lowest_ranked(judged, budget_bytes)
    if best is not None and (trimmed_best is None or best[0][1:] != trimmed_best[0][1:]):
        trimmed += _trim(best, budget_bytes, fwd, judge)  # a repair won: trimmed in turn
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
