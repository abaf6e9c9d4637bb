"""Checkmate's MILP over per-op recompute decisions: a lower bound over every schedule.

The program of Jain et al. 2020 (Checkmate), written over a CostGraph: the step is cut
into *stages*, one per forward op (its forward) and one per backward step (a ``bwd`` op of
the keep-all op sequence of :func:`chkpt_opt.memory_model.op_sequence.lower`, with its gradient
sum). In stage ``t`` any forward op may be computed (``R``), and any storage may be alive at the
stage's start (``S``). It chooses, per stage, which values are recomputed and which are
kept, with no notion of regions: this is general rematerialization, a space that holds
every schedule PyTorch executes here (keep-set regions, nested non-reentrant regions,
cached ops) and more.

Checkmate's memory rows (``U``, ``FREE``) replay each stage's computations in the ops'
order and free each value after its last use in the stage. Our op sequence replays regions
in another order (outer regions first, then inner ones, which may run an op twice in one
stage), so those rows could count a value that our sequence has already freed. The rows
here count only what is alive in every execution of the same decisions, at three kinds of
moments:

* the **frontier** of a stage (the forward op, or the ``bwd`` op and its gradient sum):
  the bytes that are the same under every schedule there (gradients, parameter gradients,
  the step's transient; read off the keep-all sequence), the storages the step reads or
  creates, and every storage alive once the stage ends (alive after the step, so during it);
* each **recomputation** of op ``k`` in stage ``t``: the fixed bytes between backward steps,
  ``k``'s inputs, outputs and workspace, and each storage alive through the whole stage
  (``A``: alive at its start and at its end and not recomputed in it, so the same instance
  throughout).

Mapping any executed schedule to the program (``R[t, i]``: op ``i`` runs in stage ``t``,
``S[t, s]``: an instance of ``s`` is alive at the stage's start) satisfies every row, and its
objective (each recomputed op counted once per stage) is at most the schedule's recompute
time: the program's optimum is a lower bound on the extra compute of every schedule that
fits, ours included (a relaxation also in that it lets the forward pass recompute, as
Checkmate's does). ``checkmate_peak_bytes`` replays the program's best schedule as
Checkmate's executor would (each stage in the ops' order, a value freed after its last use)
and reports the peak it reaches: where that peak fits the budget, the schedule is a general
schedule that fits.

Variables, per stage ``t`` (``T`` stages, the last one the first op's backward):

    R[t, i]  binary   forward op i is computed in stage t (1 for the stage's own forward op)
    S[t, s]  binary   storage s is alive at the start of stage t (t = 0..T; S[0] = 0)
    A[t, s]  in [0,1] s is alive through all of stage t without being recomputed in it

    minimize   sum fwd_time_s[i] * R[t, i]  over the computations that are not a forward
    subject to R[t, i] <= R[t, owner(j)] + S[t, j]     each storage j that op i reads
               R[t, owner(s)] + S[t, s] >= 1          each s a backward step t unpacks
               S[t + 1, s] <= S[t, s] + R[t, owner(s)]
               S[t, s] = 1                             the step's outputs, once computed
               A[t, s] >= S[t, s] + S[t + 1, s] - 1 - R[t, owner(s)]
               frontier rows and recomputation rows <= budget (above)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import (
    CostGraph,
    ordered_nodes,
    owned_storages,
    storage_owners,
    storage_refs,
    storages_read,
)
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.staged import recomputable_ops
from chkpt_opt.memory_model.staged.rule import stage_ops

BACKENDS = {"scip": "SCIP", "highs": "HIGHS"}
"""MILP backends bundled with OR-Tools. SCIP reports a proven bound when it stops at its
time limit; through OR-Tools, HiGHS reports its incumbent as its bound, so with HiGHS the
bound is given only once optimality is proven."""

BYTE_SCALE = 2.0**20
"""Rows count MiB, objective milliseconds: coefficients near 1."""
TIME_SCALE = 1e3
TOLERANCE = 1e-6
"""Relative allowance for the backend's tolerances when its bound is reported."""


@dataclass(frozen=True)
class GeneralBound:
    """What Checkmate's program proves at one budget.

    Attributes:
        status: ``"optimal"``, ``"feasible"`` (stopped with a schedule), ``"infeasible"``
            (proven: no schedule fits) or ``"timed_out"`` (stopped with no schedule).
        objective_s: recompute seconds of the best schedule of the program; None without one.
        bound_s: a proven lower bound on the recompute seconds of every schedule that fits
            (the bound of the program); None where the backend proved none.
        checkmate_peak_bytes: the peak of that schedule run as Checkmate's executor runs it
            (each stage in the ops' order, values freed after their last use in the stage).
        recomputed: per stage ``(stage, ops recomputed there)`` of that schedule, stages
            without recomputation left out; a stage is ``"fwd:<op>"`` or ``"bwd:<op>"``.
        time_limit_s: the limit it was given; solve_s: seconds it took (build included).
        backend: the MILP backend; stages, binaries: the program's size.
    """

    status: str
    objective_s: float | None
    bound_s: float | None
    checkmate_peak_bytes: int | None
    recomputed: tuple[tuple[str, tuple[str, ...]], ...]
    time_limit_s: float
    solve_s: float
    backend: str
    stages: int
    binaries: int


@dataclass(frozen=True)
class _Stage:
    """One stage: its frontier rows, the bytes between steps, what its step unpacks."""

    name: str  # "fwd:<op>" or "bwd:<op>"
    forward_op: str | None  # the op whose forward is this stage's frontier
    before_bytes: int  # fixed bytes alive while the stage recomputes
    fronts: tuple[tuple[int, frozenset[str]], ...]  # (fixed bytes during, storages read)
    unpacks: frozenset[str]  # storages the backward step unpacks


@dataclass(frozen=True)
class _Data:
    order: list[str]
    size: dict[str, int]  # storage -> bytes (the storages forward ops create)
    owner: dict[str, str]
    made: dict[str, frozenset[str]]  # op -> storages it creates
    reads: dict[str, frozenset[str]]  # op -> storages it reads (inputs, earlier ones saved)
    outputs: frozenset[str]  # storages the step returns
    stages: list[_Stage]


def _data(graph: CostGraph) -> _Data:
    """The graph's storages and the stages, with their fixed bytes off keep-all's sequence."""
    order = ordered_nodes(graph)
    nodes = graph.nodes
    owner = storage_owners(graph)
    made = {n: frozenset(owned_storages(graph, n, owner)) for n in order}
    size = {s: b for n in order for s, b in owned_storages(graph, n, owner).items()}
    reads = {n: frozenset(storages_read(graph, n, owner)) for n in order}
    outputs = frozenset(s for o in graph.graph["outputs"] for s in storage_refs(graph, o))
    stages: list[_Stage] = []
    live = 0  # bytes of gradients and parameter gradients alive (the same in every schedule)
    sizes: dict[str, int] = {}
    for step in lower(graph, Schedule()):
        for inst, nbytes in step.alloc:
            if not inst.startswith("f:"):
                sizes[inst] = nbytes
                live += nbytes
        during = live + step.transient_bytes
        before = live - sum(n for i, n in step.alloc if not i.startswith("f:"))
        if step.kind == "fwd":
            front = (during, reads[step.node] | made[step.node])
            stages.append(_Stage(f"fwd:{step.node}", step.node, 0, (front,), frozenset()))
        elif step.kind == "bwd":
            unpacks = frozenset(nodes[step.node]["saved"])
            stages.append(_Stage(f"bwd:{step.node}", None, before, ((during, unpacks),), unpacks))
        elif step.kind == "accumulate":
            last = stages[-1]
            stages[-1] = _Stage(
                last.name,
                None,
                last.before_bytes,
                (*last.fronts, (during, frozenset())),
                last.unpacks,
            )
        for inst in step.free:
            if inst in sizes:
                live -= sizes.pop(inst)
    return _Data(order, size, owner, made, reads, outputs, stages)


def general_bound(
    graph: CostGraph,
    budget_bytes: int,
    *,
    time_limit_s: float = 60.0,
    backend: str = "scip",
    forward_recompute: bool = True,
    staged_rules: bool = False,
    hint: frozenset[tuple[str, str]] = frozenset(),
) -> GeneralBound:
    """Solves Checkmate's program at ``budget_bytes`` within ``time_limit_s``.

    Args:
        forward_recompute: let forward stages recompute (Checkmate's program); without, a
            forward stage runs its own op only, as eager autograd does. Every schedule
            PyTorch executes here recomputes nothing in the forward pass, so the program
            without stays a bound over all of them.
        staged_rules: the rules of staged schedules (:mod:`chkpt_opt.memory_model.staged`): a
        backward
            stage (at :func:`~chkpt_opt.memory_model.staged.rule.stage_ops` only) recomputes only
            :func:`~chkpt_opt.memory_model.staged.recomputable_ops` (a staged
            recomputation re-creates every storage of the op that some op saves, as the
            program's own recomputations do).
            The optimum is then a bound over staged schedules only.
        hint: ``(stage, op)`` pairs (``"bwd:<op>"`` stages) of a schedule to start from.

    Raises:
        SolverError: an unknown backend, or a time limit that is not positive.
    """
    if backend not in BACKENDS:
        raise SolverError(f"MILP backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}.")
    if not time_limit_s > 0:
        raise SolverError(f"time_limit_s = {time_limit_s!r} must be > 0 seconds; give e.g. 60.")
    start = time.monotonic()
    solver = pywraplp.Solver.CreateSolver(BACKENDS[backend])
    if solver is None:
        raise SolverError(f"OR-Tools here has no {backend} backend; use backend='scip'.")

    # Data.
    d = _data(graph)
    nodes = graph.nodes
    cost = {n: nodes[n]["fwd_time_s"] * TIME_SCALE for n in d.order}
    mib = {s: b / BYTE_SCALE for s, b in d.size.items()}
    budget = budget_bytes / BYTE_SCALE
    position = {n: i for i, n in enumerate(d.order)}
    born = {}  # storage -> the stage after which it can be alive
    for t, stage in enumerate(d.stages):
        if stage.forward_op is not None:
            for s in d.made[stage.forward_op]:
                born[s] = t + 1
    n_stages = len(d.stages)

    # Variables.
    # R[t][i]: op i is computed in stage t (ops not yet run forward cannot be).
    r: list[dict[str, pywraplp.Variable]] = []
    # S[t][s]: storage s is alive at the start of stage t.
    s_var: list[dict[str, pywraplp.Variable]] = []
    # A[t][s]: s is alive through all of stage t without a recomputation of its owner there.
    a: list[dict[str, pywraplp.Variable]] = []
    recomputable = recomputable_ops(graph) if staged_rules else frozenset(d.order)
    hosts = stage_ops(graph) if staged_rules else frozenset(d.order)
    for t, stage in enumerate(d.stages):
        op = stage.forward_op
        if op is None:
            hosted = stage.name[len("bwd:") :] in hosts
            reach = [i for i in d.order if i in recomputable] if hosted else []
        else:
            reach = d.order[: position[op] + 1] if forward_recompute else [op]
        r.append({i: solver.BoolVar(f"R[{t},{i}]") for i in reach})
    for t in range(n_stages + 1):
        s_var.append({s: solver.BoolVar(f"S[{t},{s}]") for s in d.size if born[s] <= t})
        if t < n_stages:
            a.append({s: solver.NumVar(0.0, 1.0, f"A[{t},{s}]") for s in s_var[t]})

    def alive(t: int, s: str) -> pywraplp.Variable | float:
        return s_var[t].get(s, 0.0)

    def computed(t: int, s: str) -> pywraplp.Variable | float:
        return r[t].get(d.owner[s], 0.0)

    binaries = sum(map(len, r)) + sum(map(len, s_var))

    def result(
        status: str,
        objective_s: float | None = None,
        bound_s: float | None = None,
        chosen: frozenset[tuple[int, str]] = frozenset(),
        peak: int | None = None,
    ) -> GeneralBound:
        recomputed = tuple(
            (stage.name, ops)
            for t, stage in enumerate(d.stages)
            if (ops := tuple(i for i in d.order if (t, i) in chosen and i != stage.forward_op))
        )
        return GeneralBound(
            status,
            objective_s,
            bound_s,
            peak,
            recomputed,
            time_limit_s,
            time.monotonic() - start,
            backend,
            n_stages,
            binaries,
        )

    # Constraints.
    for t, stage in enumerate(d.stages):
        if time.monotonic() - start > time_limit_s:  # building a large program
            return result("timed_out")
        if stage.forward_op is not None:
            solver.Add(r[t][stage.forward_op] == 1)
        for i, var in r[t].items():
            for j in d.reads[i]:
                solver.Add(var <= computed(t, j) + alive(t, j))
        for s in stage.unpacks:
            solver.Add(computed(t, s) + alive(t, s) >= 1)
        for s, after in s_var[t + 1].items():
            solver.Add(after <= alive(t, s) + computed(t, s))
            if s in d.outputs:
                solver.Add(after == 1)
        for s, through in a[t].items():
            solver.Add(through >= alive(t, s) + alive(t + 1, s) - 1 - computed(t, s))
        for fixed, touched in stage.fronts:
            row = sum(mib[s] for s in touched if s in mib)
            row += sum(mib[s] * v for s, v in s_var[t + 1].items() if s not in touched)
            solver.Add(fixed / BYTE_SCALE + row <= budget)
        for k, var in r[t].items():
            if k == stage.forward_op:
                continue
            touched = d.reads[k] | d.made[k]
            own = sum(mib[s] for s in touched) + nodes[k]["fwd_workspace_bytes"] / BYTE_SCALE
            rest = sum(mib[s] * v for s, v in a[t].items() if s not in touched)
            solver.Add(stage.before_bytes / BYTE_SCALE + own * var + rest <= budget)

    # Objective.
    solver.Minimize(
        sum(
            cost[i] * v
            for t, row in enumerate(r)
            for i, v in row.items()
            if i != d.stages[t].forward_op
        )
    )

    # Solve.
    remaining_s = time_limit_s - (time.monotonic() - start)
    if remaining_s <= 0:
        return result("timed_out")
    solver.SetTimeLimit(max(1, int(remaining_s * 1000)))
    if hint:  # the backward stages' recomputations of a schedule to start from
        hinted = [
            (v, float((stage.name, i) in hint))
            for t, stage in enumerate(d.stages)
            if stage.forward_op is None
            for i, v in r[t].items()
        ]
        solver.SetHint([v for v, _ in hinted], [x for _, x in hinted])
    if backend == "scip":
        solver.SetSolverSpecificParametersAsString(
            "parallel/maxnthreads = 1\nrandomization/randomseedshift = 0\n"
        )
    params = pywraplp.MPSolverParameters()  # OR-Tools stops at a 1e-4 relative gap else
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 0.0)
    code = solver.Solve(params)
    if code == pywraplp.Solver.INFEASIBLE:
        return result("infeasible")
    if code not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return result("timed_out")
    chosen = frozenset(
        (t, i) for t, row in enumerate(r) for i, v in row.items() if v.solution_value() > 0.5
    )
    kept = frozenset(
        (t, s) for t, row in enumerate(s_var) for s, v in row.items() if v.solution_value() > 0.5
    )
    objective = sum(cost[i] for t, i in chosen if i != d.stages[t].forward_op) / TIME_SCALE
    bound: float | None = None
    if code == pywraplp.Solver.OPTIMAL:
        bound = objective
    elif backend == "scip":
        bound = solver.Objective().BestBound() / TIME_SCALE
    if bound is not None:
        bound = max(0.0, bound * (1 - TOLERANCE) - 1e-9)
    status = "optimal" if code == pywraplp.Solver.OPTIMAL else "feasible"
    return result(
        status, objective, bound, chosen, checkmate_peak_bytes(graph, chosen, kept, data=d)
    )


def checkmate_peak_bytes(
    graph: CostGraph,
    computed: frozenset[tuple[int, str]],
    kept: frozenset[tuple[int, str]],
    *,
    data: _Data | None = None,
) -> int:
    """The peak of a schedule of the program run as Checkmate's executor runs it: in each
    stage the computed ops in their order, then its backward step; a storage freed once no
    later computation or step of the stage reads it and it is not kept into the next stage.
    ``computed`` holds ``(stage, op)``, ``kept`` ``(stage, storage)`` pairs."""
    d = data if data is not None else _data(graph)
    nodes = graph.nodes
    peak = 0
    live: set[str] = set()
    for t, stage in enumerate(d.stages):
        ops = [i for i in d.order if (t, i) in computed and i != stage.forward_op]
        if stage.forward_op is not None:
            ops.append(stage.forward_op)
        later_reads = [d.reads[i] for i in ops] + [stage.unpacks]
        kept_after = {s for s in d.size if (t + 1, s) in kept}
        live = {s for s in d.size if (t, s) in kept} & set().union(kept_after, *later_reads)
        for k, i in enumerate(ops):
            live |= d.made[i]
            if i == stage.forward_op:  # its fixed bytes hold its workspace
                fixed = stage.fronts[0][0]
            else:
                fixed = stage.before_bytes + nodes[i]["fwd_workspace_bytes"]
            peak = max(peak, fixed + sum(d.size[s] for s in live))
            live &= set().union(kept_after, *later_reads[k + 1 :])
        for fixed, _ in stage.fronts if stage.forward_op is None else ():
            peak = max(peak, fixed + sum(d.size[s] for s in live))
    return peak
