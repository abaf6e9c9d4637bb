"""``auto`` beyond keep-set (:func:`beyond_keep_set`).

Beyond keep-set (``general=True``, the default; ``general=False`` stops at keep-set): the
proofs above hold over keep-set schedules (``stats["proofs_over"] == "keep_set"``), except
where the keep-set result meets the recompute bound (or, nothing fitting, its floor), which
holds over every schedule: the search stops there (``"every_schedule"``). The searches also
stop at a schedule within ``auto``'s ``gap`` (default 1%) of a bound over every schedule
(``stats["stopped_at_gap"]`` says which bound and the gap); it is ``optimal`` only where it
meets the bound. Right after the
bound (where keep-all does not fit), the staged rounding's schedule joins the results (on
eager plans: :mod:`~chkpt_opt.solvers.staged.rounding`), and the cached ops that the
recompute bound's LP keeps are rounded into regions
(:mod:`~chkpt_opt.solvers.cached.cache_rounding`: selective-checkpoint schedules, a
region per layer caching its matmuls, chosen by the LP; it stops judging schedules at 25%
of the limit, and takes 0.3-3 s on Hugging Face graphs of 153-636 ops).
The keep-set stages stop at 90% of the limit (``general_share``), with three exceptions
(:mod:`~chkpt_opt.solvers.time_split`). A keep-set stage that proves nothing (the block
search of ``hierarchical``) ends at half the limit: the cached-op searches after it find
what it misses. The pruned search runs its block search first (``blocks_first``) for as
long as in ``pruned`` alone (half the limit), also where its program cannot be built in
time (it proves nothing there either); its exact phase gets what is left up to 90%. Where
no heuristic's keep-set schedule fits, the exact keep-set stage ends at
``NO_FIT_KEEP_SET_SHARE`` of the limit. In
the time left after the keep-set stages, ``dp_nested`` (exact over nested schedules that
cache nothing, on graphs that are simple chains; where no keep-set schedule fits, also over
the blocks between a graph's separators; it refuses others at once) runs; where no keep-set
schedule fits, the nested (multi-level) heuristic then looks below the keep-set memory
floor with half the time left; the cached-op search starts from the keep-set result, from
greedy's schedule (where it differs) and, where it is better, from the rounded schedule.
Then, unless the best so far meets the recompute bound, the exact program over one-level
schedules with cached ops (``milp_cached``, started from the keep-set result, searching
only schedules cheaper than the best so far) runs in all the time left (where nothing fits,
its lowest-peak search in at most ``LOWEST_PEAK_SHARE`` of the limit), and the cached-op
search from its schedule where that is the best. Proofs over parts of
the space beyond keep-set (``dp_nested``'s, ``milp_cached``'s) are reported in
``stats["space_optima"]``, keyed by what each proves. A schedule from them
wins only if it is better (cheaper while fitting, or a lower peak while nothing fits); it
is then ``feasible`` (or ``infeasible``) with the recompute bound, the one bound here that
holds over the larger space, and ``stats["keep_set"]`` records the keep-set result it beat.
No search starts once the limit has passed (``stats["beyond_keep_set_refused"]["time_limit"]``
names the first skipped): the limit is a promise, and the best so far is returned. With
``stall_s`` (``optimize`` sets 10 s), none starts once that long has passed since the best
schedule last improved by more than the gap (``["stalled"]``).

``general`` is on by default: codegen runs nested regions and cached ops with the keep-set
path's rules (explicit generators replayed through every level, batch-norm statistics and
in-place state updates applied once per step, a model's writes to its inputs replayed into
private copies, ``torch.compile`` of the eager module tracing each outermost region flat),
and the hard-model, end-to-end and peer tests pass with it. The nested search does not
nest on graphs that write state in place (:func:`~chkpt_opt.memory_model.schedule.nesting_allowed`).
The compiled path runs one level of regions, with their cached ops: for a nested
schedule ``Plan.for_compile`` solves the plan at the same budget with ``nesting=False``
(keep-set stages, the rounding and the cached-op searches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.auto.keep_set import log_stage
from chkpt_opt.solvers.base import (
    Solver,
    SolveResult,
    SolveStatus,
    best_of,
    closes_gap,
    meets_bound,
)
from chkpt_opt.solvers.bounds.recompute_bound import RecomputeBound
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.heuristics.greedy_sweep import greedy_sweep
from chkpt_opt.solvers.registry import get_solver

STAGED_MAX_OPS = 80
"""The largest graph ``auto`` runs the staged program on: at 30 s it answered within 5 s on
the corpus graphs of 47-58 ops and found nothing on the 106-op ``gpt_small`` (two programs
of 10 000+ binaries each), taking half the time the other searches had."""

LOWEST_PEAK_SHARE = 0.25
"""Where nothing fits, the most of the time limit the cached-op program's lowest-peak
search takes (it rarely goes below the nested searches, and ``smallest_peak``, which every
refused budget calls, would otherwise take the whole limit)."""


def improves(result: SolveResult, keep: SolveResult) -> bool:
    if result.feasible:
        return not keep.feasible or result.objective < keep.objective * (1 - 1e-9) - 1e-15
    return not keep.feasible and result.peak_bytes < keep.peak_bytes


def beyond_keep_set(
    graph: CostGraph,
    budget_bytes: int,
    keep: SolveResult,
    rounded: SolveResult | None,
    deadline: Deadline,
    cover: RecomputeBound,
    nesting: bool,
    *,
    gap: float = 0.0,
    staged: Sequence[SolveResult] = (),
    stall_s: float | None = None,
) -> SolveResult:
    """The keep-set result, or a better schedule beyond keep-set (see the module
    docstring; without ``nesting``, one level of regions with cached ops). ``cover``'s
    bound, and the staged program's where it runs, hold over every schedule: the larger
    is the bound of a result from beyond keep-set."""
    every_s = cover.bound_s
    if _proven_over_every_schedule(keep, cover, every_s, gap):
        over = (
            "every_schedule"
            if _proven_over_every_schedule(keep, cover, every_s, 0.0)
            else "keep_set"
        )
        stats = dict(keep.stats, proofs_over=over, **_stopped_at_gap(keep, every_s))
        return dataclasses.replace(keep, stats=stats)
    keep_stats = dict(keep.stats, proofs_over="keep_set")
    found = [rounded] if rounded is not None else []
    refused: dict[str, str] = {}

    # The best so far and when it last improved by more than the gap (the stall rule).
    best_so_far = best_of([keep, *found, *staged])
    improved_at_s = deadline.elapsed_s()

    def run(search: Solver, time_limit_s: float | None) -> None:
        nonlocal best_so_far, improved_at_s
        try:
            found.append(search(graph, budget_bytes, time_limit_s=time_limit_s))
            log_stage(found[-1], deadline)
        except SolverError as err:
            refused[search.name] = str(err)
            return
        if _better_by(found[-1], best_so_far, gap):
            improved_at_s = deadline.elapsed_s()
        best_so_far = best_of([best_so_far, found[-1]])

    def stalled(next_search: str) -> bool:
        if stall_s is None or deadline.elapsed_s() - improved_at_s < stall_s:
            return False
        refused["stalled"] = (
            f"no better schedule for {stall_s:g} s: stopped before {next_search} and the "
            "searches after it"
        )
        return True

    # Beside the rounding: the exact nested DP (it refuses what it cannot plan at once);
    # the nested heuristic where no keep-set schedule fits; the staged program on graphs
    # small enough for it (eager plans only: compiled ones run one level of regions), from
    # the best schedule so far: its bound holds over every schedule, and where a result
    # meets it, no search can do better; the cached-op searches from the rounded schedule
    # where it beats keep-set's, from keep-set's, and from greedy's (``cached`` alone's
    # start: on Checkmate's FCN-8 at 0.8 it found 0.14% extra compute, auto without it
    # 2.9%). Each gets its weight's share of the time left when it starts.
    assert rounded is not None  # it ran unless keep-all fits, which returned above
    starts = [rounded.schedule, keep.schedule] if improves(rounded, keep) else [keep.schedule]
    greedy = greedy_sweep(graph, budget_bytes, time_limit_s=deadline.remaining_s()).schedule
    starts += [] if greedy in starts else [greedy]  # keep-set's result is often greedy's
    half = float(len(starts) + 1)  # about half the time left when it starts
    searches: list[tuple[float, Callable[[], Solver]]] = []
    if nesting:
        # Blocks between separators only where no keep-set schedule fits: coarser than
        # keep-set's cuts (the small encoder at 0.7 of its peak: 1.24 against 0.90 ms),
        # below its floor they are what fits (the small GPT at 0.29: 26 ms; the nested
        # heuristic's plan 62 ms).
        # Over blocks it gets more than half the time left, the nested heuristic about
        # half the rest: where it plans, it recomputes far less (the 32-layer LoRA Llama at
        # 768 tokens: 2.5 s against the heuristic's 55-109 s), and it needs the time (at
        # 1024 tokens and at 2 x 512 only its cut set per layer fits, solved in 5-12 s).
        weight = 1.0 if keep.feasible else 2 * half
        searches.append((weight, lambda: get_solver("dp_nested", blocks=not keep.feasible)))
        if not keep.feasible:
            searches.append((half, lambda: get_solver("nested")))
        if graph.number_of_nodes() <= STAGED_MAX_OPS:
            searches.append(
                (
                    half,
                    lambda: get_solver(
                        "staged", warm_start=best_of([keep, *found, *staged]).schedule
                    ),
                )
            )
    searches += [(1.0, partial(get_solver, "cached", warm_start=start)) for start in starts]
    weights = [w for w, _ in searches]
    for k, (weight, make) in enumerate(searches):
        if deadline.expired():  # the time limit is a promise: the best so far
            refused["time_limit"] = f"passed before {make().name} and the searches after it"
            break
        if stalled(make().name):
            break
        left_s = deadline.remaining_s()
        search = make()
        run(search, None if left_s is None else left_s * weight / sum(weights[k:]))
        staged_s = found[-1].stats.get("every_schedule_bound_s") if found else None
        if search.name == "staged" and found[-1].solver == "staged" and staged_s is not None:
            every_s = max(every_s or 0.0, staged_s)
        if _proven_over_every_schedule(best_of([keep, *found]), cover, every_s, gap):
            break  # nothing is cheaper than a schedule that meets a bound over every one
    found.extend(staged)  # after the searches: a tie goes to the search (its proofs)
    # Then, in the time left, the exact program over one-level schedules with cached ops
    # (it takes the keep-set result as its start and cost cap), and the cached-op search
    # from its result where that is the best so far; not where the best already meets the
    # bound that holds over every schedule.
    best = best_of([keep, *found])
    if (
        not _proven_over_every_schedule(best, cover, every_s, gap)
        and not deadline.expired()
        and not ("stalled" in refused or stalled("milp_cached"))
    ):
        before = len(found)
        cap_s = best.objective if best.feasible else None  # only cheaper schedules matter
        cached_program = get_solver("milp_cached", keep_set=keep, cost_cap_s=cap_s)
        left_s = deadline.remaining_s()
        if not best.feasible and left_s is not None and deadline.limit_s is not None:
            left_s = min(left_s, LOWEST_PEAK_SHARE * deadline.limit_s)
        run(cached_program, left_s)
        best = best_of([keep, *found])
        exact_won = len(found) > before and found[-1] is best
        if exact_won and best.schedule.saved and not deadline.expired():
            run(get_solver("cached", warm_start=best.schedule), deadline.remaining_s())
    keep_stats["beyond_keep_set"] = {f"{r.solver}#{k}": r.status.value for k, r in enumerate(found)}
    if refused:
        keep_stats["beyond_keep_set_refused"] = refused
    # Proofs over parts of the space beyond keep-set (dp_nested's: nested schedules that
    # cache nothing; milp_cached's: one level with cached ops), by what each result says
    # it proves.
    optima = {
        str(r.stats["optimal_over"]): {
            "solver": r.solver,
            "status": r.status.value,
            "objective_s": r.objective,
            "peak_bytes": r.peak_bytes,
        }
        for r in found
        if r.proven and r.stats.get("optimal_over")
    }
    if optima:
        keep_stats["space_optima"] = optima
    better = [r for r in found if improves(r, keep)]
    if not better:
        return dataclasses.replace(keep, stats=keep_stats, solve_s=deadline.elapsed_s())
    best = best_of(better)
    stats = dict(best.stats)
    stats.update(
        {k: keep_stats[k] for k in ("space_optima", "beyond_keep_set_refused") if k in keep_stats},
        tried={**keep.stats.get("tried", {}), **keep_stats["beyond_keep_set"]},
        chosen=best.solver,
        beyond_keep_set=keep_stats["beyond_keep_set"],
        keep_set={
            "status": keep.status.value,
            "objective_s": keep.objective,
            "bound_s": keep.bound,
            "peak_bytes": keep.peak_bytes,
            "chosen": keep.stats.get("chosen"),
        },
        recompute_bound=cover.summary(),
    )
    stats.update(
        _stopped_at_gap(best, every_s)
        if _proven_over_every_schedule(best, cover, every_s, gap)
        else {}
    )
    if not best.feasible:  # the floor holds over every schedule, beyond keep-set too
        stats.update(
            min_feasible_bytes=best.peak_bytes,
            min_feasible_proven=cover.floor_bytes >= best.peak_bytes,
            min_feasible_lower_bytes=min(cover.floor_bytes, best.peak_bytes),
        )
    if best.feasible:
        status = SolveStatus.FEASIBLE
        if meets_bound(best.objective, every_s):
            status = SolveStatus.OPTIMAL
    else:
        status = SolveStatus.INFEASIBLE
    return dataclasses.replace(
        best,
        status=status,
        bound=every_s if best.feasible else None,
        budget_bytes=budget_bytes,
        solver=keep.solver,
        solve_s=deadline.elapsed_s(),
        stats=stats,
        proves_infeasible=cover.proves_infeasible,
    )


def _better_by(result: SolveResult, best: SolveResult, gap: float) -> bool:
    """Whether ``result`` beats ``best`` by more than the relative ``gap`` (cheaper while
    fitting; any fit, or a lower peak, where ``best`` fits nothing)."""
    if not improves(result, best):
        return False
    if not (result.feasible and best.feasible):
        return True
    return result.objective < best.objective * (1 - gap)


def _proven_over_every_schedule(
    result: SolveResult, cover: RecomputeBound, bound_s: float | None, gap: float
) -> bool:
    """Whether nothing beyond keep-set can beat ``result`` by more than ``gap`` (relative):
    it recomputes nothing, or its cost is within ``gap`` of ``bound_s`` (0: meets it), or
    (nothing fitting) its peak meets the bound's floor; the bound and the floor hold over
    every schedule."""
    if result.feasible:
        if result.objective <= 0.0:
            return True
        return closes_gap(result.objective, bound_s, gap)
    return cover.floor_bytes >= result.peak_bytes


def _stopped_at_gap(result: SolveResult, bound_s: float | None) -> dict[str, object]:
    """``stats["stopped_at_gap"]`` of a result that ended the searches within the gap of
    ``bound_s`` (a bound over every schedule); nothing where it fits nothing or met it."""
    if not result.feasible or bound_s is None or meets_bound(result.objective, bound_s):
        return {}
    rel = (result.objective - bound_s) / result.objective
    return {"stopped_at_gap": {"bound_s": bound_s, "gap": rel, "over": "every_schedule"}}
