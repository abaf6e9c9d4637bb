"""The MILP engine: the interval program through ``ortools.linear_solver.pywraplp``, solved
by a backend bundled with OR-Tools (HiGHS or SCIP); a program in, an
:class:`~chkpt_opt.solvers.interval.judge.Outcome` out.

The same program as the CP-SAT engine (linear form). The objective is the recompute time in
the float units of :attr:`~chkpt_opt.solvers.interval.program.IntervalProgram.float_scale`
(well conditioned); the relative and absolute gaps are set to 0, so ``optimal`` means proven.
The backend works with tolerances; the solution is therefore rounded to 0/1, evaluated
exactly by the interval model, and when the rounded solution exceeds the budget by a few
bytes the MILP is solved again with the budget tightened by that excess (the outcome is then
not proven).

HiGHS is the default: measured faster than SCIP on 2 cores, though not by much (four budgets
each on the corpus graphs vgg/mlp/resnet/unet/encoder/vit/mobilenet_small: 15.9 s against 17.0
s in all; on random DAGs and traced models of 20-60 ops: 36.8 s against 43.1 s; on gpt_small,
106 ops: 24.7 s, all proven). The warm start is passed as a hint where the backend takes one:
SCIP (OR-Tools 9.15's HiGHS interface crashes on hints). OR-Tools reports HiGHS' incumbent as
its best bound, so with HiGHS a bound is only given once optimality is proven. Both backends
run single-threaded with a fixed seed, so results are deterministic. HiGHS may overrun its
time limit in presolve and OR-Tools cannot interrupt it: it runs in a child process, killed
when still running a second past the deadline (the solve then counts as not solved); SCIP
runs in this process and is interrupted there (:func:`run_milp`). Nothing is left running.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ortools.linear_solver import linear_solver_pb2, pywraplp

from chkpt_opt.errors import SolverError
from chkpt_opt.solvers.deadline import (
    NO_DEADLINE,
    Deadline,
    DeadlineExceeded,
    run_child,
    run_stoppable,
)
from chkpt_opt.solvers.interval.judge import Outcome
from chkpt_opt.solvers.interval.program import IntervalProgram, ProgramVariables

BACKENDS = {"highs": "HIGHS", "scip": "SCIP"}
DEFAULT_BACKEND = "highs"
HINTED_BACKENDS = ("scip",)  # pywraplp crashes on SetHint with HiGHS (OR-Tools 9.15)
MAX_TIGHTENINGS = 3
UNKNOWN_STATUS = 99  # what pywraplp returns when HiGHS stops at its time limit

MilpVariables = ProgramVariables[pywraplp.Variable]
log = logging.getLogger(__name__)


def check_backend(backend: str) -> None:
    """Refuses an unknown MILP backend (SolverError, naming the known ones)."""
    if backend not in BACKENDS:
        raise SolverError(f"MILP backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}.")


def build_milp(
    program: IntervalProgram,
    budget_units: int,
    *,
    backend: str = DEFAULT_BACKEND,
    relax: bool = False,
    deadline: Deadline = NO_DEADLINE,
) -> tuple[pywraplp.Solver, MilpVariables]:
    """The interval program as a pywraplp model (``relax``: its LP relaxation, solved by GLOP).

    ``deadline`` stops the build with
    :class:`~chkpt_opt.solvers.deadline.DeadlineExceeded` once it has expired.

    Raises:
        SolverError: for an unknown backend, or one this OR-Tools build lacks.
    """
    if relax:
        solver = pywraplp.Solver.CreateSolver("GLOP")
    else:
        check_backend(backend)
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
    for count, hold in enumerate(program.holds):
        if count % 16 == 0:
            deadline.check("building the MILP's hold rows")
        rhs = [x[k] for k in hold.x_ids] + ([z[hold.node]] if hold.node is not None else [])
        row(0, inf, [(y[hold.y_var], 1)] + [(var, -1) for var in rhs])
    for hi, lo in program.chains:
        row(0, inf, [(y[hi], 1), (y[lo], -1)])
    for count, mem in enumerate(program.memory_rows):
        if count % 16 == 0:
            deadline.check("building the MILP's memory rows")
        terms = [(x[k], c) for k, c in mem.x_terms] + [(y[j], c) for j, c in mem.y_terms]
        row(-inf, budget_units - mem.const, terms)
    if program.fixed_bytes // program.byte_unit > budget_units:
        row(2, inf, [(z[0], 1)])  # the schedule-independent bytes alone exceed the budget

    scale = program.float_scale
    objective = solver.Objective()
    for k, iv in enumerate(model.intervals):
        objective.SetCoefficient(x[k], iv.cost_s * scale)
    objective.SetMinimization()
    return solver, ProgramVariables(z, x, y)


@dataclass(frozen=True)
class MilpRun:
    """What one MILP solve returned.

    Attributes:
        status: the pywraplp status (:data:`UNKNOWN_STATUS` where HiGHS stopped at its
            limit; ``NOT_SOLVED`` where the solve was killed past the deadline).
        values: the solution's variable values by variable index (None without one).
        best_bound: the backend's best bound (None without a solution).
        killed: the solve ran past the deadline and its process was killed.
    """

    status: int
    values: list[float] | None
    best_bound: float | None
    killed: bool = False


def _options(backend: str, seed: int) -> str:
    """The backend's options as a solver-specific string: zero gaps, the seed, one thread.
    OR-Tools' HiGHS interface ignores ``MPSolverParameters`` gaps but forwards this string
    (though it reports False)."""
    if backend == "highs":
        return f"output_flag=false\nmip_rel_gap=0\nmip_abs_gap=0\nrandom_seed={seed}\nthreads=1"
    return f"randomization/randomseedshift = {seed}\nlimits/gap = 0\nlimits/absgap = 0\n"


_HIGHS_CHILD = """
import sys
from ortools.linear_solver import linear_solver_pb2, pywraplp
request = linear_solver_pb2.MPModelRequest.FromString(sys.stdin.buffer.read())
solver = pywraplp.Solver.CreateSolver("HIGHS")
error = solver.LoadModelFromProto(request.model)
if error:
    sys.exit("the MILP did not load: " + error)
solver.SuppressOutput()
solver.SetNumThreads(1)
if request.HasField("solver_time_limit_seconds"):
    solver.SetTimeLimit(max(1, int(request.solver_time_limit_seconds * 1000)))
solver.SetSolverSpecificParametersAsString(request.solver_specific_parameters)
params = pywraplp.MPSolverParameters()
params.SetDoubleParam(params.RELATIVE_MIP_GAP, 0.0)
status = solver.Solve(params)
response = linear_solver_pb2.MPSolutionResponse()
solver.FillSolutionResponseProto(response)
response.status = status
sys.stdout.buffer.write(response.SerializeToString())
"""
"""The HiGHS solve of :func:`run_milp`, run as ``python -c`` in a child process: the model
as an ``MPModelRequest`` on its standard input, the ``MPSolutionResponse`` (status set to
the pywraplp status) on its standard output. It imports OR-Tools alone (0.35 s to start)."""


def run_milp(solver: pywraplp.Solver, *, deadline: Deadline, seed: int, backend: str) -> MilpRun:
    """Solves with deterministic settings, single-threaded, silent, with zero gaps, within
    ``deadline`` (plus :data:`~chkpt_opt.solvers.deadline.GRACE_S`).

    HiGHS checks its own limit only between presolve steps and OR-Tools cannot interrupt it
    (``InterruptSolve`` returns False), so it runs in a child process (the model sent as a
    proto), killed past the deadline; SCIP runs here and is interrupted past it. Nothing
    started here is left running when this returns.
    """
    time_limit_s = deadline.remaining_s()
    options = _options(backend, seed)
    if backend == "highs" and sys.executable:
        request = linear_solver_pb2.MPModelRequest()
        solver.ExportModelToProto(request.model)
        if time_limit_s is not None:
            request.solver_time_limit_seconds = time_limit_s
        request.solver_specific_parameters = options
        out = run_child(
            deadline,
            [sys.executable, "-c", _HIGHS_CHILD],
            request.SerializeToString(),
            what="the highs MILP solve",
        )
        if out is None:
            return MilpRun(pywraplp.Solver.NOT_SOLVED, None, None, killed=True)
        response = linear_solver_pb2.MPSolutionResponse.FromString(out)
        found = response.status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
        return MilpRun(
            int(response.status),
            list(response.variable_value) if found else None,
            response.best_objective_bound if found else None,
        )
    solver.SuppressOutput()
    solver.SetNumThreads(1)
    if time_limit_s is not None:
        solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    solver.SetSolverSpecificParametersAsString(options)
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 0.0)
    status = run_stoppable(
        deadline,
        functools.partial(solver.Solve, params),
        stop=solver.InterruptSolve,
        what=f"the {backend} MILP solve",
    )
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return MilpRun(status, None, None)
    values = [var.solution_value() for var in solver.variables()]
    return MilpRun(status, values, solver.Objective().BestBound())


def solve_milp(
    program: IntervalProgram,
    budget_bytes: int,
    *,
    backend: str = DEFAULT_BACKEND,
    seed: int = 0,
    hint_ids: list[int] | None = None,
    deadline: Deadline = NO_DEADLINE,
) -> Outcome:
    """Solves ``program`` as a MILP under ``budget_bytes``.

    The rounded solution is evaluated exactly by the interval model; when it exceeds the
    budget by a few bytes (backend tolerances) the MILP is solved again with the budget
    tightened by the excess, up to :data:`MAX_TIGHTENINGS` times (no proof then).

    Args:
        program: the interval program.
        budget_bytes: the budget.
        backend: ``"highs"`` or ``"scip"``.
        seed: the backend's random seed.
        hint_ids: interval ids of a known schedule, hinted where the backend takes hints.
        deadline: the limit of all the builds and solves together.

    A budget below the program's schedule-independent bytes is proven infeasible at once.
    """
    model = program.model
    scale = program.float_scale
    budget_units = program.budget_units(budget_bytes)
    first_bound: float | None = None
    first_status: int | None = None
    chosen: list[int] | None = None
    check_backend(backend)
    stats: dict[str, Any] = {"backend": backend, "tightenings": 0}
    if program.fixed_bytes // program.byte_unit > budget_units:
        # What the MILP would prove (its row z[0] >= 2), without building it: building
        # and presolving the program of a 270-op Llama over every cut took 50 s.
        stats.update(milp_status="INFEASIBLE", infeasible_by="schedule-independent bytes")
        return Outcome(None, False, True, None, stats)
    for attempt in range(MAX_TIGHTENINGS + 1):
        try:
            solver, v = build_milp(program, budget_units, backend=backend, deadline=deadline)
        except DeadlineExceeded:
            stats["milp_build_timed_out"] = True
            if attempt == 0:
                first_status = pywraplp.Solver.NOT_SOLVED
            break
        if hint_ids is not None and backend in HINTED_BACKENDS:
            z, x, y = program.values(hint_ids)
            solver.SetHint(v.z + v.x + v.y, [float(a) for a in z + x + y])
        run = run_milp(solver, deadline=deadline, seed=seed, backend=backend)
        if run.killed:
            stats["milp_killed_at_deadline"] = True
        status = run.status
        if attempt == 0:
            first_status = status
            # OR-Tools reports HiGHS' incumbent as its bound: only a proof counts there.
            if status == pywraplp.Solver.OPTIMAL or (run.values and backend == "scip"):
                first_bound = run.best_bound
        if run.values is None:
            break
        chosen = [k for k, var in enumerate(v.x) if run.values[var.index()] > 0.5]
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


_STATUS = {
    pywraplp.Solver.OPTIMAL: "OPTIMAL",
    pywraplp.Solver.FEASIBLE: "FEASIBLE",
    pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
    pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
    pywraplp.Solver.ABNORMAL: "ABNORMAL",
    pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED",
    UNKNOWN_STATUS: "UNKNOWN (a limit was reached; OR-Tools' HiGHS interface returns no incumbent)",
}


def milp_engine(
    backend: str = DEFAULT_BACKEND, seed: int = 0
) -> Callable[[IntervalProgram, int, list[int] | None, Deadline], Outcome]:
    """:func:`solve_milp` with its settings bound, as the flat front-ends call an engine:
    ``engine(program, budget_bytes, hint_ids, deadline)``."""

    def engine(
        program: IntervalProgram, budget_bytes: int, hint_ids: list[int] | None, deadline: Deadline
    ) -> Outcome:
        return solve_milp(
            program, budget_bytes, backend=backend, seed=seed, hint_ids=hint_ids, deadline=deadline
        )

    return engine
