"""``solver="staged"``: staged schedules by Checkmate's program, judged by the simulator.

The program is Checkmate's (:mod:`chkpt_opt.solvers.bounds.general_milp`) over per-stage
decisions, without recomputation in the forward pass (eager autograd runs none), with the
rules of staged schedules: what a stage may recompute and what a recomputation re-creates
(``staged_rules``). Its memory rows count only what is alive in every execution of a
stage's decisions, so its optimum is a lower bound, and the schedule it returns may peak
above the budget in the op sequence (:func:`chkpt_opt.memory_model.staged.sequence.lower_staged`):
every schedule is simulated, and where it peaks above, the program is solved again at a budget
lowered by the excess, until one fits or the time is up (``stats["rounds"]``).

**Bound.** The program without the staged rules (any op may be recomputed, and re-creates
everything it owns) holds every schedule of regions, nested regions, cached and unpacked
ops and every staged schedule; its bound at the budget is the result's ``bound``, a bound
over all of them (also in ``stats["every_schedule_bound_s"]``, kept where the result does
not fit). Where the graph has no op the rules hold back (an op that owns storages and may
not be recomputed: dropout, a state update; no backward step of an op that makes no storage
of its own, where no stage may be: a view's), the two programs are the same and one solve
gives both. ``optimal`` means the schedule's recompute
time meets that bound: optimal over every schedule PyTorch executes here.

**Warm start.** The caller's schedule (``warm_start``: any form, taken as the staged
schedule recomputing the same ops, :func:`~chkpt_opt.memory_model.staged.translate.as_staged`) is
the program's hint and the result where nothing better fits. Graphs above ``max_ops`` ops are
refused: the program has a binary per op and stage (36 000 on 190 ops).

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> from chkpt_opt.memory_model.simulate import simulate
    >>> from chkpt_opt.memory_model.schedule import Schedule
    >>> g = chain_graph(6, activation_bytes=1000)
    >>> r = StagedSolver()(g, int(simulate(g, Schedule()).peak_bytes * 0.8), time_limit_s=10)
    >>> r.status.value, r.schedule.staged != ()
    ('optimal', True)
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.memory_model.staged import recomputable_ops, staged_schedule
from chkpt_opt.memory_model.staged.rule import stage_ops
from chkpt_opt.memory_model.staged.translate import as_staged
from chkpt_opt.solvers.base import SolveResult, SolveStatus, lowest_ranked, result_from_profile
from chkpt_opt.solvers.bounds.general_milp import GeneralBound, general_bound
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.registry import register

DEFAULT_MAX_OPS = 120
MAX_ROUNDS = 8
"""Solves at a lowered budget after the first, at most (each lowers it by the excess)."""


def rules_matter(graph: CostGraph) -> bool:
    """Whether the staged rules hold something back: an op that owns storages and may not be
    recomputed (random, stateful, in place, or reading what a later op writes in place), or
    a backward step that may host no stage (a view's, a ``getitem``'s)."""
    allowed = recomputable_ops(graph)
    hosts = stage_ops(graph)
    outputs = set(graph.graph["outputs"])  # held to the end: never worth recomputing
    return any(
        (a["outputs"] and n not in allowed and n not in outputs)
        or (a["has_backward"] and n not in hosts)
        for n, a in ((n, graph.nodes[n]) for n in ordered_nodes(graph))
    )


def decoded(graph: CostGraph, found: GeneralBound) -> Schedule:
    """The staged schedule of the program's best solution (forward stages recompute
    nothing without ``forward_recompute``)."""
    stages = {name[len("bwd:") :]: ops for name, ops in found.recomputed}
    return Schedule(staged=staged_schedule(graph, stages))


@register(
    "staged",
    "exact per-op recomputation by stage (Checkmate's program without forward recompute), "
    "with a bound over every schedule",
)
@dataclass(frozen=True)
class StagedSolver:
    """Staged schedules by Checkmate's program (see the module docstring).

    Attributes:
        warm_start: a schedule to start from (any form).
        backend: the MILP backend (``"scip"``: it reports a bound when cut by the limit).
        max_ops: the largest graph it takes.
    """

    warm_start: Schedule | None = None
    backend: str = "scip"
    max_ops: int = DEFAULT_MAX_OPS
    name: str = "staged"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        n_ops = graph.number_of_nodes()
        if n_ops > self.max_ops:
            raise SolverError(
                f"graph {graph.graph.get('name', '')!r} has {n_ops} ops; the staged program "
                f"takes at most max_ops={self.max_ops} (a binary per op and stage). Use "
                "solver='auto', or raise max_ops."
            )
        deadline = Deadline.after(time_limit_s if time_limit_s is not None else 60.0)
        hint: frozenset[tuple[str, str]] = frozenset()
        judged: list[tuple[Schedule, MemoryProfile]] = []  # the warm start, then each round's
        if self.warm_start is not None:
            warm = as_staged(graph, self.warm_start)
            hint = frozenset((f"bwd:{b}", op) for b, ops in warm.staged for op in ops)
            judged.append((warm, simulate(graph, warm)))

        def proven(found: GeneralBound) -> float | None:
            # An optimum the backend proved is the bound itself (the sum of the chosen ops'
            # times); otherwise the backend's bound, lowered by its tolerance.
            return found.objective_s if found.status == "optimal" else found.bound_s

        def solve(budget: int, rules: bool) -> GeneralBound:
            return general_bound(
                graph,
                budget,
                time_limit_s=max(0.1, deadline.remaining_s()),
                backend=self.backend,
                forward_recompute=False,
                staged_rules=rules,
                hint=hint,
            )

        rounds: list[dict[str, object]] = []
        bound_s: float | None = None
        proven_infeasible = False
        separate = rules_matter(graph)
        if separate:  # the bound over every schedule, from the program without the rules
            found = solve(budget_bytes, rules=False)
            bound_s, proven_infeasible = proven(found), found.status == "infeasible"
            rounds.append({"program": "bound", "status": found.status, "solve_s": found.solve_s})
        target = budget_bytes
        while not proven_infeasible and not deadline.expired() and len(rounds) <= MAX_ROUNDS:
            found = solve(target, rules=True)
            if not separate and target == budget_bytes:
                bound_s, proven_infeasible = proven(found), found.status == "infeasible"
            rounds.append({"program": "staged", "budget_bytes": target, "status": found.status})
            if found.objective_s is None:
                break
            schedule = decoded(graph, found)
            profile = simulate(graph, schedule, check=False)
            judged.append((schedule, profile))
            rounds[-1]["peak_bytes"] = profile.peak_bytes
            if profile.peak_bytes <= budget_bytes:
                break
            target -= profile.peak_bytes - budget_bytes
        best = lowest_ranked(judged, budget_bytes)  # none judged: keep-all, as others report
        schedule, profile = best if best else (Schedule(), simulate(graph, Schedule()))
        # The simulator sums the same times in another order: equal up to float rounding.
        meets = bound_s is not None and profile.recompute_s <= bound_s * (1 + 1e-9) + 1e-12
        result = result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            bound=bound_s,
            proven_optimal=meets,
            proven_infeasible=proven_infeasible,
            stats={
                "space": "general",
                "rounds": rounds,
                "separate_bound": separate,
                "every_schedule_bound_s": bound_s,
            },
        )
        cut = deadline.expired() or any(r["status"] == "timed_out" for r in rounds)
        if not result.feasible and not result.proves_infeasible and cut:
            # nothing fits and the limit cut the search: no claim that nothing does
            result = dataclasses.replace(result, status=SolveStatus.TIMED_OUT)
        return result
