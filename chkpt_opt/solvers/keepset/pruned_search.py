"""``solver="pruned"``: the every-cut interval program after exact reductions.

Over every allowed cut, the interval program of a graph of 200-300 ops has 10,000-35,000
candidate intervals and a million nonzeros; no MILP solves it in a minute. Most of those
intervals cannot be in any schedule better than a good known one, and two exact tests find
them:

1. **Cost**: a region costs at most the whole schedule it belongs to (costs are sums of
   non-negative forward times), so with an incumbent of cost ``UB`` that fits the budget,
   every interval costing more than ``UB`` is left out before the model is built
   (``build_interval_model(max_cost_s=...)``, which never builds them).
2. **Reduced costs**: with the LP relaxation's optimum ``LP`` and the reduced cost ``r_k`` of
   an interval at zero, every solution that chooses it costs at least ``LP + r_k``; when that
   exceeds ``UB`` (by a margin over the LP solver's tolerances) the interval is dropped
   (:mod:`chkpt_opt.solvers.bounds.reductions`).

Neither drops a schedule costing at most ``UB``, and the incumbent's own intervals are always
kept, so the reduced program still holds an optimal schedule: its proven optimum is the
optimum of the whole schedule model, and its bound (or the LP's, which holds for the whole
model) is a proven bound. The incumbent comes from the greedy heuristic and, on graphs of
repeated blocks, the hierarchical solver with a share of the time limit (it is usually within
a few percent of the optimum, which is what makes the cost test bite). Building the model
stops at a deadline; on overrun the incumbent is returned as ``feasible`` without a bound.
The program is sized before the block search runs: first by a count without replays
(:func:`~chkpt_opt.solvers.interval.sizing.program_terms_lower`, a lower bound, at about a
third of the model's build), then, where that fits, by the model's own count
(:func:`~chkpt_opt.solvers.interval.program.count_terms`). Where the program and its LP
cannot be built in the time left (``EXACT_BUILD_TERMS_PER_S``), the exact phase is skipped
(``stats["exact_skipped"]``) and the block search gets the time left, to the whole limit
(``skipped_blocks_share``, which ``auto`` lowers) even where the exact phase had to end
sooner (``exact_share``), as long as a schedule is known to fit (else to the exact phase's
end: what comes after may look below the keep-set floor). With ``blocks_first`` (what
``auto`` sets) the block search runs before the model's build, and the model is built after
it, under its cost cap (not where the first sizing skipped the exact phase).

Nothing here is registered: solver ``pruned`` (:mod:`chkpt_opt.solvers.keepset.pruned`) runs it on
its own, and ``cpsat`` and ``milp`` run it with their engine settings on graphs above their
``max_positions`` (:mod:`chkpt_opt.solvers.keepset.flat`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.base import SolveResult, best_of, keep_all_result, result_from_profile
from chkpt_opt.solvers.bounds.lowest_peak import with_lowest_peak
from chkpt_opt.solvers.bounds.reductions import cost_cap, reduced_cost_fixing, restrict
from chkpt_opt.solvers.deadline import Deadline, DeadlineExceeded
from chkpt_opt.solvers.engines.cpsat_engine import DEFAULT_FORMULATION, solve_cp
from chkpt_opt.solvers.engines.milp_engine import BACKENDS, DEFAULT_BACKEND, solve_milp
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.interval.judge import Outcome, finish
from chkpt_opt.solvers.interval.model import IntervalModel
from chkpt_opt.solvers.interval.prepare import Prepared, check_flat_size
from chkpt_opt.solvers.interval.program import build_program, count_terms
from chkpt_opt.solvers.interval.sizing import program_terms_lower
from chkpt_opt.solvers.keepset.warm_start import block_incumbent, hint_ids, quick_incumbent

log = logging.getLogger(__name__)

ENGINES = (*BACKENDS, "cpsat")
"""What solves the pruned program: a MILP backend, or CP-SAT (at linearization level 2)."""
EXACT_BUILD_TERMS_PER_S = 5e5
"""Program terms (:func:`~chkpt_opt.solvers.interval.program.count_terms`) the program and
its LP relaxation are built at, per second: 0.41-0.70 million measured on graphs of 106-298
ops (0.26-5.3 million terms) on 2 shared cores. Where the terms cannot be built at this rate
in the time left, the exact phase is skipped and the block search gets that time: a padded
4-layer Llama (323 ops, 34 million terms, mostly hold rows) builds neither its program nor
the LP in a minute, and its block search reaches in 13 s a schedule 6% cheaper than in 5."""


def _with_blocks(
    graph: CostGraph, budget_bytes: int, best: SolveResult, time_limit_s: float | None
) -> SolveResult:
    """``best``, or the block search's result where it is better (on graphs of repeated
    blocks, within ``time_limit_s``)."""
    blocks = block_incumbent(graph, budget_bytes, time_limit_s=time_limit_s)
    return best if blocks is None else best_of([best, blocks])


def _sized_model(
    graph: CostGraph,
    best: SolveResult,
    deadline: Deadline,
    build_deadline: Deadline,
    stats: dict[str, Any],
) -> tuple[IntervalModel | None, int | None, int | None, float]:
    """The model under ``best``'s cost cap, its program's terms, their lower bound counted
    without replays, and the build's seconds. The program and its LP are built at about
    EXACT_BUILD_TERMS_PER_S: where the lower bound cannot be in the time ``deadline``
    leaves, the model is not built (None, and no terms). Out of ``build_deadline``, no
    model either, and ``stats["build_timed_out"]``."""
    model, terms, lower = None, None, None
    t0 = time.perf_counter()
    try:
        cap = cost_cap(best.objective) if best.feasible else None
        lower = program_terms_lower(graph, max_cost_s=cap, deadline=build_deadline)
        if _builds_in(lower, deadline):
            model = build_interval_model(graph, max_cost_s=cap, deadline=build_deadline)
            terms = count_terms(model)
    except DeadlineExceeded as err:
        log.info("pruned: %s Returning the incumbent.", err)
        stats["build_timed_out"] = True
    return model, terms, lower, time.perf_counter() - t0


def _builds_in(terms: int, deadline: Deadline) -> bool:
    """Whether a program of ``terms`` terms and its LP build in the time ``deadline`` leaves,
    at :data:`EXACT_BUILD_TERMS_PER_S`."""
    left = deadline.remaining_s()
    return left is None or terms <= EXACT_BUILD_TERMS_PER_S * left


@dataclass(frozen=True)
class PrunedSearch:
    """The settings of the pruned search: incumbent, exact pruning, MILP over every cut.

    Attributes:
        incumbent_share: share of the time limit given to the incumbent (greedy, then the
            hierarchical solver on graphs of repeated blocks). At 0.35 the block search
            stopped short of its schedule on a padded BERT (144 ops, 15 s: 74.8 ms
            recomputed against 73.5 at 0.5 and 0.65, where the MILP solved nothing); the
            corpus graphs gpt_small, encoder_large, unet_large, resnet_large and vit_large at
            0.6 of their keep-all peaks stay proven optimal within 20 s (0-3 s later).
        build_share: the model's build stops once this share of the time limit has passed
            (the incumbent is then returned, without a bound).
        min_milp_s: the final solve is skipped when less time than this is left after the LP
            (the incumbent is then returned with the LP's bound).
        reduced_costs: also drop intervals by LP reduced costs (see the module docstring).
        backend: what solves the pruned program: ``"highs"`` (default: measured fastest to
            a proof here), ``"scip"`` or ``"cpsat"``.
        seed: the backend's random seed.
        workers: CP-SAT search workers (backend ``"cpsat"``, and the lowest-peak search).
        formulation: CP-SAT's memory constraint form (see
            :mod:`~chkpt_opt.solvers.engines.cpsat_engine`).
        warm_start: hint the incumbent to the backend (where it takes hints).
        exact_share: the share of the time limit that the exact phase (the model's build,
            its program, LP and MILP) must end within; ``build_share`` is a share of this
            one, ``incumbent_share`` of the whole limit. Where the exact phase is skipped
            (``stats["exact_skipped"]``), the block search runs to ``skipped_blocks_share``
            of the whole limit. ``auto`` sets it to keep its searches beyond keep-set their
            share after an exact phase.
        blocks_first: run the block search before the model's build (``auto``'s setting):
            its ``incumbent_share``, or the whole limit where the program, sized without
            replays, cannot be built in time; the model is then built under its cost cap,
            and the block search's time is not taken by that build. Where the first sizing
            skips the exact phase, the program is not sized again after the block search
            (the count takes a third of the build's time; on a padded Llama of 345 ops it
            ran past the time limit after a block search to the whole limit).
        skipped_blocks_share: where the exact phase is skipped and a schedule fits, the
            block search ends at this share of the whole limit (1.0, alone: it is then the
            result, and it improves with time). ``auto`` ends it where it ends beside an
            exact phase (at its ``incumbent_share``): it proves nothing, and on two padded
            Llama graphs (323 and 345 ops) the cached-op search alone found 15-19% less
            recompute than ``auto`` with the block search to the whole limit.
    """

    incumbent_share: float = 0.5
    build_share: float = 0.7
    min_milp_s: float = 1.0
    reduced_costs: bool = True
    backend: str = DEFAULT_BACKEND
    seed: int = 0
    workers: int = 1
    formulation: str = DEFAULT_FORMULATION
    warm_start: bool = True
    exact_share: float = 1.0
    blocks_first: bool = False
    skipped_blocks_share: float = 1.0

    def search(
        self, graph: CostGraph, budget_bytes: int, *, deadline: Deadline, solver: str
    ) -> SolveResult:
        """The pruned search of the module docstring; the result is named ``solver``.

        Raises:
            SolverError: for an unknown backend, or a graph too large for the flat model.
        """
        if self.backend not in ENGINES:
            raise SolverError(
                f"backend {self.backend!r} is unknown; use one of {', '.join(ENGINES)}."
            )
        if not 0.0 <= self.exact_share <= 1.0:
            raise SolverError(
                f"exact_share must lie in [0, 1], got {self.exact_share!r}; it is the share "
                "of the time limit the exact phase ends within (1.0: the whole limit)."
            )
        check_flat_size(graph)
        trivial = keep_all_result(graph, budget_bytes, solver=solver, deadline=deadline)
        if trivial is not None:
            return trivial
        whole = deadline  # the block search's, where the exact phase is skipped
        deadline = deadline.share(self.exact_share)
        limit = whole.limit_s
        share = None if limit is None else self.incumbent_share * limit
        best = quick_incumbent(graph, budget_bytes, time_limit_s=share)
        stats: dict[str, Any] = {}
        if self.blocks_first:
            blocks_s = self._first_blocks_s(graph, best, deadline, whole, share, stats)
            best = _with_blocks(graph, budget_bytes, best, blocks_s)
        build_deadline = deadline.share(self.build_share)
        if "exact_skipped" in stats:  # sized before the block search: too large to build
            model, terms, lower, model_s = None, None, None, 0.0
        else:
            model, terms, lower, model_s = _sized_model(
                graph, best, deadline, build_deadline, stats
            )
        left = deadline.remaining_s()
        exact_fits = terms is not None and _builds_in(terms, deadline)
        if not self.blocks_first:
            until_share = None if share is None else share - deadline.elapsed_s()
            rest = self._skipped_until(whole, deadline, best)
            blocks_s = until_share if exact_fits else rest.remaining_s()
            best = _with_blocks(graph, budget_bytes, best, blocks_s)
        stats.update(
            incumbent_from=best.solver,
            incumbent_s=best.objective if best.feasible else None,
            incumbent_solve_s=deadline.elapsed_s(),
        )
        if terms is not None:
            stats["program_terms"] = terms
        if lower is not None and not exact_fits and not stats.get("build_timed_out"):
            counted = f"{terms}" if terms is not None else f"at least {lower}"
            stats["exact_skipped"] = (
                f"{counted} program terms, more than {EXACT_BUILD_TERMS_PER_S:.0e} per "
                f"second builds in the {left or 0.0:.1f} s that were left"
            )
        if model is None or not exact_fits:
            return self._incumbent_result(graph, best, budget_bytes, whole, stats, solver)
        t0 = time.perf_counter()
        try:
            cap = cost_cap(best.objective) if best.feasible else None
            if cap is not None and (model.max_cost_s is None or cap < model.max_cost_s):
                # The block search's incumbent is cheaper than the one the model was built
                # with: its cost test leaves out more (what building with it would).
                cheap = [k for k, iv in enumerate(model.intervals) if iv.cost_s <= cap]
                model = replace(restrict(model, cheap), max_cost_s=cap)
            program = build_program(model, deadline=build_deadline)
        except DeadlineExceeded as err:
            log.info("pruned: %s Returning the incumbent.", err)
            stats["build_timed_out"] = True
            return self._incumbent_result(graph, best, budget_bytes, deadline, stats, solver)
        stats["intervals_after_cost"] = len(model.intervals)
        prepared = Prepared(model, program, model_s + time.perf_counter() - t0)
        ids = hint_ids(graph, model, best) if best.feasible else None
        lp_bound_units = None
        if self.reduced_costs and best.feasible:
            fixing = reduced_cost_fixing(
                program, budget_bytes, best.objective, protect=ids or (), deadline=deadline
            )
            stats.update(lp_status=fixing.status, lp_s=fixing.lp_s)
            if fixing.bound_s is not None:
                stats["lp_bound_s"] = fixing.bound_s
                lp_bound_units = fixing.bound_s * program.cost_scale
            if len(fixing.keep) < len(model.intervals) and self._time_left(deadline):
                t0 = time.perf_counter()
                try:
                    small = restrict(model, fixing.keep)
                    program = build_program(small, deadline=deadline)
                    model = small
                    prepared = Prepared(model, program, prepared.build_s + time.perf_counter() - t0)
                    ids = model.interval_ids(best.schedule.spans(graph))
                except DeadlineExceeded:
                    stats["build_timed_out"] = True
        stats["intervals_after_lp"] = len(model.intervals)
        hint = ids if self.warm_start else None
        if self._time_left(deadline) and not stats.get("build_timed_out"):
            if self.backend == "cpsat":
                outcome = solve_cp(
                    program,
                    budget_bytes,
                    formulation=self.formulation,
                    seed=self.seed,
                    workers=self.workers,
                    hint_ids=hint,
                    deadline=deadline,
                    linearization_level=2,
                )
            else:
                outcome = solve_milp(
                    program,
                    budget_bytes,
                    backend=self.backend,
                    seed=self.seed,
                    hint_ids=hint,
                    deadline=deadline,
                )
        else:
            stats["milp_skipped"] = "out of time"
            outcome = Outcome(None, False, False, None)
        bound_units = outcome.bound_units
        if lp_bound_units is not None:
            # finish() lowers a bound by the cost rounding of an integer program; the LP's
            # is in seconds already, so it is raised by as much here.
            lp_units = lp_bound_units + 0.5 * model.n_ops
            bound_units = lp_units if bound_units is None else max(bound_units, lp_units)
        stats.update(outcome.stats)
        outcome = replace(outcome, bound_units=bound_units, stats=stats)
        lowest = None
        if model.max_cost_s is None:
            settings = {"seed": self.seed, "workers": self.workers, "formulation": self.formulation}
            outcome, lowest = with_lowest_peak(graph, prepared, outcome, deadline, settings)
        return finish(
            graph,
            budget_bytes,
            prepared,
            outcome,
            solver=solver,
            deadline=deadline,
            fallback=best,
            lowest=lowest,
        )

    def _first_blocks_s(
        self,
        graph: CostGraph,
        best: SolveResult,
        deadline: Deadline,
        whole: Deadline,
        share: float | None,
        stats: dict[str, Any],
    ) -> float | None:
        """The block search's time where it runs first: to ``whole`` where the exact
        program, sized under ``best``'s cap without replays, cannot be built by
        ``deadline`` (``stats["exact_skipped"]`` says so; to ``deadline`` only while no
        schedule is known to fit, so that searches below the keep-set floor keep theirs;
        to ``skipped_blocks_share`` of it where set); to ``share`` of the limit otherwise."""
        rest = self._skipped_until(whole, deadline, best)
        try:
            cap = cost_cap(best.objective) if best.feasible else None
            lower = program_terms_lower(graph, max_cost_s=cap, deadline=deadline)
        except DeadlineExceeded:
            return rest.remaining_s()
        if not _builds_in(lower, deadline):
            stats["exact_skipped"] = (
                f"at least {lower} program terms, more than {EXACT_BUILD_TERMS_PER_S:.0e} "
                f"per second builds in the {deadline.remaining_s() or 0.0:.1f} s that were left"
            )
            return rest.remaining_s()
        return None if share is None else max(0.0, share - deadline.elapsed_s())

    def _skipped_until(self, whole: Deadline, deadline: Deadline, best: SolveResult) -> Deadline:
        """Where the block search ends when the exact phase is skipped: the exact phase's
        ``deadline`` while no schedule is known to fit, else ``skipped_blocks_share`` of
        the ``whole`` limit."""
        return whole.share(self.skipped_blocks_share) if best.feasible else deadline

    def _time_left(self, deadline: Deadline) -> bool:
        """Whether at least ``min_milp_s`` of the time limit is left."""
        left = deadline.remaining_s()
        return left is None or left >= self.min_milp_s

    def _incumbent_result(
        self,
        graph: CostGraph,
        best: SolveResult,
        budget_bytes: int,
        deadline: Deadline,
        stats: dict[str, Any],
        solver: str,
    ) -> SolveResult:
        """The incumbent as this solver's result: no bound (the model was not solved)."""
        return result_from_profile(
            best.schedule,
            simulate(graph, best.schedule),
            budget_bytes=budget_bytes,
            solver=solver,
            solve_s=deadline.elapsed_s(),
            stats={**stats, "complete_model": False},
        )
