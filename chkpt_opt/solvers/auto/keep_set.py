"""``auto``'s keep-set stages (:func:`keep_set_result`).

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

A stage whose result closes the gap to within ``gap`` (``auto``'s relative-gap setting,
default 1%: ``objective - bound <= gap * objective``, with the bound the stage proves itself)
also ends the keep-set stages; its status stays ``feasible`` unless the bound is met.

Where no heuristic's schedule fits and the exact stage is the pruned search, flat CP-SAT
runs first for at most :data:`CPSAT_FIRST_SHARE` of the stage's time: below the
heuristics' reach it proves what the pruned search does not reach in its share (the corpus
``resnet_large`` at 50% of keep-all: CP-SAT proved the keep-set optimum in 1.7-2.9 s, the
pruned search alone in 12.4 s; ``auto`` at 20 s, whose exact stage has 6 s there, returned
a schedule twice as costly); the pruned search gets what is left.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult, SolveStatus, best_of, closes_gap, meets_bound
from chkpt_opt.solvers.bounds.recompute_bound import RecomputeBound
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.keepset.choice import pick_exact
from chkpt_opt.solvers.registry import get_solver
from chkpt_opt.solvers.time_split import pruned_shares, stage_limit_s

log = logging.getLogger("chkpt_opt.solvers.auto")

NO_FIT_KEEP_SET_SHARE = 0.3
"""Where no heuristic's keep-set schedule fits, the share of the time limit at which the
exact keep-set stage ends, leaving the rest to the searches below the keep-set floor (the
nested heuristic needs 10-20 s on Hugging Face graphs of 384-636 ops halfway between their
layers' peak and the proven floor: alone at 20 s it found 1651 ms on Llama and 195 ms on
Mixtral, where ``auto`` with the keep-set stages at 90% returned 8955 ms and nothing)."""

CPSAT_FIRST_SHARE = 0.5
"""Where no heuristic's schedule fits and the exact stage is the pruned search, the share
of the stage's time that flat CP-SAT gets first (the module docstring)."""


class KeepSetSettings(Protocol):
    """The settings of :class:`~chkpt_opt.solvers.auto.AutoSolver` the stages read."""

    solvers: tuple[str, ...]
    exact: bool
    enumerate_max_schedules: int
    flat_max_positions: int | None
    pruned_max_ops: int
    pruned_min_positions: int | None
    general_share: float
    gap: float
    name: str


def keep_set_result(
    auto: KeepSetSettings,
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
    stages: list[list[str]] = [[name] for name in auto.solvers]
    if auto.exact:
        stages.append(
            pick_exact(
                graph,
                enumerate_max_schedules=auto.enumerate_max_schedules,
                flat_max_positions=auto.flat_max_positions,
                pruned_max_ops=auto.pruned_max_ops,
                pruned_min_positions=auto.pruned_min_positions,
            )
        )
    errors: dict[str, str] = {}
    for k, stage in enumerate(stages):
        exact_stage = auto.exact and k == len(stages) - 1
        if exact_stage and whole is not None and not any(r.feasible for r in results):
            # see NO_FIT_KEEP_SET_SHARE
            deadline = whole.share(min(NO_FIT_KEEP_SET_SHARE, 1.0 - auto.general_share))
            whole = None
        result = None
        if (
            exact_stage
            and stage[:2] == ["pruned", "cpsat"]
            and not any(r.feasible for r in results)
        ):
            stage = _cpsat_first(graph, budget_bytes, deadline, results, errors)
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
        log_stage(result, deadline)
        results.append(result)
        if result.proven or _closes(result, auto.gap):
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
        proof = next((r for r in results if proves_lowest_peak(r, best.peak_bytes)), None)
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
        solver=auto.name,
        solve_s=deadline.elapsed_s(),
        stats=stats,
        proves_infeasible=status == SolveStatus.INFEASIBLE and proven_infeasible,
    )
    return final


def _closes(result: SolveResult, gap: float) -> bool:
    """Whether ``result`` fits and is within ``gap`` of the bound it proves itself (the
    heuristics prove none; the recompute bound ends the searches beyond keep-set)."""
    return result.feasible and closes_gap(result.objective, result.bound, gap)


def _cpsat_first(
    graph: CostGraph,
    budget_bytes: int,
    deadline: Deadline,
    results: list[SolveResult],
    errors: dict[str, str],
) -> list[str]:
    """Flat CP-SAT for :data:`CPSAT_FIRST_SHARE` of the stage's time (the module docstring);
    its result joins ``results``. The stage's solvers left to run: none once it proved its
    result, else the pruned search."""
    left_s = deadline.remaining_s()
    try:
        first = get_solver("cpsat")(
            graph,
            budget_bytes,
            time_limit_s=None if left_s is None else CPSAT_FIRST_SHARE * left_s,
        )
    except SolverError as err:
        errors["cpsat"] = str(err)
        return ["pruned"]
    log_stage(first, deadline)
    results.append(first)
    return [] if first.proven else ["pruned"]


def log_stage(result: SolveResult, deadline: Deadline) -> None:
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


def proves_lowest_peak(result: SolveResult, peak_bytes: int) -> bool:
    """Whether ``result`` proves that no schedule peaks below ``peak_bytes``."""
    return bool(result.stats.get("min_feasible_proven")) and (
        result.stats.get("min_feasible_bytes") == peak_bytes
    )
