"""The CP-SAT engine: the interval program as a CP-SAT model, solved; a program in, an
:class:`~chkpt_opt.solvers.interval.judge.Outcome` (interval ids, proofs, bound) out.

The program is the one of :mod:`chkpt_opt.solvers.interval.program`: 0/1 variables choosing
the regions (a path through the cut positions), 0/1 variables for how long each forward
storage lives, and the memory of every slot of the forward and backward timeline kept under
the budget. Two forms of the memory constraint are available:

* ``"linear"``: one linear row per distinct slot (time-indexed);
* ``"cumulative"`` (Moccasin-style): one interval per storage lifetime, whose end is a sum of
  0/1 variables, optional intervals for each region's replay and the recomputed storages it
  holds, fixed intervals for the schedule-independent bytes, and a single cumulative
  constraint of capacity ``budget_bytes``.

Both are exact and agree (tests). The linear form is the default: measured 2 to 100 times
faster on 2 cores (random DAGs of 20-80 ops, traced GPT/ResNet/U-Net/MLP of 29-58 ops, four
budgets each; e.g. a 34-op MLP: 1.2 s against 50-60 s per budget, and the cumulative form left
gaps open at 60 s on an 80-op DAG), because its LP relaxation is much stronger. The objective
is the recompute time in integer units (see :mod:`~chkpt_opt.solvers.interval.program`). With
a single worker the search is deterministic for a fixed ``seed``.

Time limits: the long rows go straight into the model's proto (built as expressions, the
20.7 million terms of a 270-op Llama over every cut took 27 s; now the whole model takes
4 s), and the build checks its deadline as it goes. CP-SAT gets what is left of the deadline
as its limit, but some of its presolve steps check no limit: on that model its clique
merging (``[MaxClique]``) alone took 380-480 s under a limit of 30 s (a solve given 58 s
returned after 415 s), so models of more than :data:`LARGE_MODEL_TERMS` terms skip it
(``merge_at_most_one_work_limit=0``; the same model then stopped at its 40 s limit), and a
solve still running a second past the deadline is told to stop and returns what it has
(:func:`run_cp`; no thread is left running). CP-SAT's loading of a model checks no limit
either and costs about what its build did (20 million terms: build 2.5 s, a solve given the
0.5 s left returned after 2.6 s), so a solve left less time than the build took is not
started (:func:`build_in_time`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, DeadlineExceeded, run_stoppable
from chkpt_opt.solvers.interval.judge import Outcome
from chkpt_opt.solvers.interval.program import IntervalProgram, ProgramVariables

DEFAULT_FORMULATION = "linear"
FORMULATIONS = ("linear", "cumulative")
LARGE_MODEL_TERMS = 1_000_000
"""Models with more terms than this skip CP-SAT's clique merging in presolve, which checks
no time limit (see the module docstring)."""
ROWS_PER_CHECK = 16
"""Rows built between two checks of the deadline."""
MIN_SECOND_SOLVE_S = 1.0
"""The least time left for which :func:`solve_lowest_peak` runs its second solve."""

log = logging.getLogger(__name__)

CpVariables = ProgramVariables[cp_model.IntVar]


def build_cp_model(
    program: IntervalProgram,
    capacity: int | cp_model.IntVar,
    *,
    formulation: str = DEFAULT_FORMULATION,
    model: cp_model.CpModel | None = None,
    deadline: Deadline = NO_DEADLINE,
) -> tuple[cp_model.CpModel, CpVariables]:
    """The constraints of ``program`` with memory capacity ``capacity`` (byte units).

    Args:
        program: the interval program.
        capacity: the budget in byte units, or a variable (to minimize the peak).
        formulation: ``"linear"`` or ``"cumulative"`` (see the module docstring).
        model: a model to add to (a new one by default).
        deadline: the build stops with
            :class:`~chkpt_opt.solvers.deadline.DeadlineExceeded` once it has expired.
    """
    if formulation not in FORMULATIONS:
        raise ValueError(
            f"formulation {formulation!r} is unknown; use one of {', '.join(FORMULATIONS)}."
        )
    m = model or cp_model.CpModel()
    iv_model = program.model
    n = iv_model.n_ops

    # z[i]: op i lies outside every region.
    z = [m.new_bool_var(f"z{i}") for i in range(n)]
    # x[k]: candidate interval k is a region.
    x = [m.new_bool_var(f"x{k}") for k in range(len(iv_model.intervals))]
    # y[j]: lifetime y_keys[j][0] is held at least until its end y_keys[j][1].
    y = [m.new_bool_var(f"y{lt}_{k}") for lt, k in program.y_keys]

    for p in range(n + 1):
        out = ([z[p]] if p < n else []) + [x[k] for k in program.starts[p]]
        into = ([z[p - 1]] if p > 0 else []) + [x[k] for k in program.stops[p]]
        if p == 0:
            m.add_exactly_one(out)
        elif p == n:
            m.add_exactly_one(into)
        else:
            m.add(sum(out) == sum(into))
    # Long rows go straight into the proto, by variable index (see :func:`_add_linear`).
    xi, yi, zi = ([var.index for var in vs] for vs in (x, y, z))
    for count, row in enumerate(program.holds):
        if count % ROWS_PER_CHECK == 0:
            deadline.check("building the CP-SAT model's hold rows")
        rhs = [xi[k] for k in row.x_ids] + ([zi[row.node]] if row.node is not None else [])
        if len(rhs) == 1:
            m.add_implication(x[row.x_ids[0]] if row.x_ids else z[row.node], y[row.y_var])
        else:  # y - sum(rhs) >= 0
            rhs.append(yi[row.y_var])
            _add_linear(m, rhs, [-1] * (len(rhs) - 1) + [1], 0, cp_model.INT_MAX)
    chains = program.chains
    if formulation == "cumulative" and not chains:
        chains = tuple(
            (j - 1, j)
            for j in range(1, len(program.y_keys))
            if program.y_keys[j][0] == program.y_keys[j - 1][0]
        )
    for hi, lo in chains:
        m.add_implication(y[lo], y[hi])

    if formulation == "linear":
        for count, row in enumerate(program.memory_rows):
            if count % ROWS_PER_CHECK == 0:
                deadline.check("building the CP-SAT model's memory rows")
            indices = [xi[k] for k, _ in row.x_terms] + [yi[j] for j, _ in row.y_terms]
            coefficients = [c for _, c in row.x_terms] + [c for _, c in row.y_terms]
            if isinstance(capacity, int):  # const + terms <= capacity
                _add_linear(m, indices, coefficients, cp_model.INT_MIN, capacity - row.const)
            else:  # const + terms - capacity <= 0
                indices.append(capacity.index)
                coefficients.append(-1)
                _add_linear(m, indices, coefficients, cp_model.INT_MIN, -row.const)
    else:
        _add_cumulative(m, program, capacity, x, y)
    if not isinstance(capacity, int):
        m.add(capacity >= program.fixed_bytes // program.byte_unit)
    elif program.fixed_bytes // program.byte_unit > capacity:
        m.add_bool_or([])  # the schedule-independent bytes alone exceed the budget
    return m, ProgramVariables(z, x, y)


def build_in_time(
    program: IntervalProgram,
    capacity: int | cp_model.IntVar,
    *,
    formulation: str = DEFAULT_FORMULATION,
    model: cp_model.CpModel | None = None,
    deadline: Deadline = NO_DEADLINE,
) -> tuple[cp_model.CpModel, CpVariables]:
    """:func:`build_cp_model` for a solve within ``deadline``.

    Raises:
        DeadlineExceeded: the build ran past ``deadline``, or left less time than it took:
            CP-SAT's loading of the model checks no limit and costs about the build (see
            the module docstring), so the solve would end past the deadline.
    """
    start_s = time.perf_counter()
    built = build_cp_model(
        program, capacity, formulation=formulation, model=model, deadline=deadline
    )
    build_s = time.perf_counter() - start_s
    left_s = deadline.remaining_s()
    if left_s is not None and left_s < build_s:
        raise DeadlineExceeded(
            f"the CP-SAT model took {build_s:.1f} s to build and {left_s:.1f} s are left: "
            "loading it would run past the deadline"
        )
    return built


def _add_linear(
    m: cp_model.CpModel, indices: list[int], coefficients: list[int], lower: int, upper: int
) -> None:
    """Adds ``lower <= sum(coefficients * variables) <= upper`` (variables by index) straight
    into the proto of ``m``: the row ``m.add`` builds from an expression (terms by ascending
    variable, zero terms left out), without building the expression. Each variable appears
    once in ``indices``."""
    if indices != sorted(indices) or 0 in coefficients:
        terms = sorted((i, c) for i, c in zip(indices, coefficients) if c)
        indices, coefficients = [i for i, _ in terms], [c for _, c in terms]
    linear = m.proto.constraints.add().linear
    linear.vars.extend(indices)
    linear.coeffs.extend(coefficients)
    linear.domain.extend([lower, upper])


def model_terms(program: IntervalProgram) -> int:
    """About how many terms the CP-SAT model of ``program`` has (hold and memory rows)."""
    holds = sum(len(row.x_ids) + 2 for row in program.holds)
    return holds + sum(len(row.x_terms) + len(row.y_terms) + 1 for row in program.memory_rows)


def _add_cumulative(
    m: cp_model.CpModel,
    program: IntervalProgram,
    capacity: int | cp_model.IntVar,
    x: list[cp_model.IntVar],
    y: list[cp_model.IntVar],
) -> None:
    """Moccasin-style memory: every live range an interval, one cumulative constraint."""
    model = program.model
    unit = program.byte_unit
    last = model.end_slot - 1
    intervals: list[cp_model.IntervalVar] = []
    demands: list[int] = []
    for s, nbytes in enumerate(model.base_bytes):
        if nbytes // unit:
            intervals.append(m.new_fixed_size_interval_var(s, 1, f"base{s}"))
            demands.append(nbytes // unit)
    y_of = {key: j for j, key in enumerate(program.y_keys)}
    for lt, life in enumerate(model.lifetimes):
        lo = life.fixed_end
        length = []
        for k, end in enumerate(life.ends):
            hi = min(end, last)
            if hi > lo:
                length.append((hi - lo) * y[y_of[lt, k]])
            lo = max(lo, hi)
        if not length or not life.size_bytes // unit:
            continue
        start = life.fixed_end + 1
        size = m.new_int_var(0, last + 1 - start, f"len{lt}")
        m.add(size == sum(length))
        intervals.append(m.new_interval_var(start, size, size + start, f"life{lt}"))
        demands.append(life.size_bytes // unit)
    for k, iv in enumerate(model.intervals):
        if iv.replay_slot is None:
            continue
        if iv.replay_peak_bytes // unit:
            intervals.append(
                m.new_optional_fixed_size_interval_var(iv.replay_slot, 1, x[k], f"replay{k}")
            )
            demands.append(iv.replay_peak_bytes // unit)
        for end, nbytes in iv.held_after_replay:
            length = min(end, last) - iv.replay_slot
            if length > 0 and nbytes // unit:
                intervals.append(
                    m.new_optional_fixed_size_interval_var(
                        iv.replay_slot + 1, length, x[k], f"held{k}_{end}"
                    )
                )
                demands.append(nbytes // unit)
    m.add_cumulative(intervals, demands, capacity)


def make_solver(
    *, time_limit_s: float | None, seed: int, workers: int, terms: int = 0
) -> cp_model.CpSolver:
    """A CP-SAT solver with deterministic settings, for a model of about ``terms`` terms
    (above :data:`LARGE_MODEL_TERMS`, presolve skips the clique merging that checks no time
    limit)."""
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.random_seed = seed
    params.num_workers = workers
    if workers > 1:
        params.interleave_search = True  # deterministic with several workers
    if time_limit_s is not None:
        params.max_time_in_seconds = max(0.01, time_limit_s)
    if terms > LARGE_MODEL_TERMS:
        params.merge_at_most_one_work_limit = 0
    return solver


def run_cp(
    solver: cp_model.CpSolver, model: cp_model.CpModel, *, deadline: Deadline, what: str
) -> int:
    """``solver.solve(model)`` on the caller's thread; a solve still running a second past
    ``deadline`` is told to stop (``stop_search``) and returns what it has
    (:func:`~chkpt_opt.solvers.deadline.run_stoppable`: nothing is left running)."""
    return run_stoppable(
        deadline, functools.partial(solver.solve, model), stop=solver.stop_search, what=what
    )


def hint(m: cp_model.CpModel, program: IntervalProgram, v: CpVariables, chosen: list[int]) -> None:
    """Adds the exact variable values of ``chosen`` as a hint."""
    z, x, y = program.values(chosen)
    for var, value in zip(v.z + v.x + v.y, z + x + y):
        m.add_hint(var, value)


@dataclass(frozen=True)
class LowestPeak:
    """The lowest-peak solution CP-SAT found, and among those the cheapest.

    Attributes:
        chosen: its interval ids.
        lower_bytes: a proven lower bound on the program's peak (0 when not proven).
        proven: the peak of ``chosen`` is proven minimal for the program.
    """

    chosen: list[int]
    lower_bytes: int
    proven: bool


def solve_lowest_peak(
    program: IntervalProgram,
    *,
    upper_bytes: int,
    deadline: Deadline = NO_DEADLINE,
    seed: int = 0,
    workers: int = 1,
    formulation: str = DEFAULT_FORMULATION,
) -> LowestPeak | None:
    """The lowest-peak solution of ``program`` (peaks up to ``upper_bytes``), and among those
    the cheapest: two solves, the smallest peak first, then the least recompute time at that
    peak, both within ``deadline`` (the second runs only when at least
    :data:`MIN_SECOND_SOLVE_S` is left; else the first solution stands). None when the first
    solve finds nothing in time.
    """
    unit = program.byte_unit
    terms = model_terms(program)
    m = cp_model.CpModel()
    top = max(upper_bytes, program.fixed_bytes) // unit + 1
    peak = m.new_int_var(program.fixed_bytes // unit, top, "peak")
    try:
        m, v = build_in_time(program, peak, formulation=formulation, model=m, deadline=deadline)
    except DeadlineExceeded as err:
        log.info("lowest peak: %s", err)
        return None
    m.minimize(peak)
    solver = make_solver(
        time_limit_s=deadline.remaining_s(), seed=seed, workers=workers, terms=terms
    )
    status = run_cp(solver, m, deadline=deadline, what="the lowest-peak CP-SAT solve")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    chosen = [k for k, var in enumerate(v.x) if solver.boolean_value(var)]
    lower = int(solver.best_objective_bound) * unit
    best_units = int(solver.value(peak))
    proven = status == cp_model.OPTIMAL
    left = deadline.remaining_s()
    if left is not None and left < MIN_SECOND_SOLVE_S:
        return LowestPeak(chosen, lower, proven)

    # Second solve: the cheapest solution at that peak.
    try:
        m2, v2 = build_in_time(program, best_units, formulation=formulation, deadline=deadline)
    except DeadlineExceeded as err:
        log.info("lowest peak: %s", err)
        return LowestPeak(chosen, lower, proven)
    m2.minimize(sum(c * x for c, x in zip(program.cost_units, v2.x)))
    hint(m2, program, v2, chosen)
    solver2 = make_solver(
        time_limit_s=deadline.remaining_s(), seed=seed, workers=workers, terms=terms
    )
    cheapest = run_cp(solver2, m2, deadline=deadline, what="the cheapest-at-lowest-peak solve")
    if cheapest in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        chosen = [k for k, var in enumerate(v2.x) if solver2.boolean_value(var)]
    return LowestPeak(chosen, lower, proven)


def solve_cp(
    program: IntervalProgram,
    budget_bytes: int,
    *,
    formulation: str = DEFAULT_FORMULATION,
    seed: int = 0,
    workers: int = 1,
    hint_ids: list[int] | None = None,
    deadline: Deadline = NO_DEADLINE,
    linearization_level: int | None = None,
) -> Outcome:
    """Solves ``program`` with CP-SAT under ``budget_bytes``.

    Args:
        program: the interval program.
        budget_bytes: the budget.
        formulation: ``"linear"`` or ``"cumulative"``.
        seed: CP-SAT's random seed.
        workers: CP-SAT search workers.
        hint_ids: interval ids of a known schedule, given as a hint.
        deadline: the limit of the build and the solve together (CP-SAT's time limit is
            what the build leaves).
        linearization_level: CP-SAT's ``linearization_level`` (None: its default). At 2 its
            LP relaxation proves the small pruned programs of
            :mod:`~chkpt_opt.solvers.keepset.pruned` (measured: a 637-interval program of
            gpt_reference at 0.9 of the peak proven in 0.1 s, 7.4 s at the default).
    """
    stats: dict[str, Any] = {"formulation": formulation, "cost_scale": program.cost_scale}
    budget_units = program.budget_units(budget_bytes)
    if program.fixed_bytes // program.byte_unit > budget_units:
        stats.update(cp_status="INFEASIBLE", infeasible_by="schedule-independent bytes")
        return Outcome(None, False, True, None, stats)
    try:
        m, v = build_in_time(program, budget_units, formulation=formulation, deadline=deadline)
    except DeadlineExceeded as err:
        log.info("cp-sat: %s", err)
        stats.update(cp_status="UNKNOWN", cp_build_timed_out=True)
        return Outcome(None, False, False, None, stats)
    m.minimize(sum(c * x for c, x in zip(program.cost_units, v.x)))
    if hint_ids is not None:
        hint(m, program, v, hint_ids)
    solver = make_solver(
        time_limit_s=deadline.remaining_s(),
        seed=seed,
        workers=workers,
        terms=model_terms(program),
    )
    if linearization_level is not None:
        solver.parameters.linearization_level = linearization_level
    status = run_cp(solver, m, deadline=deadline, what="the CP-SAT solve")
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    stats.update(cp_status=solver.status_name(status), cp_wall_s=solver.wall_time)
    return Outcome(
        chosen=[k for k, x in enumerate(v.x) if solver.boolean_value(x)] if found else None,
        proven_optimal=status == cp_model.OPTIMAL,
        proven_infeasible=status == cp_model.INFEASIBLE,
        bound_units=solver.best_objective_bound if found else None,
        stats=stats,
    )
