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
It takes up to 2.9 s (586 ops, 2 shared cores).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from ortools.linear_solver import pywraplp

from chkpt_opt.graphs.costgraph import (
    CostGraph,
    ordered_nodes,
    owned_storages,
    storage_owners,
    storage_refs,
)
from chkpt_opt.graphs.io import graph_to_dict
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.solvers.bounds.row_check import RowArrays, row_arrays, row_excess
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, DeadlineExceeded

LP_TOLERANCE = 1e-7
"""Relative allowance for GLOP's tolerances when its optimum is reported as a bound."""

BYTE_SCALE = 2.0**20
"""The LP's rows count bytes in MiB, which keeps their coefficients near 1."""


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
    """

    bound_s: float | None
    floor_bytes: int
    proves_infeasible: bool
    steps: int
    complete: bool
    solve_s: float
    recompute_share: Mapping[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        """What the bound found, as solver stats (``stats["recompute_bound"]``)."""
        return {
            "bound_s": self.bound_s,
            "floor_bytes": self.floor_bytes,
            "steps": self.steps,
            "complete": self.complete,
            "solve_s": self.solve_s,
        }


@dataclass(frozen=True)
class _Row:
    """One step of the keep-all sequence: its bytes, as the relaxation sees them.

    Attributes:
        position: the step's position in the keep-all sequence.
        during_bytes: bytes alive while the step runs under keep-all, those kept for free
            left out.
        fixed_bytes: of these, the bytes alive at this step under every schedule.
        kept: storage -> bytes of the storages kept for a later backward.
        alive: every forward storage alive at the step under keep-all.
        droppable: those of ``alive`` that some schedule may not have there (``kept``, and
            those kept for no later backward).
    """

    position: int
    during_bytes: int
    fixed_bytes: int
    kept: dict[str, int]
    alive: frozenset[str]
    droppable: frozenset[str]


@dataclass(frozen=True)
class _Closure:
    """What recomputing after a step may involve.

    Attributes:
        ops: the owners of the step's kept storages, and the owners of every storage such
            an op reads that is not alive at the step under every schedule, transitively.
        reads: ``(op, storage)`` for each such read.
        extra: storage -> bytes of the storages read that are not among ``kept``.
    """

    ops: tuple[str, ...]
    reads: tuple[tuple[str, str], ...]
    extra: dict[str, int]


class _Rows:
    """The rows of every step of the keep-all op sequence of a graph."""

    def __init__(self, graph: CostGraph, deadline: Deadline = NO_DEADLINE) -> None:
        nodes = graph.nodes
        order = ordered_nodes(graph)
        self.owner = storage_owners(graph)
        self.fwd_time = {n: nodes[n]["fwd_time_s"] for n in order}
        self.total_fwd_s = sum(self.fwd_time.values())
        refs = {n: storage_refs(graph, n) for n in order}
        steps = lower(graph, Schedule())
        fwd_pos = {s.node: p for p, s in enumerate(steps) if s.kind == "fwd"}
        bwd_pos = {s.node: p for p, s in enumerate(steps) if s.kind == "bwd"}
        # Storages each op reads, and the last forward step that reads each storage.
        self.reads = {
            n: sorted({sid for u in graph.predecessors(n) for sid in refs[u]}) for n in order
        }
        forward_end: dict[str, int] = {}
        for n in order:
            for sid in self.reads[n]:
                forward_end[sid] = max(forward_end.get(sid, -1), fwd_pos[n])
        for out in graph.graph["outputs"]:
            for sid in refs[out]:
                forward_end[sid] = len(steps)
        # The last backward step that unpacks each storage.
        last_unpack: dict[str, int] = {}
        for n in order:
            if nodes[n]["has_backward"]:
                for sid in nodes[n]["saved"]:
                    last_unpack[sid] = max(last_unpack.get(sid, -1), bwd_pos[n])
        sizes: dict[str, int] = {}
        live_bytes = 0
        alive: set[str] = set()  # forward storages alive (instances "f:<storage>")
        rows: list[_Row] = []
        for p, step in enumerate(steps):
            if p % 64 == 0:
                deadline.check("walking the keep-all op sequence for the recompute bound")
            made = set()
            for inst, nbytes in step.alloc:
                sizes[inst] = nbytes
                live_bytes += nbytes
                if inst.startswith("f:"):
                    made.add(inst[2:])
                    alive.add(inst[2:])
            during = live_bytes + step.transient_bytes
            read_now = set(nodes[step.node]["saved"]) if step.kind == "bwd" else set()
            kept: dict[str, int] = {}
            free = 0
            for sid in sorted(alive - made - read_now):
                if forward_end.get(sid, -1) >= p:
                    continue
                if last_unpack.get(sid, -1) > p:
                    kept[sid] = sizes[f"f:{sid}"]
                else:
                    free += sizes[f"f:{sid}"]
            fixed = during - free - sum(kept.values())
            droppable = frozenset(
                sid for sid in alive - made - read_now if forward_end.get(sid, -1) < p
            )
            rows.append(_Row(p, during - free, fixed, kept, frozenset(alive), droppable))
            for inst in step.free:
                live_bytes -= sizes.pop(inst)
                if inst.startswith("f:"):
                    alive.discard(inst[2:])
        self.rows = rows
        self.floor_bytes = max((r.fixed_bytes for r in rows), default=0)
        self.graph = graph
        self._closures: dict[int, _Closure] = {}

    def closure(self, row: _Row) -> _Closure:
        """The ops and reads a recomputation after ``row``'s step may involve."""
        if row.position in self._closures:
            return self._closures[row.position]
        owner = self.owner
        seen: set[str] = set()
        reads: list[tuple[str, str]] = []
        extra: dict[str, int] = {}
        stack = sorted({owner[sid] for sid in row.kept}, reverse=True)
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for t in self.reads[op]:
                if t not in owner or (t in row.alive and t not in row.droppable):
                    continue  # resident, or alive at the step under every schedule
                reads.append((op, t))
                if t not in row.kept:
                    extra[t] = owned_storages(self.graph, owner[t], owner)[t]
                stack.append(owner[t])
        found = _Closure(tuple(sorted(seen)), tuple(reads), extra)
        self._closures[row.position] = found
        return found


MEMO_SIZE = 32
"""Complete bounds remembered (by graph content and budget), so that the solvers that
read the same bound in one ``auto`` call (the bound itself, the rounded warm starts of the
pruned search and of the search beyond keep-set) solve its LP once."""

_memo: OrderedDict[tuple[str, int, int], RecomputeBound] = OrderedDict()


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
    key = (_content_key(graph), int(budget_bytes), steps_per_round)
    if key in _memo:
        _memo.move_to_end(key)
        return _memo[key]
    found = _solve_bound(graph, budget_bytes, deadline, steps_per_round)
    if found.complete:
        _memo[key] = found
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    return found


def _solve_bound(
    graph: CostGraph, budget_bytes: int, deadline: Deadline, steps_per_round: int
) -> RecomputeBound:
    """:func:`recompute_bound` without the memo."""
    clock = Deadline.after(None)
    try:
        rows = _Rows(graph, deadline)
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
    pending = sorted(over, key=lambda r: (r.fixed_bytes - r.during_bytes, r.position))
    bound: float | None = None
    while pending and not deadline.expired():
        for row in pending[:steps_per_round]:
            lp.add(row)
        value = lp.solve(deadline)
        if value is None:
            break
        # The optimum over the rows added so far: the relaxation with fewer rows has a
        # lower optimum, so it bounds every schedule whether or not more rows follow.
        bound = max(0.0, value * (1 - LP_TOLERANCE) - LP_TOLERANCE * rows.total_fwd_s)
        checked = lp.violated(over, deadline)
        if checked is None:  # the deadline passed while checking: rows may still be violated
            break
        pending = checked
    return done(bound, lp.n_rows, not pending, lp.values if bound is not None else {})


class _CoverLp:
    """The relaxation of the module docstring over the rows added so far, in GLOP."""

    def __init__(self, rows: _Rows, budget_bytes: int) -> None:
        self.rows = rows
        self.budget_bytes = budget_bytes
        self.solver = pywraplp.Solver.CreateSolver("GLOP")
        # r[o]: op o is recomputed at least once (cost: its forward time).
        self.r: dict[str, pywraplp.Variable] = {}
        self.added: set[int] = set()
        self.n_rows = 0
        self.values: dict[str, float] = {}
        self.ops = {op: k for k, op in enumerate(rows.fwd_time)}
        self._arrays: dict[int, RowArrays] = {}

    def _recomputed(self, op: str) -> pywraplp.Variable:
        if op not in self.r:
            self.r[op] = self.solver.NumVar(0.0, 1.0, "")
            self.solver.Objective().SetCoefficient(self.r[op], self.rows.fwd_time[op])
        return self.r[op]

    def add(self, row: _Row) -> None:
        """Adds the rows of one step."""
        if row.position in self.added:
            return
        self.added.add(row.position)
        self.n_rows += 1
        owner, s, inf = self.rows.owner, self.solver, self.solver.infinity()
        closure = self.rows.closure(row)
        sizes = {**row.kept, **closure.extra}
        # a[x]: storage x is alive at this step.
        a = {x: s.NumVar(0.0, 1.0, "") for x in sizes}
        # d[o]: op o is recomputed after this step.
        d = {o: s.NumVar(0.0, 1.0, "") for o in closure.ops}

        def at_least(value: float, *terms: tuple[pywraplp.Variable, float]) -> None:
            c = s.Constraint(value, inf)
            for var, coefficient in terms:
                c.SetCoefficient(var, coefficient)

        for o, var in d.items():  # r[o] >= d[o]
            at_least(0.0, (self._recomputed(o), 1.0), (var, -1.0))
        for sid in row.kept:  # kept for later: alive now, or recomputed later
            at_least(1.0, (a[sid], 1.0), (d[owner[sid]], 1.0))
        for o, t in closure.reads:  # a recomputation reads t: alive now, or recomputed too
            at_least(0.0, (a[t], 1.0), (d[owner[t]], 1.0), (d[o], -1.0))
        # The step's memory: the bytes of what is alive within what the budget leaves.
        room_bytes = self.budget_bytes - row.fixed_bytes
        memory = s.Constraint(-inf, room_bytes / BYTE_SCALE)
        for x, nbytes in sizes.items():
            memory.SetCoefficient(a[x], nbytes / BYTE_SCALE)
            if nbytes > room_bytes:  # alive or not: a storage larger than the room is not
                a[x].SetUb(0.0)

    def solve(self, deadline: Deadline) -> float | None:
        """The LP optimum in seconds, or None when it did not solve to optimality."""
        remaining = deadline.remaining_s()
        if remaining is not None:
            self.solver.SetTimeLimit(max(1, int(remaining * 1000)))
        self.solver.Objective().SetMinimization()
        if self.solver.Solve() != pywraplp.Solver.OPTIMAL:
            return None
        self.values = {op: v.solution_value() for op, v in self.r.items()}
        return self.solver.Objective().Value()

    def violated(self, rows: list[_Row], deadline: Deadline = NO_DEADLINE) -> list[_Row] | None:
        """Rows not yet added whose memory the LP's solution does not keep under the
        budget, most violated first; None where ``deadline`` passed before every row was
        checked. The memory of a row is taken at a feasible point of its constraints
        (every ``d`` at its ``r``, every ``a`` as low as that allows), so a row found to
        hold does hold."""
        r = np.zeros(len(self.ops))
        for op, value in self.values.items():
            r[self.ops[op]] = value
        found: list[tuple[float, int, _Row]] = []
        for k, row in enumerate(rows):
            if row.position in self.added:
                continue
            if k % 16 == 0 and deadline.expired():
                return None
            if row.position not in self._arrays:
                closure = self.rows.closure(row)
                self._arrays[row.position] = row_arrays(
                    row.kept, closure.extra, closure.reads, self.rows.owner, self.ops
                )
            excess = row_excess(self._arrays[row.position], r, self.budget_bytes - row.fixed_bytes)
            if excess > 1e-6 * self.budget_bytes:
                found.append((-excess, row.position, row))
        found.sort(key=lambda item: item[:2])
        return [row for _, _, row in found]
