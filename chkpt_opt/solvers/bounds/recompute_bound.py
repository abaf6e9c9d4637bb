"""A lower bound on the extra compute of every schedule, keep-set or beyond, from storages.

The integer programs prove bounds over their own models, which are quadratic in the number
of cut positions and too large to build or relax within seconds on graphs of 400 ops and
more. This bound needs only the keep-all op sequence of
:func:`chkpt_opt.memory_model.op_sequence.lower`, and it holds for *every* schedule the lowering can
express: keep-set regions, nested regions and cached ops alike.

The argument, at one step ``p`` of the keep-all sequence (the same moment exists in every
schedule: forward steps, the start of the backward pass, every backward and accumulate
step). Some bytes alive there are the same under every schedule: gradients, transients,
storages created by the step, storages a later forward op still reads, the step's outputs,
and the saved tensors the step itself reads. Every other forward storage alive at ``p`` is
kept for a backward op that runs later; under another schedule it is either alive at ``p``
too, or its owner is recomputed after ``p`` (forward values come back only that way), which
costs at least the owner's forward time. Recomputing an op after ``p`` needs its inputs
then: each input storage is alive at ``p`` as well, or its own owner is recomputed. So, with
``r[o]`` (op ``o`` is recomputed at least once) and ``a[s]`` (storage ``s`` is alive at
``p``) in ``[0, 1]``::

    minimize  sum_o fwd_time_s[o] * r[o]
    subject to, at each chosen step p:
        a[s] >= 1 - r[owner(s)]                    for each storage s kept for later
        a[t] >= 1 - a[s] - r[owner(t)]             for each input t of owner(s)
        fixed[p] + sum_s bytes[s] * a[s] + sum_t bytes[t] * a[t] <= budget

is a relaxation of every schedule that fits (``a`` of an input ``t`` that keep-all frees
before ``p`` adds bytes that keep-all does not have there). Alive or not is a yes or no in
every schedule, so a storage larger than what the budget leaves at ``p`` beside
``fixed[p]`` is dead there (``a[s] = 0``): its owner is recomputed after ``p``, wholly, where
the plain relaxation would recompute the fraction that makes room. Its LP optimum, with the LP
solver's tolerance taken off, is a proven lower bound on the extra compute. Storages that
keep-all holds but no later backward reads (savers without a backward) may be dropped for
free and are left out.

Steps are added by cutting planes: first those that exceed the budget most under keep-all,
then those the LP's solution violates, until none is violated or the deadline passes (the
bound of the steps added so far still holds). With every ``r`` at 1, ``fixed[p]`` alone
remains: ``floor_bytes``, its largest value, is a proven lower bound on the peak of every
schedule; a budget below it proves that nothing fits.

Measured (``python benchmarks/recompute_bound.py --hf``) against 55 proven optima of the
corpus and Hugging Face graphs (13-586 ops): 0.002 to 0.999 of the optimum, median 0.835;
within 1-4% at 90% of the keep-all peak on transformers, 0.58-0.86 at 50-30%, and
uninformative where in-place ops decide what can be dropped (MobileNet at 90%: 0.002).

The rows and their closures (:mod:`~chkpt_opt.solvers.bounds.bound_rows`) do not depend on
the budget and are remembered per graph; the LP is solved by GLOP, or by HiGHS on graphs of
more than :data:`GLOP_MAX_OPS` ops. Measured (``benchmarks/results/bound_at_depth/``, one
core, 2 shared): the 32-layer Hugging Face Llama (1,866 ops) at its layers' peak in 1.4 s
(was 10.0 s: a Python walk per step for the closures, GLOP), the 586-op GPT in 0.23-0.35 s
(was 0.32-0.60 s); the same bounds to 5e-15 on 87 corpus cases and the 4-, 8- and 32-layer
Llama.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from ortools.linear_solver import pywraplp

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import graph_to_dict
from chkpt_opt.solvers.bounds.bound_rows import KeepAllRows, StepRow
from chkpt_opt.solvers.bounds.row_check import row_excess
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, DeadlineExceeded

LP_TOLERANCE = 1e-7
"""Relative allowance for GLOP's tolerances when its optimum is reported as a bound."""

BYTE_SCALE = 2.0**20
"""The LP's rows count bytes in MiB, which keeps their coefficients near 1."""

GLOP_MAX_OPS = 700
"""Graphs of at most this many ops have their LP solved by GLOP, larger ones by HiGHS. Both
find the same optimum (the bound; equal to 1e-12 on the corpus and the 4-, 8- and 32-layer
Llama), but not the same optimal vertex where the optimum is degenerate, and the roundings
of the LP's solution into schedules (:mod:`~chkpt_opt.solvers.staged.rounding` and the
others reading ``recompute_share``) were measured on GLOP's: on the 6-layer Llama at its
layers' peak HiGHS's rounds to 180.8 ms of recompute, GLOP's to 146.3 ms (bound 142.8).
HiGHS re-solves the LPs of the 32-layer Llama (1,866 ops) 7-12 times faster (0.7 s against
5.4 s for its two rounds), where GLOP would take most of ``auto``'s share for the bound."""


@dataclass(frozen=True)
class RecomputeBound:
    """A proven lower bound on the extra compute of every schedule under one budget.

    Attributes:
        bound_s: seconds of recomputation every schedule that fits needs; 0.0 where
            nothing needs recomputing, None when the deadline passed before a first LP.
        floor_bytes: a proven lower bound on the peak of every schedule.
        proves_infeasible: the budget is below ``floor_bytes``: no schedule fits.
        steps: steps of the keep-all sequence whose rows the LP holds.
        complete: every step's row holds under the LP's solution (the bound is that of
            the whole relaxation); False when the deadline cut the cutting planes short.
        solve_s: wall-clock seconds spent.
        recompute_share: op -> its ``r`` in the LP's solution (how much of it the
            relaxation recomputes), for the ops the LP holds; what
            :mod:`~chkpt_opt.solvers.keepset.bound_rounding` rounds into a schedule.
        timed_bound_s: the time-indexed bound, where one was solved
            (:func:`~chkpt_opt.solvers.bounds.timed_bound.with_timed_bound`: ``bound_s`` is
            then the larger of the two).
        integer_bound_s: the program's bound in integers, where one was solved
            (:func:`~chkpt_opt.solvers.bounds.integer_cover.with_integer_bound`: likewise).
    """

    bound_s: float | None
    floor_bytes: int
    proves_infeasible: bool
    steps: int
    complete: bool
    solve_s: float
    recompute_share: Mapping[str, float] = field(default_factory=dict)
    timed_bound_s: float | None = None
    integer_bound_s: float | None = None

    def summary(self) -> dict[str, object]:
        """What the bound found, as solver stats (``stats["recompute_bound"]``)."""
        others = {"timed_bound_s": self.timed_bound_s, "integer_bound_s": self.integer_bound_s}
        solved = {name: value for name, value in others.items() if value is not None}
        return {
            "bound_s": self.bound_s,
            "floor_bytes": self.floor_bytes,
            "steps": self.steps,
            "complete": self.complete,
            "solve_s": self.solve_s,
            **solved,
        }


MEMO_SIZE = 32
"""Complete bounds remembered (by graph content and budget), so that the solvers that
read the same bound in one ``auto`` call (the bound itself, the rounded warm starts of the
pruned search and of the search beyond keep-set) solve its LP once."""

_memo: OrderedDict[tuple[str, int, int], RecomputeBound] = OrderedDict()

ROWS_MEMO_SIZE = 2
"""Graphs whose rows and closures are remembered (by content): they do not depend on the
budget, and the staged rounding solves the LP again at lowered budgets."""

_rows_memo: OrderedDict[str, KeepAllRows] = OrderedDict()


def _content_key(graph: CostGraph) -> str:
    """A digest of everything the bound reads: every node's and the graph's attributes and
    the edges (a graph changed in place gets another key)."""
    text = json.dumps(graph_to_dict(graph), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def recompute_bound(
    graph: CostGraph,
    budget_bytes: int,
    *,
    deadline: Deadline = NO_DEADLINE,
    steps_per_round: int = 4,
) -> RecomputeBound:
    """A lower bound on the extra compute of every schedule of ``graph`` that peaks at most
    ``budget_bytes`` (activation bytes, as :func:`chkpt_opt.memory_model.simulate.simulate` counts
    them); see the module docstring. A complete bound is remembered for its graph's
    content and budget (see :data:`MEMO_SIZE`); a later call returns it at once, with the
    ``solve_s`` of the call that solved it.

    Args:
        graph: the cost graph.
        budget_bytes: the activation budget.
        deadline: the LP rounds stop once it has passed; the bound of the rows added so far
            is returned (None if the first LP did not finish; with no floor either, 0, if
            the walk of the op sequence did not).
        steps_per_round: steps added to the LP per cutting-plane round.
    """
    content = _content_key(graph)
    key = (content, int(budget_bytes), steps_per_round)
    if key in _memo:
        _memo.move_to_end(key)
        return _memo[key]
    found = _solve_bound(graph, content, budget_bytes, deadline, steps_per_round)
    if found.complete:
        _memo[key] = found
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    return found


def keep_all_rows(graph: CostGraph, deadline: Deadline = NO_DEADLINE) -> KeepAllRows:
    """The rows of ``graph``'s keep-all sequence, remembered as the bound's are."""
    return _keep_all_rows(graph, _content_key(graph), deadline)


def _keep_all_rows(graph: CostGraph, content: str, deadline: Deadline) -> KeepAllRows:
    """The rows of ``graph`` (content digest ``content``), remembered (see
    :data:`ROWS_MEMO_SIZE`); raises :class:`DeadlineExceeded` where the walk was cut short."""
    if content in _rows_memo:
        _rows_memo.move_to_end(content)
        return _rows_memo[content]
    rows = KeepAllRows(graph, deadline)
    _rows_memo[content] = rows
    while len(_rows_memo) > ROWS_MEMO_SIZE:
        _rows_memo.popitem(last=False)
    return rows


def _solve_bound(
    graph: CostGraph, content: str, budget_bytes: int, deadline: Deadline, steps_per_round: int
) -> RecomputeBound:
    """:func:`recompute_bound` without the memo of bounds."""
    clock = Deadline.after(None)
    try:
        rows = _keep_all_rows(graph, content, deadline)
    except DeadlineExceeded:
        return RecomputeBound(None, 0, False, 0, False, clock.elapsed_s())
    over = [r for r in rows.rows if r.during_bytes > budget_bytes]

    def done(
        bound_s: float | None, steps: int, complete: bool, share: Mapping[str, float] | None = None
    ) -> RecomputeBound:
        return RecomputeBound(
            bound_s=bound_s,
            floor_bytes=rows.floor_bytes,
            proves_infeasible=budget_bytes < rows.floor_bytes,
            steps=steps,
            complete=complete,
            solve_s=clock.elapsed_s(),
            recompute_share=dict(share or {}),
        )

    if not over:
        return done(0.0, 0, True)
    if budget_bytes < rows.floor_bytes:
        return done(None, 0, True)
    lp = _CoverLp(rows, budget_bytes)
    bound, complete = cutting_planes(lp, over, deadline, steps_per_round)
    return done(bound, lp.n_rows, complete, lp.values if bound is not None else {})


def cutting_planes(
    program: _CoverLp, over: list[StepRow], deadline: Deadline, steps_per_round: int
) -> tuple[float | None, bool]:
    """``(bound, complete)``: ``program`` solved with the rows of ``over`` (the steps over
    the budget under keep-all) added by cutting planes, most over first, then those its
    solution violates, ``steps_per_round`` at a time, until none is or ``deadline`` passes;
    the proven bound (tolerances taken off; None before a first solve) and whether every
    row holds. The optimum over the rows added so far bounds every schedule whether or not
    more rows follow (fewer rows, a lower optimum); an integer solve cut short gives the
    bound its solver proved."""
    total_fwd_s = program.rows.total_fwd_s

    def proven(value: float) -> float:
        return max(0.0, value * (1 - LP_TOLERANCE) - LP_TOLERANCE * total_fwd_s)

    pending = sorted(over, key=lambda r: (r.fixed_bytes - r.during_bytes, r.position))
    bound: float | None = None
    while pending and not deadline.expired():
        for row in pending[:steps_per_round]:
            program.add(row)
        value = program.solve(deadline)
        if value is None:
            best = program.best_bound_s
            if best is not None and math.isfinite(best):
                bound = max(bound or 0.0, proven(best))
            break
        bound = proven(value)
        checked = program.violated(over, deadline)
        if checked is None:  # the deadline passed while checking: rows may still be violated
            break
        pending = checked
    return bound, not pending


class _CoverLp:
    """The relaxation of the module docstring over the rows added so far: in GLOP on graphs
    of at most :data:`GLOP_MAX_OPS` ops, in HiGHS on larger ones (see there); with
    ``integer``, the same program with every variable 0 or 1, in SCIP
    (:mod:`~chkpt_opt.solvers.bounds.integer_cover`)."""

    def __init__(self, rows: KeepAllRows, budget_bytes: int, *, integer: bool = False) -> None:
        self.rows = rows
        self.budget_bytes = budget_bytes
        self.integer = integer
        if integer:
            self.solver = pywraplp.Solver.CreateSolver("SCIP")
        elif len(rows.ops) <= GLOP_MAX_OPS:
            self.solver = pywraplp.Solver.CreateSolver("GLOP")
        else:
            self.solver = pywraplp.Solver.CreateSolver("HIGHS")
            # HiGHS's banner and log go to stdout unless told (the call reports False even so).
            self.solver.SetSolverSpecificParametersAsString("output_flag false")
            self.solver.SetNumThreads(1)
        # r[o]: op o is recomputed at least once (cost: its forward time).
        self.r: dict[int, pywraplp.Variable] = {}
        self.added: set[int] = set()
        self.n_rows = 0
        self.values: dict[str, float] = {}
        self._r_values = np.zeros(len(rows.ops))
        # the integer program's proven bound where the last solve was cut short
        self.best_bound_s: float | None = None

    def _unit_var(self) -> pywraplp.Variable:
        """A variable in [0, 1]; 0 or 1 in the integer program."""
        if self.integer:
            return self.solver.IntVar(0.0, 1.0, "")
        return self.solver.NumVar(0.0, 1.0, "")

    def _recomputed(self, op: int) -> pywraplp.Variable:
        if op not in self.r:
            self.r[op] = self._unit_var()
            self.solver.Objective().SetCoefficient(self.r[op], float(self.rows.fwd_time_s[op]))
        return self.r[op]

    def add(self, row: StepRow) -> None:
        """Adds the rows of one step."""
        if row.position in self.added:
            return
        self.added.add(row.position)
        self.n_rows += 1
        s, inf = self.solver, self.solver.infinity()
        arrays = self.rows.walk_ordered(row)
        # a[x]: storage x (by its index in the row's sizes) is alive at this step.
        a = [self._unit_var() for _ in range(len(arrays.sizes))]
        # d[o]: op o is recomputed after this step.
        d = {o: self._unit_var() for o in arrays.ops.tolist()}

        def at_least(value: float, *terms: tuple[pywraplp.Variable, float]) -> None:
            c = s.Constraint(value, inf)
            for var, coefficient in terms:
                c.SetCoefficient(var, coefficient)

        for o, var in d.items():  # r[o] >= d[o]
            at_least(0.0, (self._recomputed(o), 1.0), (var, -1.0))
        for x, o in enumerate(arrays.kept_owner.tolist()):  # kept: alive now, or recomputed
            at_least(1.0, (a[x], 1.0), (d[o], 1.0))
        # A recomputation reads t: alive now, or recomputed too.
        for t, o, t_owner in zip(
            arrays.read_storage.tolist(), arrays.read_op.tolist(), arrays.read_owner.tolist()
        ):
            at_least(0.0, (a[t], 1.0), (d[t_owner], 1.0), (d[o], -1.0))
        # The step's memory: the bytes of what is alive within what the budget leaves.
        room_bytes = self.budget_bytes - row.fixed_bytes
        memory = s.Constraint(-inf, room_bytes / BYTE_SCALE)
        for x, nbytes in enumerate(arrays.sizes.tolist()):
            memory.SetCoefficient(a[x], nbytes / BYTE_SCALE)
            if nbytes > room_bytes:  # alive or not: a storage larger than the room is not
                a[x].SetUb(0.0)

    def solve(self, deadline: Deadline) -> float | None:
        """The LP optimum in seconds, or None when it did not solve to optimality (the
        integer program's proven bound so far is then :attr:`best_bound_s`)."""
        remaining = deadline.remaining_s()
        if remaining is not None:
            self.solver.SetTimeLimit(max(1, int(remaining * 1000)))
        self.solver.Objective().SetMinimization()
        status = self.solver.Solve()
        self.best_bound_s = None
        if self.integer and status == pywraplp.Solver.FEASIBLE:  # cut short by the limit
            self.best_bound_s = self.solver.Objective().BestBound()
        if status != pywraplp.Solver.OPTIMAL:
            return None
        ops = self.rows.ops
        self.values = {ops[o]: v.solution_value() for o, v in self.r.items()}
        self._r_values = np.zeros(len(ops))
        for o, v in self.r.items():
            self._r_values[o] = v.solution_value()
        return self.solver.Objective().Value()

    def violated(
        self, rows: list[StepRow], deadline: Deadline = NO_DEADLINE
    ) -> list[StepRow] | None:
        """Rows not yet added whose memory the LP's solution does not keep under the
        budget, most violated first; None where ``deadline`` passed before every row was
        checked. The memory of a row is taken at a feasible point of its constraints
        (every ``d`` at its ``r``, every ``a`` as low as that allows), so a row found to
        hold does hold."""
        if not self.rows.prepare([r for r in rows if r.position not in self.added], deadline):
            return None
        found: list[tuple[float, int, StepRow]] = []
        for k, row in enumerate(rows):
            if row.position in self.added:
                continue
            if k % 64 == 0 and deadline.expired():
                return None
            room_bytes = self.budget_bytes - row.fixed_bytes
            excess = row_excess(self.rows.arrays(row), self._r_values, room_bytes)
            if excess > 1e-6 * self.budget_bytes:
                found.append((-excess, row.position, row))
        found.sort(key=lambda item: item[:2])
        return [row for _, _, row in found]
