"""A time-indexed lower bound on the extra compute of every schedule: the recompute bound
with *when*, not only *whether*, an op is recomputed.

The recompute bound (:mod:`~chkpt_opt.solvers.bounds.recompute_bound`) says, at each step of
the keep-all op sequence, that a storage kept for a later backward op is alive there or its
owner is recomputed after it, and counts each op's recomputation once. One recomputation
"after the step" then serves every later need: on a chain of layers below the layers'
peak, the recomputation of layer j-1 that layer j's replay reads and the one layer j-1's
own backward reads are priced as one, though the first must be held from the one moment to
the other (memory at every step between) or made twice. Every multi-level schedule looks as
cheap as recomputing each op once.

Here the steps of the keep-all sequence cut the step into intervals. For each forward
storage ``s`` and each step ``p`` at which some schedule may have an instance of it or not
(after its owner's forward step and its last forward reader, up to the last step a read of
it may still be needed: its own last backward read, or the last of what a reader of it
makes, which a recomputation of that reader needs; the steps that read ``s``, where it is
alive in every schedule, left out), ``a[s, p]`` says an instance of ``s`` is alive at ``p``;
``rec[o, p]`` says op ``o`` is recomputed between steps ``p - 1`` and ``p``; all in
``[0, 1]``::

    minimize  sum_{o, p} fwd_time_s[o] * rec[o, p]
    subject to
        rec[owner(s), p] >= a[s, p] - a[s, p - 1]      a[s, p] and a[s, p - 1] exist
        rec[owner(s), p] >= 1 - a[s, p - 1]            a[s, p - 1] exists, p reads s
        rec[owner(t), p] >= rec[o, p] - a[t, p - 1]    o reads t, a[t, p - 1] exists
        fixed[p] + sum_s bytes[s] * a[s, p] <= budget  steps p over the budget under keep-all

Every schedule that fits maps to it: ``a`` as its instances' lifetimes at the steps of the
keep-all sequence (which every schedule passes through, in that order), ``rec[o, p]`` 1
where it recomputes ``o`` in that interval. A storage that was not alive at ``p - 1`` and is
alive at ``p`` (or read there) was made in between, by a recomputation of its owner; a
recomputation reads its inputs, alive at ``p - 1`` or made in the interval too; the bytes
alive at a step are at least those the row counts (the transients of recomputations are
not counted, and an input alive at ``p - 1`` may have been freed before the step: both
relax). Each interval's recomputation of ``o`` costs ``fwd_time_s[o]`` at least once, so
the optimum is at most the schedule's recompute time: a lower bound over every schedule
the lowering executes, staged ones (an op recomputed at several stages) included, as the
recompute bound's is. Where ``a[t, p - 1]`` does not exist (``t`` alive there in every
schedule, or past its range), nothing is said of ``t``. A storage larger than what the
budget leaves at a step is dead there, as in the recompute bound.

The program has a variable per storage and step of its range, and per op and interval
where one is needed: it suits graphs of a few hundred ops (:data:`MAX_VARIABLES`). Its
optimum is not always above the recompute bound's (which counts the closure of every
recomputation at once), so :func:`with_timed_bound` keeps both and takes the larger.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.bounds.bound_rows import KeepAllRows
from chkpt_opt.solvers.bounds.recompute_bound import (
    BYTE_SCALE,
    LP_TOLERANCE,
    RecomputeBound,
    keep_all_rows,
)
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, DeadlineExceeded

MAX_VARIABLES = 2_000_000
"""Programs with more alive-or-not variables than this are not built."""

AUTO_MAX_VARIABLES = 20_000
"""``auto`` adds the bound where its program has at most this many alive-or-not variables
(:func:`with_timed_bound`). On the corpus graphs of more than 80 ops and the Hugging Face
families (``benchmarks/results/bound_looseness/timed_share.jsonl``) it beat the recompute
bound once in 20 (``unet_large`` at 0.3 of keep-all: 52.8 against 45.4 ms, 11,352
variables in all, 0.5 s); BERT's program (28,753 alive-or-not) took 7.6 s for 46.8 against
115.7 ms, and at the former limit of 40,000 it took the time in which ``auto`` proves its
keep-set bound (``benchmarks/hf_gaps.py`` at 20 s: BERT at its layers' peak 12.4% -> 21.4%)."""


@dataclass(frozen=True)
class TimedBound:
    """The time-indexed bound at one budget.

    Attributes:
        bound_s: the proven lower bound on the extra compute of every schedule that fits
            (seconds); None where the program was not solved (too large, or the deadline).
        proves_infeasible: the budget is below the bytes alive at some step under every
            schedule.
        variables: the program's variables.
        solve_s: seconds spent, building included.
        note: why there is no bound, where there is none.
    """

    bound_s: float | None
    proves_infeasible: bool
    variables: int
    solve_s: float
    note: str = ""


def timed_bound(
    graph: CostGraph,
    budget_bytes: int,
    *,
    deadline: Deadline = NO_DEADLINE,
    max_variables: int = MAX_VARIABLES,
) -> TimedBound:
    """The bound of the module docstring for ``graph`` at ``budget_bytes`` (activation
    bytes, as :func:`chkpt_opt.memory_model.simulate.simulate` counts them); not built
    where its program would have more than ``max_variables`` alive-or-not variables."""
    clock = Deadline.after(None)
    try:
        rows = keep_all_rows(graph, deadline)
    except DeadlineExceeded:
        return TimedBound(None, False, 0, clock.elapsed_s(), "the deadline passed")
    if budget_bytes < rows.floor_bytes:
        return TimedBound(None, True, 0, clock.elapsed_s())
    over = [r for r in rows.rows if r.during_bytes > budget_bytes]
    if not over:
        return TimedBound(0.0, False, 0, clock.elapsed_s())
    reads_at = _reads_at(rows)
    ranges = _alive_ranges(rows, reads_at)
    pairs = sum(len(steps) for steps in ranges.values())
    if pairs > max_variables:
        return TimedBound(None, False, 0, clock.elapsed_s(), f"{pairs} variables: not built")
    program = _Program(rows, budget_bytes, ranges, reads_at)
    for row in over:
        program.memory(row.position, row.fixed_bytes)
    value = program.solve(deadline)
    if value is None:
        return TimedBound(None, False, program.n_variables, clock.elapsed_s(), "not solved")
    bound = max(0.0, value * (1 - LP_TOLERANCE) - LP_TOLERANCE * rows.total_fwd_s)
    return TimedBound(bound, False, program.n_variables, clock.elapsed_s())


def with_timed_bound(
    graph: CostGraph, budget_bytes: int, cover: RecomputeBound, deadline: Deadline
) -> RecomputeBound:
    """``cover`` (the recompute bound at ``budget_bytes``) with the time-indexed bound
    beside it and its ``bound_s`` raised to it where higher, on graphs whose program has at
    most :data:`AUTO_MAX_VARIABLES` variables; ``cover`` itself elsewhere."""
    if cover.bound_s is None or cover.proves_infeasible or cover.bound_s == 0.0:
        return cover
    timed = timed_bound(graph, budget_bytes, deadline=deadline, max_variables=AUTO_MAX_VARIABLES)
    if timed.bound_s is None:
        return cover
    return dataclasses.replace(
        cover, bound_s=max(cover.bound_s, timed.bound_s), timed_bound_s=timed.bound_s
    )


def _alive_ranges(rows: KeepAllRows, reads_at: dict[int, set[int]]) -> dict[int, list[int]]:
    """Storage -> the steps of its ``a`` variables (see the module docstring);
    ``reads_at``: :func:`_reads_at`."""
    owner = rows.storage_owner
    n_steps = len(rows.rows)
    needed = np.full(len(owner), -1, dtype=np.int64)  # the step of its last backward read
    for row in rows.rows:
        needed[row.kept] = row.position + 1
    made_needed = np.full(len(rows.ops), -1, dtype=np.int64)  # op -> what it makes, needed
    owned = owner >= 0
    np.maximum.at(made_needed, owner[owned], needed[owned])
    horizon = needed.copy()
    np.maximum.at(horizon, rows.read_storage, made_needed[rows.read_op])
    ranges: dict[int, list[int]] = {}
    for s in np.flatnonzero(owned & (horizon >= 0)).tolist():
        first = int(max(rows.made_at[s], rows.forward_end[s])) + 1
        steps = [
            p
            for p in range(first, min(int(horizon[s]), n_steps - 1) + 1)
            if s not in reads_at.get(p, ())
        ]
        if steps:
            ranges[s] = steps
    return ranges


def _reads_at(rows: KeepAllRows) -> dict[int, set[int]]:
    """Step -> the storages its backward op reads."""
    return {p: set(r.tolist()) for p, r in rows.read_now.items()}


class _Program:
    """The LP of the module docstring (HiGHS through OR-Tools)."""

    def __init__(
        self,
        rows: KeepAllRows,
        budget_bytes: int,
        ranges: dict[int, list[int]],
        reads_at: dict[int, set[int]],
    ) -> None:
        # data
        self.rows, self.budget_bytes = rows, budget_bytes
        owner = rows.storage_owner
        self.inputs: dict[int, list[int]] = {}  # op -> the owned storages it reads
        for op, storage in zip(rows.read_op.tolist(), rows.read_storage.tolist()):
            self.inputs.setdefault(op, []).append(storage)
        self.bytes = {int(t): int(b) for t, b in enumerate(rows.owned_bytes.tolist())}
        for row in rows.rows:
            self.bytes.update(zip(row.kept.tolist(), row.kept_bytes.tolist()))
        self.solver = pywraplp.Solver.CreateSolver("HIGHS")
        self.solver.SetSolverSpecificParametersAsString("output_flag false")
        self.solver.SetNumThreads(1)
        self.inf = self.solver.infinity()
        # variables
        # a[s, p]: an instance of storage s is alive at step p (over its range)
        self.a: dict[tuple[int, int], pywraplp.Variable] = {}
        self.open: dict[int, list[int]] = {}  # step -> the storages with a variable there
        for s, steps in ranges.items():
            for p in steps:
                self.a[s, p] = self.solver.NumVar(0.0, 1.0, "")
                self.open.setdefault(p, []).append(s)
        # rec[o, p]: op o is recomputed between steps p - 1 and p (made where needed)
        self.rec: dict[tuple[int, int], pywraplp.Variable] = {}
        # constraints: an instance alive at p (or read there) and not at p - 1 was made
        for (s, p), var in self.a.items():
            before = self.a.get((s, p - 1))
            if before is not None:
                self._at_least(0.0, (self._rec(int(owner[s]), p), 1.0), (var, -1.0), (before, 1.0))
        for p, read in reads_at.items():
            for s in read:
                before = self.a.get((s, p - 1))
                if before is not None:
                    self._at_least(1.0, (self._rec(int(owner[s]), p), 1.0), (before, 1.0))
        # a recomputation's inputs: alive before its interval, or recomputed in it
        made_rec = list(self.rec)
        done: set[tuple[int, int]] = set()
        while made_rec:
            o, p = made_rec.pop()
            if (o, p) in done:
                continue
            done.add((o, p))
            for t in self.inputs.get(o, ()):
                before = self.a.get((t, p - 1))
                if before is None:  # alive at p - 1 in every schedule, or past its range
                    continue
                t_owner = int(owner[t])
                fresh = (t_owner, p) not in self.rec
                self._at_least(
                    0.0, (self._rec(t_owner, p), 1.0), (self.rec[o, p], -1.0), (before, 1.0)
                )
                if fresh:
                    made_rec.append((t_owner, p))
        # objective: each recomputation's forward time (set as each ``rec`` is made)
        self.solver.Objective().SetMinimization()

    @property
    def n_variables(self) -> int:
        return len(self.a) + len(self.rec)

    def _rec(self, op: int, p: int) -> pywraplp.Variable:
        if (op, p) not in self.rec:
            var = self.solver.NumVar(0.0, 1.0, "")
            self.solver.Objective().SetCoefficient(var, float(self.rows.fwd_time_s[op]))
            self.rec[op, p] = var
        return self.rec[op, p]

    def _at_least(self, value: float, *terms: tuple[pywraplp.Variable, float]) -> None:
        row = self.solver.Constraint(value, self.inf)
        for var, coefficient in terms:
            row.SetCoefficient(var, coefficient)

    def memory(self, p: int, fixed_bytes: int) -> None:
        """Step ``p``'s memory: what is alive within what the budget leaves."""
        room_bytes = self.budget_bytes - fixed_bytes
        row = self.solver.Constraint(-self.inf, room_bytes / BYTE_SCALE)
        for s in self.open.get(p, ()):
            var, nbytes = self.a[s, p], self.bytes[s]
            row.SetCoefficient(var, nbytes / BYTE_SCALE)
            if nbytes > room_bytes:
                var.SetUb(0.0)

    def solve(self, deadline: Deadline) -> float | None:
        """The LP optimum in seconds, or None where it was not solved to optimality."""
        remaining = deadline.remaining_s()
        if remaining is not None:
            self.solver.SetTimeLimit(max(1, int(remaining * 1000)))
        if self.solver.Solve() != pywraplp.Solver.OPTIMAL:
            return None
        return float(self.solver.Objective().Value())
