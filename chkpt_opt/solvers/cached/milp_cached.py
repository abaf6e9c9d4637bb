"""``solver="milp_cached"``: exact one-level schedules with cached ops, by the interval
program over cache columns (:mod:`~chkpt_opt.solvers.interval.cache_columns`), solved by the MILP
engine (:mod:`~chkpt_opt.solvers.engines.milp_engine`).

Each candidate region span comes once as a keep-set region and once per set of its ops it
may cache, so the program chooses the regions and, inside each, which ops'
outputs are saved (``MUST_SAVE``) and which are recomputed, with the memory of every slot
exactly as :func:`chkpt_opt.memory_model.op_sequence.lower` counts it (the replay of a region with
cached ops step by step); every schedule it returns is simulated and must match the model
(:func:`~chkpt_opt.solvers.interval.judge.judged`).

**Claim.** ``optimal`` means optimal over one-level schedules (regions at allowed cuts, no
nesting) whose regions each cache one of the model's sets (``cache="ranked"``: a prefix
of the region's cacheable ops ranked by recompute time saved per byte; ``"subsets"``:
any subset, on graphs whose regions have at most 10 such ops), within the model's domain
(:mod:`~chkpt_opt.solvers.interval.cache_columns`); ``stats["optimal_over"]`` says so.
That space holds every keep-set schedule, so the optimum is never costlier than the
keep-set optimum. Regions are restricted to the cuts of
:func:`~chkpt_opt.solvers.interval.prepare.candidate_positions` on graphs with more than
``max_positions`` allowed cuts (then never ``optimal``). The solver
first solves for the keep-set optimum (the interval program without columns, in at most
30% of the time limit): the warm start, the result when the columns' program finds
nothing better in time, and the cost cap of the columns (exact: no region of a cheaper
schedule costs more than it). Graphs over
:data:`~chkpt_opt.solvers.interval.prepare.MAX_FLAT_OPS` ops are refused.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult, SolveStatus, keep_all_result
from chkpt_opt.solvers.bounds.lowest_peak import with_lowest_peak
from chkpt_opt.solvers.deadline import Deadline, DeadlineExceeded
from chkpt_opt.solvers.engines.milp_engine import DEFAULT_BACKEND, check_backend, milp_engine
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.interval.cache_columns import CACHE_MODES
from chkpt_opt.solvers.interval.judge import finish
from chkpt_opt.solvers.interval.prepare import (
    DEFAULT_MAX_POSITIONS,
    Prepared,
    candidate_positions,
    check_flat_size,
)
from chkpt_opt.solvers.interval.program import build_program
from chkpt_opt.solvers.keepset.flat import solve_flat
from chkpt_opt.solvers.keepset.warm_start import hint_ids
from chkpt_opt.solvers.registry import register

KEEP_SET_SHARE = 0.3
"""Share of the time limit the keep-set stage may take."""

SPACES = {
    "ranked": "one-level schedules whose regions cache a prefix of their cacheable ops "
    "ranked by recompute time saved per byte",
    "subsets": "one-level schedules whose regions cache any subset of their cacheable ops",
}


@register(
    "milp_cached",
    "MILP over regions and their cached ops (one level): optimal in that space, proven bound",
)
@dataclass(frozen=True)
class MilpCachedSolver:
    """Exact solver over one-level schedules with cached ops (see the module docstring).

    Attributes:
        cache: which sets of a region's ops become columns: ``"ranked"`` or ``"subsets"``.
        backend: the MILP backend, ``"highs"`` or ``"scip"``.
        seed: backend random seed.
        max_positions: above this many allowed cut positions, regions are restricted to a
            candidate subset of cuts (never ``optimal`` then); None: every cut.
        warm_start: hint the greedy schedule to the keep-set stage, and the keep-set
            stage's schedule to the columns' program (where the backend takes hints).
        keep_set: a keep-set result the caller already has at this budget (``auto``'s):
            used in place of the keep-set stage (the fallback, the hint, and where it
            fits, the columns' cost cap, exact since it lies in the space).
        cost_cap_s: search only schedules cheaper than this (the cost of a caller's
            incumbent, which may lie outside the space): a smaller program. Below the
            keep-set result's cost no proof is claimed (the space's optimum may cost more
            than the cap); nothing below the cap returns the keep-set result.
    """

    cache: str = "ranked"
    backend: str = DEFAULT_BACKEND
    seed: int = 0
    max_positions: int | None = DEFAULT_MAX_POSITIONS
    warm_start: bool = True
    keep_set: SolveResult | None = None
    cost_cap_s: float | None = None
    name: str = "milp_cached"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        deadline = Deadline.after(time_limit_s)
        check_backend(self.backend)
        if self.cache not in SPACES:
            raise SolverError(
                f"cache={self.cache!r} is not a cache mode of milp_cached; use one of "
                f"{[m for m in CACHE_MODES if m in SPACES]}."
            )
        space = {"optimal_over": SPACES[self.cache], "proofs_over": f"cached_{self.cache}"}
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, deadline=deadline)
        if trivial is not None:
            return dataclasses.replace(trivial, stats={**trivial.stats, **space})
        check_flat_size(graph)
        # The keep-set optimum first (a part of the space): the warm start, the fallback,
        # and the cost cap of the columns (exact: every region of a cheaper schedule costs
        # less than it).
        keep = self.keep_set
        if keep is None:
            keep = solve_flat(
                self.name,
                graph,
                budget_bytes,
                deadline=deadline.share(KEEP_SET_SHARE),
                engine=milp_engine(self.backend, self.seed),
                max_positions=self.max_positions,
                pruned=None,
                warm_start_hint=self.warm_start,
                lowest_settings={"seed": self.seed},
            )
        elif keep.budget_bytes != budget_bytes or not keep.schedule.is_keep_set():
            raise SolverError(
                f"milp_cached's keep_set result (budget {keep.budget_bytes} bytes, "
                f"{'keep-set' if keep.schedule.is_keep_set() else 'not keep-set'}) must be a "
                f"keep-set schedule solved at this budget ({budget_bytes} bytes); pass the "
                "keep-set result of this graph and budget, or None to solve for it here."
            )
        try:
            result = self._solve(graph, budget_bytes, keep, deadline)
        except DeadlineExceeded as err:
            timed_out = dataclasses.replace(
                keep,
                status=SolveStatus.FEASIBLE if keep.feasible else SolveStatus.TIMED_OUT,
                bound=None,
                proves_infeasible=False,
                solve_s=deadline.elapsed_s(),
            )
            stats = {"timed_out": str(err), "cache": self.cache, "keep_set": keep_summary(keep)}
            return dataclasses.replace(timed_out, stats=stats)
        stats = {**result.stats, "cache": self.cache, "keep_set": keep_summary(keep)}
        if result.proven:
            stats.update(space)
        return dataclasses.replace(result, stats=stats)

    def _solve(
        self, graph: CostGraph, budget_bytes: int, keep: SolveResult, deadline: Deadline
    ) -> SolveResult:
        start = time.perf_counter()
        caps = [
            c for c in (keep.objective if keep.feasible else None, self.cost_cap_s) if c is not None
        ]
        model = build_interval_model(
            graph,
            positions=candidate_positions(graph, max_positions=self.max_positions),
            max_cost_s=min(caps, default=None),
            cache=self.cache,
            deadline=deadline,
        )
        program = build_program(model, deadline=deadline)
        prepared = Prepared(model, program, time.perf_counter() - start)
        outcome = milp_engine(self.backend, self.seed)(
            program,
            budget_bytes,
            hint_ids(graph, model, keep) if self.warm_start else None,
            deadline,
        )
        lowest = None
        if not keep.feasible and self.cost_cap_s is None:  # a caller with a cap has a fit
            outcome, lowest = with_lowest_peak(
                graph, prepared, outcome, deadline, {"seed": self.seed}
            )
        return finish(
            graph,
            budget_bytes,
            prepared,
            outcome,
            solver=self.name,
            deadline=deadline,
            fallback=keep,
            lowest=lowest,
        )


def keep_summary(keep: SolveResult) -> dict[str, object]:
    """What the keep-set stage found, for ``stats["keep_set"]``."""
    return {
        "status": keep.status.value,
        "objective_s": keep.objective,
        "bound_s": keep.bound,
        "peak_bytes": keep.peak_bytes,
    }
