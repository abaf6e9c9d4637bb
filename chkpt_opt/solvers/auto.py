"""``solver="auto"``: the exact solver that fits the graph, after the cheap heuristics.

Keep-all first (optimal whenever it fits), then the heuristics in ``solvers`` (cheap, and a
fallback), then the exact solver that fits the graph and the time limit
(:func:`~chkpt_opt.solvers.keepset.choice.pick_exact`: ``enumerate`` on tiny graphs,
``dp_chain`` on chains, ``pruned`` on graphs of 64 cuts or more and at most 600 ops,
``hierarchical`` on larger graphs of repeated blocks, ``cpsat`` otherwise).

The exact solvers warm-start from greedy. A stage stops the search when its result is a
proof (:attr:`~chkpt_opt.solvers.base.SolveResult.proven`: optimal, or infeasible with a
proof), whichever solver gave it. The best result wins (cheapest that fits, else lowest
peak); its status is honest: ``optimal`` only when proven (a result that meets the best
proven bound of any solver counts), ``feasible`` with the best bound otherwise. Beside the
solvers' bounds counts the recompute bound (:mod:`chkpt_opt.solvers.bounds.recompute_bound`,
``stats["recompute_bound"]``): an LP over the storages of the keep-all op sequence, computed
first in at most 15% of the limit, which gives graphs too large for the integer
programs a proven gap, and proves a budget below every schedule's peak infeasible.

Beyond keep-set (``general=True``, the default; ``general=False`` stops at keep-set): the
proofs above hold over keep-set schedules (``stats["proofs_over"] == "keep_set"``), except
where the keep-set result meets the recompute bound (or, nothing fitting, its floor), which
holds over every schedule: the search stops there (``"every_schedule"``). Right after the
bound (where keep-all does not fit), the cached ops that the recompute bound's LP keeps are
rounded into regions (:mod:`~chkpt_opt.solvers.cached.cache_rounding`: selective-checkpoint
schedules, a region per layer caching its matmuls, chosen by the LP; it stops judging
schedules at 25% of the limit, and takes 0.3-3 s on Hugging Face graphs of 153-636 ops).
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

``general`` is on by default: codegen runs nested regions and cached ops with the keep-set
path's rules (explicit generators replayed through every level, batch-norm statistics and
in-place state updates applied once per step, a model's writes to its inputs replayed into
private copies, ``torch.compile`` of the eager module tracing each outermost region flat),
and the hard-model, end-to-end and peer tests pass with it. The nested search does not
nest on graphs that write state in place (:func:`~chkpt_opt.schedule.nesting_allowed`).
The compiled path runs one level of regions, with their cached ops: for a nested
schedule ``Plan.for_compile`` solves the plan at the same budget with ``nesting=False``
(keep-set stages, the rounding and the cached-op searches).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.frozen import frozen
from chkpt_opt.schedule import Schedule
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers.base import Solver, SolveResult, SolveStatus, best_of, meets_bound
from chkpt_opt.solvers.bounds.recompute_bound import RecomputeBound, recompute_bound
from chkpt_opt.solvers.cached.cache_rounding import cache_rounding
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.heuristics.greedy_sweep import greedy_sweep
from chkpt_opt.solvers.interval.prepare import DEFAULT_MAX_POSITIONS
from chkpt_opt.solvers.keepset.choice import PRUNED_MAX_OPS, PRUNED_MIN_POSITIONS, pick_exact
from chkpt_opt.solvers.registry import get_solver, register
from chkpt_opt.solvers.time_split import pruned_shares, stage_limit_s

log = logging.getLogger(__name__)

BOUND_SHARE = 0.15
"""The share of the time limit the recompute bound may take (measured 0.2-1.1 s on graphs
of 202-384 ops, 1.3-2.6 s on 586, on 2 shared cores)."""
ROUNDING_SHARE = 0.1
"""The share of the time limit the cached-op rounding may take after the bound (it stops
judging schedules there; measured 0.3-3 s on Hugging Face graphs of 153-636 ops)."""
NO_FIT_KEEP_SET_SHARE = 0.3
"""Where no heuristic's keep-set schedule fits, the share of the time limit at which the
exact keep-set stage ends, leaving the rest to the searches below the keep-set floor (the
nested heuristic needs 10-20 s on Hugging Face graphs of 384-636 ops halfway between their
layers' peak and the proven floor: alone at 20 s it found 1651 ms on Llama and 195 ms on
Mixtral, where ``auto`` with the keep-set stages at 90% returned 8955 ms and nothing)."""
LOWEST_PEAK_SHARE = 0.25
"""Where nothing fits, the most of the time limit the cached-op program's lowest-peak
search takes (it rarely goes below the nested searches, and ``smallest_peak``, which every
refused budget calls, would otherwise take the whole limit)."""


@register("auto", "keep-all if it fits, else the heuristics and the exact solver that fits")
@dataclass(frozen=True)
class AutoSolver:
    """Heuristics, then the exact solver that fits; the best result with an honest status.

    Attributes:
        solvers: the cheap solvers tried first, in order (stopping at a proven optimum).
        exact: also run the exact solver that fits the graph (``pick_exact``).
        enumerate_max_schedules: graphs with at most this many schedules are enumerated.
        flat_max_positions: above this many allowed cuts, graphs of at most
            ``pruned_max_ops`` ops go to the pruned every-cut solver, larger repeated-block
            graphs to the hierarchical solver.
        pruned_max_ops: see ``flat_max_positions``.
        pruned_min_positions: above this many allowed cuts, graphs of at most
            ``pruned_max_ops`` ops go to the pruned every-cut solver (None: only above
            ``flat_max_positions``).
        default_time_limit_s: time limit of the exact solver when none is given.
        general: also search schedules beyond keep-set (cached ops, nested regions); on
            by default.
        nesting: with ``general``, also search nested regions (``dp_nested`` and the
            nested heuristic); False keeps to one level of regions with cached ops, what
            the ``torch.compile`` path runs (``Plan.for_compile``).
        general_share: with ``general``, the share of the time limit kept for the searches
            beyond keep-set (they also get what the keep-set stages leave): the keep-set
            stages stop earlier than without ``general``, which changes their result only
            where they were cut by the limit. At 0.2 that cut fell among the keep-set
            proof times measured on BERT within 20 s and on the corpus's encoder within
            60 s, and a cut proof left the general result costlier than keep-set's; at
            0.1 the searches lost little (``benchmarks/auto_share.py``; docs/limits.md).
            Not taken from a block search that is the whole keep-set stage (the module
            docstring).
    """

    solvers: tuple[str, ...] = ("keep_all", "greedy", "sqrt")
    exact: bool = True
    enumerate_max_schedules: int = 2000
    flat_max_positions: int | None = DEFAULT_MAX_POSITIONS
    pruned_max_ops: int = PRUNED_MAX_OPS
    pruned_min_positions: int | None = PRUNED_MIN_POSITIONS
    default_time_limit_s: float = 60.0
    general: bool = True
    nesting: bool = True
    general_share: float = 0.1
    name: str = "auto"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        with frozen(graph):  # every stage simulates this graph: its facts once
            return self._solve(graph, budget_bytes, time_limit_s)

    def _solve(
        self, graph: CostGraph, budget_bytes: int, time_limit_s: float | None
    ) -> SolveResult:
        limit = self.default_time_limit_s if time_limit_s is None else time_limit_s
        deadline = Deadline.after(limit)
        cover = recompute_bound(graph, budget_bytes, deadline=deadline.share(BOUND_SHARE))
        if not self.general:
            return self._keep_set(graph, budget_bytes, deadline, cover)
        # The cached-op rounding reads only the bound's LP, so it runs before the keep-set
        # stages, which would leave it little where they run to their share.
        rounded = None
        if simulate(graph, Schedule()).peak_bytes > budget_bytes:  # else keep-all is optimal
            rounded = cache_rounding(
                graph,
                budget_bytes,
                relaxed=cover,
                deadline=deadline.share(BOUND_SHARE + ROUNDING_SHARE),
            )
        keep_deadline = deadline.share(1.0 - self.general_share)
        keep = self._keep_set(graph, budget_bytes, keep_deadline, cover, whole=deadline)
        return _beyond_keep_set(graph, budget_bytes, keep, rounded, deadline, cover, self.nesting)

    def _keep_set(
        self,
        graph: CostGraph,
        budget_bytes: int,
        deadline: Deadline,
        cover: RecomputeBound,
        *,
        whole: Deadline | None = None,
    ) -> SolveResult:
        """The best keep-set result; ``cover``'s bound counts beside the solvers' own. The
        stages end at ``deadline``, but the pruned search's block search, where it skips
        the exact phase, runs to ``whole`` (the limit of the whole solve)."""
        results: list[SolveResult] = []
        stages: list[list[str]] = [[name] for name in self.solvers]
        if self.exact:
            stages.append(
                pick_exact(
                    graph,
                    enumerate_max_schedules=self.enumerate_max_schedules,
                    flat_max_positions=self.flat_max_positions,
                    pruned_max_ops=self.pruned_max_ops,
                    pruned_min_positions=self.pruned_min_positions,
                )
            )
        errors: dict[str, str] = {}
        for k, stage in enumerate(stages):
            exact_stage = self.exact and k == len(stages) - 1
            if exact_stage and whole is not None and not any(r.feasible for r in results):
                # see NO_FIT_KEEP_SET_SHARE
                deadline = whole.share(min(NO_FIT_KEEP_SET_SHARE, 1.0 - self.general_share))
                whole = None
            result = None
            for name in stage:  # the first solver of the stage that accepts the graph
                try:
                    if name == "pruned" and whole is not None:
                        alone = get_solver(name).incumbent_share
                        solver = get_solver(name, **pruned_shares(deadline, whole, alone))
                        limit_s = whole.remaining_s()
                    else:  # a stage that proves nothing ends at UNPROVEN_SHARE
                        solver = get_solver(name)
                        limit_s = stage_limit_s(solver, deadline, whole if exact_stage else None)
                    result = solver(graph, budget_bytes, time_limit_s=limit_s)
                    break
                except SolverError as err:
                    errors[name] = str(err)
            if result is None:
                continue
            _log_stage(result, deadline)
            results.append(result)
            if result.proven:
                break
        if not results:
            raise SolverError(f"no solver could run on this graph: {errors}")
        best = best_of(results)
        bounds = [r.bound for r in results if r.bound is not None]
        if cover.bound_s is not None:
            bounds.append(cover.bound_s)
        bound = max(bounds) if bounds and best.feasible else best.bound
        status = best.status
        if status == SolveStatus.FEASIBLE and meets_bound(best.objective, bound):
            status = SolveStatus.OPTIMAL
        proven_infeasible = cover.proves_infeasible or any(r.proves_infeasible for r in results)
        if status == SolveStatus.INFEASIBLE and not proven_infeasible:
            timed_out = any(r.status == SolveStatus.TIMED_OUT for r in results)
            status = SolveStatus.TIMED_OUT if timed_out else status
        stats = dict(best.stats)
        if not best.feasible and not stats.get("min_feasible_proven"):
            # A heuristic may tie with the exact solver's lowest peak: keep the proof.
            proof = next((r for r in results if _proves_lowest_peak(r, best.peak_bytes)), None)
            if proof is not None:
                stats.update(
                    min_feasible_bytes=best.peak_bytes,
                    min_feasible_proven=True,
                    min_feasible_lower_bytes=best.peak_bytes,
                )
        if not best.feasible:  # the floor holds over every schedule
            lower = max(stats.get("min_feasible_lower_bytes") or 0, cover.floor_bytes)
            stats["min_feasible_lower_bytes"] = min(lower, best.peak_bytes)
            if lower >= best.peak_bytes:
                stats.update(min_feasible_bytes=best.peak_bytes, min_feasible_proven=True)
        stats["recompute_bound"] = cover.summary()
        stats["tried"] = {r.solver: r.status.value for r in results}
        stats["chosen"] = best.solver
        if errors:
            stats["errors"] = errors
        final = dataclasses.replace(
            best,
            status=status,
            bound=bound if status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE) else None,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=deadline.elapsed_s(),
            stats=stats,
            proves_infeasible=status == SolveStatus.INFEASIBLE and proven_infeasible,
        )
        return final


def _log_stage(result: SolveResult, deadline: Deadline) -> None:
    """Progress: one line per solver ``auto`` ran, at INFO."""
    what = f"{result.objective * 1e3:.3f} ms recomputed" if result.feasible else "no fit"
    left_s = deadline.remaining_s()
    left = "no limit" if left_s is None else f"{left_s:.1f} s of the limit left"
    log.info(
        "auto: %s -> %s, %s, peak %d bytes, %.1f s; %s",
        result.solver,
        result.status.value,
        what,
        result.peak_bytes,
        result.solve_s,
        left,
    )


def _improves(result: SolveResult, keep: SolveResult) -> bool:
    if result.feasible:
        return not keep.feasible or result.objective < keep.objective * (1 - 1e-9) - 1e-15
    return not keep.feasible and result.peak_bytes < keep.peak_bytes


def _beyond_keep_set(
    graph: CostGraph,
    budget_bytes: int,
    keep: SolveResult,
    rounded: SolveResult | None,
    deadline: Deadline,
    cover: RecomputeBound,
    nesting: bool,
) -> SolveResult:
    """The keep-set result, or a better schedule beyond keep-set (see the module
    docstring; without ``nesting``, one level of regions with cached ops). ``cover``'s
    bound holds over every schedule, so it is the bound of a result from beyond
    keep-set."""
    if _proven_over_every_schedule(keep, cover):
        return dataclasses.replace(keep, stats=dict(keep.stats, proofs_over="every_schedule"))
    keep_stats = dict(keep.stats, proofs_over="keep_set")
    # Beside the rounding: the exact nested DP (it refuses what it cannot plan at once);
    # the cached-op searches from the rounded schedule where it beats keep-set's, from
    # keep-set's, and from greedy's (``cached`` alone's start: on Checkmate's FCN-8 at
    # 0.8 it found 0.14% extra compute, auto without it 2.9%); the nested heuristic where
    # no keep-set schedule fits.
    assert rounded is not None  # it ran unless keep-all fits, which returned above
    starts = [rounded.schedule, keep.schedule] if _improves(rounded, keep) else [keep.schedule]
    # Blocks between separators only where no keep-set schedule fits: coarser than keep-set's
    # cuts (the small encoder at 0.7 of its peak: 1.24 against 0.90 ms), below its floor
    # they are what fits (the small GPT at 0.29: 26 ms; the nested heuristic's plan 62 ms).
    searches = [get_solver("dp_nested", blocks=not keep.feasible)] if nesting else []
    greedy = greedy_sweep(graph, budget_bytes, time_limit_s=deadline.remaining_s()).schedule
    starts += [] if greedy in starts else [greedy]  # keep-set's result is often greedy's
    searches += [get_solver("cached", warm_start=start) for start in starts]
    weights = [1.0] * len(searches)
    if nesting and not keep.feasible:  # below the keep-set floor: half the time left first
        searches.insert(1, get_solver("nested"))
        weights.insert(1, float(len(weights)))
    found = [rounded]
    refused: dict[str, str] = {}

    def run(search: Solver, time_limit_s: float | None) -> None:
        try:
            found.append(search(graph, budget_bytes, time_limit_s=time_limit_s))
            _log_stage(found[-1], deadline)
        except SolverError as err:
            refused[search.name] = str(err)

    for k, search in enumerate(searches):
        left_s = deadline.remaining_s()
        run(search, None if left_s is None else left_s * weights[k] / sum(weights[k:]))
    # Then, in the time left, the exact program over one-level schedules with cached ops
    # (it takes the keep-set result as its start and cost cap), and the cached-op search
    # from its result where that is the best so far; not where the best already meets the
    # bound that holds over every schedule.
    best = best_of([keep, *found])
    if not _proven_over_every_schedule(best, cover):
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
    better = [r for r in found if _improves(r, keep)]
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
    if not best.feasible:  # the floor holds over every schedule, beyond keep-set too
        stats.update(
            min_feasible_bytes=best.peak_bytes,
            min_feasible_proven=cover.floor_bytes >= best.peak_bytes,
            min_feasible_lower_bytes=min(cover.floor_bytes, best.peak_bytes),
        )
    if best.feasible:
        status = SolveStatus.FEASIBLE
        if meets_bound(best.objective, cover.bound_s):
            status = SolveStatus.OPTIMAL
    else:
        status = SolveStatus.INFEASIBLE
    return dataclasses.replace(
        best,
        status=status,
        bound=cover.bound_s if best.feasible else None,
        budget_bytes=budget_bytes,
        solver=keep.solver,
        solve_s=deadline.elapsed_s(),
        stats=stats,
        proves_infeasible=cover.proves_infeasible,
    )


def _proven_over_every_schedule(result: SolveResult, cover: RecomputeBound) -> bool:
    """Whether nothing beyond keep-set can beat ``result``: it recomputes nothing, or its
    cost meets the recompute bound, or (nothing fitting) its peak meets the bound's floor;
    the bound and the floor hold over every schedule."""
    if result.feasible:
        if result.objective <= 0.0:
            return True
        return meets_bound(result.objective, cover.bound_s)
    return cover.floor_bytes >= result.peak_bytes


def _proves_lowest_peak(result: SolveResult, peak_bytes: int) -> bool:
    """Whether ``result`` proves that no schedule peaks below ``peak_bytes``."""
    return bool(result.stats.get("min_feasible_proven")) and (
        result.stats.get("min_feasible_bytes") == peak_bytes
    )
