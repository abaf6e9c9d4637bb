"""What every solver returns, and the protocol a solver follows.

A solver is a value: a frozen dataclass holding its settings, called as
``solver(graph, budget_bytes, time_limit_s=...)``. It sees only a CostGraph and a byte
count, never a model, so it runs on exported graph files. The bytes are activation bytes,
what the forward and backward passes create (``simulate(graph, schedule).peak_bytes``), in
the budget it takes and the peak it reports; the whole step's figures are
``chkpt_opt.solve``'s.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.deadline import Deadline

INF_BYTES = 1 << 62
"""Above every byte total of a graph, in bytes: no limit (``-INF_BYTES``: below every total,
the maximum of nothing). The DP solvers' sums are 64-bit integers, so a graph's byte totals
must stay below it."""


class SolveStatus(str, enum.Enum):
    """How good a result is known to be.

    ``optimal``: proven optimal for the schedule model. ``feasible``: fits the budget, no
    proof of optimality (see ``bound``). ``infeasible``: nothing the solver found fits (the
    schedule returned is the lowest-peak one it found). ``timed_out``: the time limit ran
    out before any feasible schedule was found.
    """

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class SolveResult:
    """The outcome of a solve.

    Attributes:
        schedule: the best schedule found (the lowest-peak one when none fits).
        status: see :class:`SolveStatus`.
        objective: extra compute of ``schedule``, in estimated seconds of recomputation.
        bound: a proven lower bound on the objective of any schedule that fits, or None.
        peak_bytes: simulated peak of ``schedule`` in activation bytes (forward and
            backward, without the resident memory): ``simulate(graph, schedule).peak_bytes``.
        budget_bytes: the activation budget the solver was given (the same bytes; a
            whole-step budget minus the resident memory, see
            :func:`chkpt_opt.step_budget.budget.split_budget`).
        solver: the solver's name.
        solve_s: wall-clock seconds spent solving.
        stats: solver-specific numbers (candidates tried, nodes explored, ...).
        proves_infeasible: the solver proved that no schedule of the whole schedule model
            fits the budget (only with status ``infeasible``).
    """

    schedule: Schedule
    status: SolveStatus
    objective: float
    bound: float | None
    peak_bytes: int
    budget_bytes: int
    solver: str
    solve_s: float
    stats: Mapping[str, Any] = field(default_factory=dict)
    proves_infeasible: bool = False

    @property
    def proves_optimal(self) -> bool:
        """Whether the schedule is proven optimal for the whole schedule model."""
        return self.status == SolveStatus.OPTIMAL

    @property
    def proven(self) -> bool:
        """Whether the status is a proof: optimal, or infeasible with a proof; a solver that
        composes others may stop at such a result."""
        return self.proves_optimal or (
            self.status == SolveStatus.INFEASIBLE and self.proves_infeasible
        )

    @property
    def feasible(self) -> bool:
        """Whether the schedule fits the budget."""
        return self.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)

    @property
    def gap(self) -> float | None:
        """Relative optimality gap ``(objective - bound) / objective`` (0 when optimal)."""
        if self.bound is None or not self.feasible:
            return None
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


def rank(profile: MemoryProfile, budget_bytes: int) -> tuple[int, float, float]:
    """Smaller is better: a simulated schedule that fits first, then the cheaper (ties: the
    lower peak); among those that do not fit, the lower peak (ties: the cheaper)."""
    peak_bytes, recompute_s = profile.peak_bytes, profile.recompute_s
    if peak_bytes <= budget_bytes:
        return (0, recompute_s, float(peak_bytes))
    return (1, float(peak_bytes), recompute_s)


def meets_bound(objective_s: float, bound_s: float | None) -> bool:
    """Whether a cost meets a proven lower bound on it (rounding aside): it is optimal."""
    return bound_s is not None and objective_s <= bound_s + 1e-12


def closes_gap(objective_s: float, bound_s: float | None, gap: float) -> bool:
    """Whether a cost is within the relative ``gap`` of a proven lower bound on it
    (``objective - bound <= gap * objective``; a cost that meets the bound always is)."""
    if bound_s is None:
        return False
    return meets_bound(objective_s, bound_s) or objective_s - bound_s <= gap * objective_s


T = TypeVar("T")


def lowest_ranked(
    judged: Iterable[tuple[T, MemoryProfile]], budget_bytes: int
) -> tuple[T, MemoryProfile] | None:
    """The best of ``judged`` (candidates, each with its simulated profile) by :func:`rank`:
    the cheapest that fits, else the lowest peak; the first of equals. None when empty.
    Every search that simulates candidates and keeps the best keeps it with this."""
    return min(judged, key=lambda pair: rank(pair[1], budget_bytes), default=None)


def best_simulated(
    graph: CostGraph, budget_bytes: int, schedules: Iterable[Schedule], *, deadline: Deadline
) -> tuple[Schedule, MemoryProfile, int]:
    """The best of ``schedules`` as the simulator judges them (:func:`lowest_ranked`), each
    distinct one simulated once until ``deadline`` passes; keep-all when none was judged.
    Returns it, its profile and how many schedules were judged."""
    seen: set[Schedule] = set()

    def simulated() -> Iterator[tuple[Schedule, MemoryProfile]]:
        for schedule in schedules:
            if deadline.expired():
                return
            if schedule not in seen:
                seen.add(schedule)
                yield schedule, simulate(graph, schedule)

    best = lowest_ranked(simulated(), budget_bytes)
    if best is None:
        best = (Schedule(), simulate(graph, Schedule()))
    return best[0], best[1], len(seen)


def best_of(results: Sequence[SolveResult]) -> SolveResult:
    """The cheapest result that fits (ties: the lower peak, then the earlier), else the
    lowest-peak one (ties: the cheaper, then the earlier): :func:`rank`, with fitting read
    from the status."""
    feasible = [r for r in results if r.feasible]
    if feasible:
        return min(feasible, key=lambda r: (r.objective, r.peak_bytes))
    return min(results, key=lambda r: (r.peak_bytes, r.objective))


class Solver(Protocol):
    """A solver: a value with a name, called on a graph and an activation budget."""

    name: str

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult: ...


def result_from_profile(
    schedule: Schedule,
    profile: MemoryProfile,
    *,
    budget_bytes: int,
    solver: str,
    solve_s: float,
    bound: float | None = None,
    proven_optimal: bool = False,
    proven_infeasible: bool = False,
    stats: Mapping[str, Any] | None = None,
) -> SolveResult:
    """Builds a SolveResult for a schedule that was simulated, setting the status honestly.

    ``proven_infeasible``: the solver proved no schedule fits (kept only when the schedule
    indeed does not fit).
    """
    fits = profile.peak_bytes <= budget_bytes
    if not fits:
        status = SolveStatus.INFEASIBLE
    elif proven_optimal or (bound is not None and profile.recompute_s <= bound + 1e-12):
        status = SolveStatus.OPTIMAL
    else:
        status = SolveStatus.FEASIBLE
    return SolveResult(
        schedule=schedule,
        status=status,
        objective=profile.recompute_s,
        bound=bound if fits else None,
        peak_bytes=profile.peak_bytes,
        budget_bytes=budget_bytes,
        solver=solver,
        solve_s=solve_s,
        stats=dict(stats or {}),
        proves_infeasible=proven_infeasible and not fits,
    )


def keep_all(
    graph: CostGraph,
    budget_bytes: int,
    *,
    solver: str,
    deadline: Deadline,
    stats: Mapping[str, Any] | None = None,
) -> SolveResult:
    """The keep-all schedule, simulated: optimal (it recomputes nothing) when it fits."""
    profile = simulate(graph, Schedule())
    return result_from_profile(
        Schedule(),
        profile,
        budget_bytes=budget_bytes,
        solver=solver,
        solve_s=deadline.elapsed_s(),
        bound=0.0,
        stats=stats,
    )


def keep_all_result(
    graph: CostGraph, budget_bytes: int, *, solver: str, deadline: Deadline
) -> SolveResult | None:
    """:func:`keep_all`'s result when it fits, else None."""
    result = keep_all(
        graph, budget_bytes, solver=solver, deadline=deadline, stats={"trivial": "keep_all fits"}
    )
    return result if result.feasible else None
