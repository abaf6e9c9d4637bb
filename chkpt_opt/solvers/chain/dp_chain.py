"""Exact dynamic programming over a chain of segments: ``solver="dp_chain"``.

Beaumont et al. ("Optimal checkpointing for heterogeneous chains", 2019) solve rotor's
multi-level model on a chain by dynamic programming; this module does the same for the
keep-set schedule model of :mod:`chkpt_opt.memory_model.schedule`, with the memory of every slot
exactly as
:mod:`chkpt_opt.solvers.interval.model` (and so the simulator) counts it.

**Chain.** The graph is cut at a set of allowed cut positions ``0 = c_0 < c_1 < ... < c_m = n``
into segments. A storage whose life depends on the schedule (it is read or saved after its
forward step, and is not a step output) must have its owner, readers and savers in at most
two adjacent segments. With every allowed cut position this holds for a chain of ops (saving
inputs or outputs) and for a DAG whose only allowed cuts are its articulation points; then the
DP is exact over the whole schedule model and reports ``optimal``. Otherwise the cut set is
thinned to the largest one where it holds (a restricted model: never reported optimal, see
``stats``), or, with ``require_complete``, the graph is refused.

**Pieces.** A schedule is a path of *pieces*: a segment outside every region, or a region
``[c_i, c_j)`` (one or more segments). The timeline nests: the slots of the ops from position
``p`` on (their forward steps, ``bwd_start``, their backward steps) form one contiguous range
``nest(p)``, inside which every later piece lives. What a piece ``J = [p, q)`` changes is
then:

* on its own slots ``nest(p) \\ nest(q)``: the base bytes, its replay peak at its trigger's
  recompute slot, the recomputed storages it holds after the replay, and the storages
  *crossing* its two boundary cuts (owned just before the cut, read or saved just after),
  whose end depends on the piece on each side;
* on every later slot, ``nest(q)``: the bytes ``k(J)`` it keeps through the whole of it (its
  region's kept inputs until its release, the inputs its outside ops save until their
  backward), added uniformly.

With ``K`` the bytes kept by the pieces before ``J``, the memory at ``J``'s slots is
``K + own(J)``, so a schedule fits iff ``K_J + need(J) <= budget`` for every piece, and

    best(q, s', K + k(J)) = min over pieces J = [p, q) and states s at p of
                            best(p, s, K) + recompute(J),   subject to K + need(J) <= budget.

The state ``s`` at a cut holds what the neighbouring pieces need of each other: whether the
piece before the cut holds each crossing storage (its *exit*), and whether the piece after it
holds the crossing storages whose last forward reader lies two or more ops before the cut
(its *entry class*, which the earlier piece's own slots depend on: it is fixed when the
earlier piece is chosen, and the later piece must match it). On a chain there are one or two
states per cut. The DP keeps, per cut and state, the Pareto front of (kept bytes ``K``,
recompute time): exact, since every later constraint only gets harder as ``K`` grows; entries
with ``K`` above the budget minus the base bytes somewhere after the cut are dropped (every
later slot sees ``K``). For an infeasible budget, the same recurrence with the running peak in
place of the cost gives the exact minimum peak, and the cheapest schedule at that peak is
returned. Every returned schedule is simulated; the peak the DP predicts must equal the
simulator's (else :class:`~chkpt_opt.errors.SolverError`: a bug).

Costs: ``O(m^2)`` pieces, each evaluated with a few range-maximum queries after an ``O(n^2)``
precomputation (replay peaks grown incrementally per region start), times the size of the
Pareto fronts. Measured on 2 shared cores: 300-op chains in 1 s (homogeneous) to 4 s
(heterogeneous, saving outputs, a loose budget: fronts of ~1500 entries).

Not supported (refused with :class:`~chkpt_opt.errors.SolverError`): an op that keeps
tensors but never runs its backward (its tensors live to the end of the step, across every
piece), and graphs whose byte totals would overflow 62-bit integers.

This module holds the DP and the registered solver; the cut set is
:mod:`~chkpt_opt.solvers.chain.cuts`, the chain's layout (slots, crossing and internal
storages, region data) :mod:`~chkpt_opt.solvers.chain.layout`, the pieces, states and their
evaluation :mod:`~chkpt_opt.solvers.chain.model`, range maxima and replays
:mod:`~chkpt_opt.solvers.chain.replay`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import (
    INF_BYTES,
    SolveResult,
    SolveStatus,
    keep_all_result,
    result_from_profile,
)
from chkpt_opt.solvers.chain.model import OUTSIDE, REGION, ChainModel, Key
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, DeadlineExceeded
from chkpt_opt.solvers.interval.judge import check_prediction
from chkpt_opt.solvers.registry import register

__all__ = ["ChainModel", "DpChainSolver", "DpOutcome", "run_dp"]


@dataclass
class _Front:
    """The Pareto front of one DP state: kept bytes ascending, value strictly descending,
    with where each entry came from (cut index, state index there, entry index, piece kind).
    """

    kept: np.ndarray
    value: np.ndarray
    src_cut: np.ndarray
    src_state: np.ndarray
    src_entry: np.ndarray
    kind: np.ndarray


def _prune(parts: list[tuple]) -> _Front:
    kept = np.concatenate([p[0] for p in parts])
    value = np.concatenate([p[1] for p in parts])
    src_cut = np.concatenate([np.full(len(p[0]), p[2], dtype=np.int32) for p in parts])
    src_state = np.concatenate([np.full(len(p[0]), p[3], dtype=np.int32) for p in parts])
    src_entry = np.concatenate([p[4] for p in parts])
    kind = np.concatenate([np.full(len(p[0]), p[5], dtype=np.int8) for p in parts])
    order = np.argsort(kept, kind="stable")  # ties: the earlier source first
    value_sorted = value[order]
    best_before = np.minimum.accumulate(value_sorted)
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = value_sorted[1:] < best_before[:-1]  # strictly better than everything before
    chosen = order[keep]
    # Of several survivors with equal kept bytes, the last is the cheapest: drop the others.
    last_of_group = np.ones(len(chosen), dtype=bool)
    last_of_group[:-1] = kept[chosen][1:] != kept[chosen][:-1]
    chosen = chosen[last_of_group]
    return _Front(
        kept[chosen],
        value[chosen],
        src_cut[chosen],
        src_state[chosen],
        src_entry[chosen],
        kind[chosen],
    )


@dataclass(frozen=True)
class DpOutcome:
    """The DP's answer.

    Attributes:
        spans: region spans of the best schedule, or None when nothing fits.
        value: its recompute time (cost DP) or peak bytes (peak DP, an int).
        predicted_peak: the peak the DP predicts for it.
        entries: Pareto entries kept over all states.
        largest_front: the largest front of one state.
        evaluations: pieces evaluated.
    """

    spans: list[tuple[int, int]] | None
    value: float | int
    predicted_peak: int
    entries: int
    largest_front: int
    evaluations: int


def run_dp(
    chain: ChainModel,
    budget_bytes: int | None,
    *,
    max_entries: int = 3_000_000,
    deadline: Deadline = NO_DEADLINE,
) -> DpOutcome:
    """The DP of the module docstring.

    Args:
        chain: the chain model.
        budget_bytes: minimize the recompute time under this budget; None: minimize the peak.
        max_entries: refuse (SolverError) when the fronts hold more entries than this.
        deadline: the DP gives up once it has expired (``DeadlineExceeded``).
    """
    peak_mode = budget_bytes is None
    m = len(chain.cuts) - 1
    keys: list[list[Key]] = [[chain.start_key()]]
    fronts: list[list[_Front]] = [
        [
            _Front(
                np.zeros(1, dtype=np.int64),
                np.zeros(1, dtype=np.int64 if peak_mode else np.float64),
                np.full(1, -1, dtype=np.int32),
                np.full(1, -1, dtype=np.int32),
                np.full(1, -1, dtype=np.int64),
                np.full(1, -1, dtype=np.int8),
            )
        ]
    ]
    classes = [chain.classes(j) for j in range(m + 1)]
    # room[j]: the most bytes the pieces before cut j may keep (every slot after it sees them).
    room = [
        (budget_bytes or 0) - chain.rmq(c, chain.inner_end[c]) if c < chain.n else INF_BYTES
        for c in chain.cuts
    ]
    entry = [(chain.entry_class(i, REGION), chain.entry_class(i, OUTSIDE)) for i in range(m)]
    entries = 1
    largest = 1
    evaluations = 0
    for j in range(1, m + 1):
        deadline.check(f"dp_chain's DP (at cut {j} of {m})")
        parts: dict[Key, list[tuple]] = {}
        for i in range(j):
            # The outside piece first: on a tie it wins over a one-segment region.
            kinds = (OUTSIDE, REGION) if i == j - 1 else (REGION,)
            for s, (x, e) in enumerate(keys[i]):
                front = fronts[i][s]
                for kind in kinds:
                    if entry[i][kind] != e:
                        continue
                    for e_next in classes[j]:
                        ev = chain.evaluate(i, j, kind, x, e_next)
                        evaluations += 1
                        if peak_mode:
                            count = len(front.kept)
                            value = np.maximum(front.value, front.kept + ev.need)
                        else:
                            # Every later slot sees the kept bytes: prune what cannot fit there.
                            limit = min(budget_bytes - ev.need, room[j] - ev.kept, INF_BYTES)
                            count = int(np.searchsorted(front.kept, limit, side="right"))
                            if count == 0:
                                continue
                            value = front.value[:count] + ev.cost_s
                        parts.setdefault((ev.exit, e_next), []).append(
                            (
                                front.kept[:count] + ev.kept,
                                value,
                                i,
                                s,
                                np.arange(count, dtype=np.int64),
                                kind,
                            )
                        )
        keys.append(list(parts))
        fronts.append([_prune(parts[k]) for k in keys[j]])
        size = sum(len(f.kept) for f in fronts[j])
        entries += size
        largest = max([largest, *(len(f.kept) for f in fronts[j])])
        if entries > max_entries:
            raise SolverError(
                f"the DP's Pareto fronts exceed max_entries={max_entries} (at cut {j} of {m}); "
                "the exact state space is too large for dp_chain here: use solver 'cpsat'."
            )
    finals = [(s, k) for s, f in enumerate(fronts[m]) for k in range(len(f.kept))]
    if not finals:
        return DpOutcome(None, float("inf"), 0, entries, largest, evaluations)
    s, k = min(finals, key=lambda t: (fronts[m][t[0]].value[t[1]], fronts[m][t[0]].kept[t[1]]))
    value = fronts[m][s].value[k].item()  # a Python int (peak) or float (cost)
    spans: list[tuple[int, int]] = []
    j = m
    while j > 0:
        f = fronts[j][s]
        i, kind = int(f.src_cut[k]), int(f.kind[k])
        if kind == REGION:
            spans.append((chain.cuts[i], chain.cuts[j]))
        s, k, j = int(f.src_state[k]), int(f.src_entry[k]), i
    spans.reverse()
    peak, _ = chain.predict(spans)
    return DpOutcome(spans, value, peak, entries, largest, evaluations)


@register("dp_chain", "exact DP over a chain of segments (chains, DAGs at articulation points)")
@dataclass(frozen=True)
class DpChainSolver:
    """Exact dynamic program for graphs that form a chain of segments (module docstring).

    Attributes:
        require_complete: refuse graphs where not every allowed cut position can be a
            segment boundary (then the DP would be exact over a cut subset only).
        max_cuts: refuse graphs with more usable cut positions than this (the region table
            grows with their square).
        max_entries: refuse when the DP's Pareto fronts grow beyond this many entries.
    """

    require_complete: bool = False
    max_cuts: int = 1500
    max_entries: int = 3_000_000
    name: str = "dp_chain"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        deadline = Deadline.after(time_limit_s)
        chain = ChainModel(graph, require_complete=self.require_complete, max_cuts=self.max_cuts)
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, deadline=deadline)
        if trivial is not None:
            return trivial
        build_s = deadline.elapsed_s()
        stats: dict[str, Any] = {
            "complete_model": chain.complete,
            "cuts": len(chain.cuts),
            "allowed_cuts": chain.allowed,
            "build_s": build_s,
        }
        if not chain.complete:
            stats["optimal_over"] = (
                f"schedules whose region boundaries lie in the {len(chain.cuts)} cut positions "
                f"dp_chain uses (of {chain.allowed} allowed); not proven optimal overall"
            )
        try:
            outcome = run_dp(chain, budget_bytes, max_entries=self.max_entries, deadline=deadline)
            stats.update(_dp_stats(outcome))
            if outcome.spans is None:
                lowest = run_dp(chain, None, max_entries=self.max_entries, deadline=deadline)
                stats["peak_dp"] = _dp_stats(lowest)
                cheapest = run_dp(
                    chain, int(lowest.value), max_entries=self.max_entries, deadline=deadline
                )
                spans = next(s for s in (cheapest.spans, lowest.spans, []) if s is not None)
                schedule, profile = _judged(graph, chain, spans)
                proven_infeasible = chain.complete
                stats["min_feasible_bytes"] = profile.peak_bytes
                stats["min_feasible_proven"] = chain.complete
                stats["min_feasible_lower_bytes"] = profile.peak_bytes if chain.complete else None
                optimal = False
            else:
                schedule, profile = _judged(graph, chain, outcome.spans)
                optimal = chain.complete
                proven_infeasible = False
        except DeadlineExceeded as err:
            # What the DP proved by then is nothing: say so, and return the keep-all schedule
            # (which does not fit). Falling back to another solver is auto's job.
            stats["timed_out"] = True
            stats["reason"] = str(err)
            result = result_from_profile(
                Schedule(),
                simulate(graph, Schedule()),
                budget_bytes=budget_bytes,
                solver=self.name,
                solve_s=deadline.elapsed_s(),
                stats=stats,
            )
            return dataclasses.replace(result, status=SolveStatus.TIMED_OUT)
        stats["dp_s"] = deadline.elapsed_s() - build_s
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=deadline.elapsed_s(),
            bound=profile.recompute_s if optimal else None,
            proven_optimal=optimal,
            proven_infeasible=proven_infeasible,
            stats=stats,
        )


def _dp_stats(outcome: DpOutcome) -> dict[str, int]:
    return {
        "entries": outcome.entries,
        "largest_front": outcome.largest_front,
        "evaluations": outcome.evaluations,
    }


def _judged(
    graph: CostGraph, chain: ChainModel, spans: list[tuple[int, int]]
) -> tuple[Schedule, MemoryProfile]:
    """Simulates the schedule and checks the DP's prediction.

    Raises:
        SolverError: if the simulator and the DP disagree (a bug in dp_chain).
    """
    schedule = Schedule.from_spans(graph, spans)
    profile = simulate(graph, schedule)
    peak, cost = chain.predict(spans)
    check_prediction(
        graph, profile, peak_bytes=peak, cost_s=cost, model="dp_chain", what=f"regions {spans}"
    )
    return schedule, profile
