"""The interval program as a MILP, solved by a backend bundled with OR-Tools (HiGHS or SCIP).

The same program as :mod:`chkpt_opt.solvers.cpsat` (linear form), through
``ortools.linear_solver.pywraplp``. The objective is the recompute time scaled so that the
whole forward time is 10**6 units (well conditioned); the relative and absolute gaps are set
to 0, so ``optimal`` means proven. The backend works
with tolerances; the solution is therefore rounded to 0/1, evaluated exactly by the interval
model, and when the rounded solution exceeds the budget by a few bytes the MILP is solved
again with the budget tightened by that excess (the result is then reported ``feasible``
unless its objective still meets the first solve's bound).

HiGHS is the default: measured faster than SCIP on 2 cores, though not by much (four budgets
each on the corpus graphs vgg/mlp/resnet/unet/encoder/vit/mobilenet_small: 15.9 s against 17.0
s in all; on random DAGs and traced models of 20-60 ops: 36.8 s against 43.1 s; on gpt_small,
106 ops: 24.7 s, all proven). The warm start is passed as a hint where the backend takes one:
SCIP (OR-Tools 9.15's HiGHS interface crashes on hints). OR-Tools reports HiGHS' incumbent as
its best bound, so with HiGHS a bound is only given once optimality is proven. Both backends
run single-threaded with a fixed seed, so results are deterministic.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ortools.linear_solver import pywraplp

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult
from chkpt_opt.solvers.cpsat import solve_min_peak
from chkpt_opt.solvers.interval_model import BuildTimeout, IntervalModel
from chkpt_opt.solvers.interval_program import IntervalProgram, check_deadline
from chkpt_opt.solvers.interval_solve import (
    DEFAULT_MAX_POSITIONS,
    Outcome,
    Prepared,
    candidate_positions,
    finish,
    keep_all_result,
    prepare,
    record_lowest,
    remaining_s,
    warm_start,
)
from chkpt_opt.solvers.registry import register

BACKENDS = {"highs": "HIGHS", "scip": "SCIP"}
DEFAULT_BACKEND = "highs"
HINTED_BACKENDS = ("scip",)  # pywraplp crashes on SetHint with HiGHS (OR-Tools 9.15)
OBJECTIVE_UNITS = 1e6
MAX_TIGHTENINGS = 3


def objective_scale(model: IntervalModel) -> float:
    """Objective units per second of recompute: the whole forward time is OBJECTIVE_UNITS."""
    return OBJECTIVE_UNITS / model.total_fwd_s if model.total_fwd_s > 0 else 1.0


@dataclass
class MilpVariables:
    """The variables of a MILP of an interval program."""

    z: list[pywraplp.Variable]
    x: list[pywraplp.Variable]
    y: list[pywraplp.Variable]


def build_milp(
    program: IntervalProgram,
    budget_units: int,
    *,
    backend: str = DEFAULT_BACKEND,
    relax: bool = False,
    deadline: float | None = None,
) -> tuple[pywraplp.Solver, MilpVariables]:
    """The interval program as a pywraplp model (``relax``: its LP relaxation, solved by GLOP).

    ``deadline`` (a ``time.perf_counter()`` value) stops the build with
    :class:`~chkpt_opt.solvers.interval_model.BuildTimeout` once passed.

    Raises:
        SolverError: for an unknown backend, or one this OR-Tools build lacks.
    """
    if relax:
        solver = pywraplp.Solver.CreateSolver("GLOP")
    else:
        if backend not in BACKENDS:
            raise SolverError(
                f"MILP backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}."
            )
        solver = pywraplp.Solver.CreateSolver(BACKENDS[backend])
    if solver is None:
        raise SolverError(f"this OR-Tools build has no {backend!r} backend; try another one.")
    model = program.model
    n = model.n_ops
    new = solver.NumVar if relax else solver.BoolVar
    bounds = (0.0, 1.0) if relax else ()

    # z[i]: op i lies outside every region.
    z = [new(*bounds, f"z{i}") for i in range(n)]
    # x[k]: candidate interval k is a region.
    x = [new(*bounds, f"x{k}") for k in range(len(model.intervals))]
    # y[j]: lifetime y_keys[j][0] is held at least until its end y_keys[j][1].
    y = [new(*bounds, f"y{lt}_{k}") for lt, k in program.y_keys]

    # Rows are set coefficient by coefficient: building them as Python expressions takes
    # 20 times longer on programs of a million nonzeros.
    inf = solver.infinity()

    def row(lb: float, ub: float, terms: list[tuple[pywraplp.Variable, float]]) -> None:
        constraint = solver.Constraint(lb, ub)
        for var, coef in terms:
            constraint.SetCoefficient(var, coef)

    for p in range(n + 1):
        out = ([z[p]] if p < n else []) + [x[k] for k in program.starts[p]]
        into = ([z[p - 1]] if p > 0 else []) + [x[k] for k in program.stops[p]]
        if p == 0:
            row(1, 1, [(var, 1) for var in out])
        elif p == n:
            row(1, 1, [(var, 1) for var in into])
        else:
            row(0, 0, [(var, 1) for var in out] + [(var, -1) for var in into])
    for hold in program.holds:
        rhs = [x[k] for k in hold.x_ids] + ([z[hold.node]] if hold.node is not None else [])
        row(0, inf, [(y[hold.y_var], 1)] + [(var, -1) for var in rhs])
    for hi, lo in program.chains:
        row(0, inf, [(y[hi], 1), (y[lo], -1)])
    for count, mem in enumerate(program.memory_rows):
        if count % 16 == 0:
            check_deadline(deadline, "the MILP's memory rows")
        terms = [(x[k], c) for k, c in mem.x_terms] + [(y[j], c) for j, c in mem.y_terms]
        row(-inf, budget_units - mem.const, terms)
    if program.fixed_bytes // program.byte_unit > budget_units:
        row(2, inf, [(z[0], 1)])  # the schedule-independent bytes alone exceed the budget

    scale = objective_scale(model)
    objective = solver.Objective()
    for k, iv in enumerate(model.intervals):
        objective.SetCoefficient(x[k], iv.cost_s * scale)
    objective.SetMinimization()
    return solver, MilpVariables(z, x, y)


def run_milp(
    solver: pywraplp.Solver, *, time_limit_s: float | None, seed: int, backend: str
) -> int:
    """Solves with deterministic settings, single-threaded, silent, with zero gaps; returns
    the pywraplp status.

    OR-Tools' HiGHS interface ignores ``MPSolverParameters`` gaps, so HiGHS gets its options
    as a solver-specific string (which that interface forwards, though it reports False).
    """
    solver.SuppressOutput()
    solver.SetNumThreads(1)
    if time_limit_s is not None:
        solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    if backend == "highs":
        solver.SetSolverSpecificParametersAsString(
            f"output_flag=false\nmip_rel_gap=0\nmip_abs_gap=0\nrandom_seed={seed}\nthreads=1"
        )
    elif backend == "scip":
        solver.SetSolverSpecificParametersAsString(
            f"randomization/randomseedshift = {seed}\nlimits/gap = 0\nlimits/absgap = 0\n"
        )
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 0.0)
    return solver.Solve(params)


def solve_milp(
    prepared: Prepared,
    budget_bytes: int,
    *,
    backend: str = DEFAULT_BACKEND,
    seed: int = 0,
    hint_ids: list[int] | None = None,
    time_limit_s: float | None = None,
) -> Outcome:
    """Solves the program of ``prepared`` as a MILP under ``budget_bytes``.

    The rounded solution is evaluated exactly by the interval model; when it exceeds the
    budget by a few bytes (backend tolerances) the MILP is solved again with the budget
    tightened by the excess, up to :data:`MAX_TIGHTENINGS` times (no proof then).

    Args:
        prepared: the interval model and its program.
        budget_bytes: the budget.
        backend: ``"highs"`` or ``"scip"``.
        seed: the backend's random seed.
        hint_ids: interval ids of a known schedule, hinted where the backend takes hints.
        time_limit_s: limit of all the solves together.
    """
    start = time.perf_counter()
    model, program = prepared.model, prepared.program
    scale = objective_scale(model)
    budget_units = program.budget_units(budget_bytes)
    first_bound: float | None = None
    first_status: int | None = None
    chosen: list[int] | None = None
    stats: dict[str, Any] = {"backend": backend, "tightenings": 0}
    deadline = None if time_limit_s is None else start + time_limit_s
    for attempt in range(MAX_TIGHTENINGS + 1):
        try:
            solver, v = build_milp(program, budget_units, backend=backend, deadline=deadline)
        except BuildTimeout:
            stats["milp_build_timed_out"] = True
            if attempt == 0:
                first_status = pywraplp.Solver.NOT_SOLVED
            break
        if hint_ids is not None and backend in HINTED_BACKENDS:
            z, x, y = program.values(hint_ids)
            solver.SetHint(v.z + v.x + v.y, [float(a) for a in z + x + y])
        status = run_milp(
            solver, time_limit_s=remaining_s(time_limit_s, start), seed=seed, backend=backend
        )
        found = status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
        if attempt == 0:
            first_status = status
            # OR-Tools reports HiGHS' incumbent as its bound: only a proof counts there.
            if status == pywraplp.Solver.OPTIMAL or (found and backend == "scip"):
                first_bound = solver.Objective().BestBound()
        if not found:
            break
        chosen = [k for k, var in enumerate(v.x) if var.solution_value() > 0.5]
        excess = model.peak_bytes(chosen) - budget_bytes
        if excess <= 0:
            break
        stats["tightenings"] = attempt + 1
        budget_units -= -(-excess // program.byte_unit)
        chosen = None
    stats["milp_status"] = _STATUS.get(first_status, str(first_status))
    proven = first_status == pywraplp.Solver.OPTIMAL and stats["tightenings"] == 0
    infeasible = first_status == pywraplp.Solver.INFEASIBLE
    # The objective's rounding error at this scale is negligible; take the bound as is,
    # scaled to integer-cost units for finish().
    bound_units = None if first_bound is None else first_bound / scale * program.cost_scale
    return Outcome(chosen, proven and chosen is not None, infeasible, bound_units, stats)


@register("milp", "MILP over the interval model (HiGHS or SCIP): optimal schedule, proven bound")
@dataclass(frozen=True)
class MilpSolver:
    """Exact solver: the interval program as a MILP.

    Attributes:
        backend: ``"highs"`` (default, faster here) or ``"scip"``.
        seed: backend random seed (SCIP).
        max_positions: see :class:`~chkpt_opt.solvers.cpsat.CpSatSolver`.
        warm_start: hint the greedy schedule (where the backend takes hints).
        prune: on graphs with more than ``max_positions`` allowed cuts, solve over every cut
            after exact pruning (:class:`~chkpt_opt.solvers.pruning.PrunedSolver`) instead of
            over a subset of cuts. Measured on the corpus graphs of 184-298 ops: proven
            optimal in 60 s at budgets 0.9-0.3, where the subset gave no bound.
    """

    backend: str = DEFAULT_BACKEND
    seed: int = 0
    max_positions: int | None = DEFAULT_MAX_POSITIONS
    warm_start: bool = True
    prune: bool = True
    name: str = "milp"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        if self.backend not in BACKENDS:
            raise SolverError(
                f"MILP backend {self.backend!r} is unknown; use one of {', '.join(BACKENDS)}."
            )
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, start=start)
        if trivial is not None:
            return trivial
        if self.prune and candidate_positions(graph, max_positions=self.max_positions):
            from chkpt_opt.solvers.pruning import solve_pruned_as  # it builds on this module

            return solve_pruned_as(
                self.name,
                graph,
                budget_bytes,
                backend=self.backend,
                seed=self.seed,
                time_limit_s=time_limit_s,
                start=start,
            )
        prepared = prepare(graph, max_positions=self.max_positions)
        fallback, hint_ids = warm_start(graph, budget_bytes, prepared.model, time_limit_s=None)
        outcome = solve_milp(
            prepared,
            budget_bytes,
            backend=self.backend,
            seed=self.seed,
            hint_ids=hint_ids if self.warm_start else None,
            time_limit_s=remaining_s(time_limit_s, start),
        )
        stats = dict(outcome.stats)
        infeasible = outcome.proven_infeasible
        lowest = None
        if infeasible:
            schedule, profile, lower, min_proven = solve_min_peak(
                graph, prepared, time_limit_s=remaining_s(time_limit_s, start), seed=self.seed
            )
            lowest = record_lowest(stats, schedule, profile, lower_bytes=lower, proven=min_proven)
            outcome = dataclasses.replace(outcome, stats=stats)
        return finish(
            graph,
            budget_bytes,
            prepared,
            outcome,
            solver=self.name,
            start=start,
            fallback=fallback,
            lowest=lowest,
        )


_STATUS = {
    pywraplp.Solver.OPTIMAL: "OPTIMAL",
    pywraplp.Solver.FEASIBLE: "FEASIBLE",
    pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
    pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
    pywraplp.Solver.ABNORMAL: "ABNORMAL",
    pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED",
}
