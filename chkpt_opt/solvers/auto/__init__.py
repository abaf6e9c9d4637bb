"""``solver="auto"``: the exact solver that fits the graph, after the cheap heuristics, and
the searches beyond keep-set; the only module that composes solvers, by what their results
prove.

:mod:`~chkpt_opt.solvers.auto.keep_set` runs the keep-set stages (keep-all, the heuristics,
the exact solver that fits), :mod:`~chkpt_opt.solvers.auto.beyond` the searches beyond
keep-set in the time left; each says what it runs and when it stops.
:mod:`~chkpt_opt.solvers.auto.early` returns at once where a rounding of the recompute
bound's LP, run right after the bound, is within ``gap`` of that bound, and at once where
the bound's floor, which holds over every schedule, proves that nothing fits a budget above
0 bytes (a budget of 0 bytes asks for the lowest peak: ``smallest_peak``) on a graph of more
than ``EARLY_MIN_OPS`` ops (on smaller ones the searches find the lowest peak in seconds).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.frozen import frozen
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.auto.beyond import LOWEST_PEAK_SHARE, beyond_keep_set
from chkpt_opt.solvers.auto.early import EARLY_MIN_OPS, early_result, proven_infeasible
from chkpt_opt.solvers.auto.keep_set import NO_FIT_KEEP_SET_SHARE, keep_set_result
from chkpt_opt.solvers.base import SolveResult, closes_gap
from chkpt_opt.solvers.bounds.integer_cover import with_integer_bound
from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound
from chkpt_opt.solvers.bounds.timed_bound import with_timed_bound
from chkpt_opt.solvers.cached.cache_rounding import cache_rounding
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.interval.prepare import DEFAULT_MAX_POSITIONS
from chkpt_opt.solvers.keepset.choice import PRUNED_MAX_OPS, PRUNED_MIN_POSITIONS
from chkpt_opt.solvers.registry import register
from chkpt_opt.solvers.staged.rounding import staged_rounding

__all__ = ["LOWEST_PEAK_SHARE", "NO_FIT_KEEP_SET_SHARE", "AutoSolver"]

BOUND_SHARE = 0.15
"""The share of the time limit the recompute bound may take (measured 0.2-1.1 s on graphs
of 202-384 ops, 1.3-2.6 s on 586, on 2 shared cores)."""
ROUNDING_SHARE = 0.1
"""The share of the time limit the cached-op rounding may take after the bound and the
staged rounding (it stops judging schedules there; measured 0.3-3 s on Hugging Face graphs
of 153-636 ops)."""
INTEGER_SHARE = 0.1
"""The share of the time limit the recompute bound's program in integers may take, where
the staged rounding's schedule fits but is not proven within ``gap`` by the LP
(:mod:`~chkpt_opt.solvers.bounds.integer_cover`; measured 0.7-7.5 s alone on the Hugging
Face graphs, 19 s on Mixtral's; cut short, the bound SCIP proved so far holds). On ViT at
its layers' peak it proves the staged plan optimal, and ``auto`` returns at once."""
INTEGER_GAIN = 0.04
"""The integer bound is solved only where the staged rounding's schedule is within ``gap``
plus this of the LP's bound: it rose 0.0-3.7% above the LP on the Hugging Face families at
their layers' peak and halfway (``benchmarks/results/bound_looseness/``), so farther away
it cannot close the gap and would only take the searches' time."""
STAGED_ROUNDING_SHARE = 0.35
"""The share of the time limit the staged rounding (:mod:`chkpt_opt.solvers.staged.rounding`)
may take after the bound (it runs before the cached-op rounding, and stops at a schedule
within ``gap`` of the bound; measured 0.5-3.2 s on the Hugging Face Llama, ViT and
Mixtral of 153-636 ops at their layer checkpointing's peak, where it came within 1.3-2.3% of
the recompute bound, and 0.1 s where nothing fits (GPT-2, BERT, T5: dropout); the 32-layer
Llama (1,866 ops) needs 4-6 s after the bound to come within 5-1% of it: at a 20 s limit
``auto`` returns there after 12 s, proven within 0.7%; see
:mod:`~chkpt_opt.solvers.auto.early`)."""


@register("auto", "keep-all if it fits, else the heuristics and the exact solver that fits")
@dataclass(frozen=True)
class AutoSolver:
    """Heuristics, then the exact solver that fits; the best result with an honest status.

    Attributes:
        solvers: the cheap solvers tried first, in order (stopping at a proven optimum).
        exact: also run the exact solver that fits the graph (``pick_exact``).
        enumerate_max_schedules: graphs with at most this many schedules are enumerated.
        flat_max_positions: above this many allowed cuts, graphs of at most
            ``pruned_max_ops`` ops go to the pruned every-cut solver, larger repeated-block
            graphs to the hierarchical solver.
        pruned_max_ops: see ``flat_max_positions``.
        pruned_min_positions: above this many allowed cuts, graphs of at most
            ``pruned_max_ops`` ops go to the pruned every-cut solver (None: only above
            ``flat_max_positions``).
        default_time_limit_s: time limit of the exact solver when none is given.
        general: also search schedules beyond keep-set (cached ops, nested regions); on
            by default.
        nesting: with ``general``, also search nested regions (``dp_nested`` and the
            nested heuristic); False keeps to one level of regions with cached ops, what
            the ``torch.compile`` path runs (``Plan.for_compile``).
        general_share: with ``general``, the share of the time limit kept for the searches
            beyond keep-set (they also get what the keep-set stages leave): the keep-set
            stages stop earlier than without ``general``, which changes their result only
            where they were cut by the limit. At 0.2 that cut fell among the keep-set
            proof times measured on BERT within 20 s and on the corpus's encoder within
            60 s, and a cut proof left the general result costlier than keep-set's; at
            0.1 the searches lost little (``benchmarks/auto_share.py``; docs/limits.md).
            Not taken from a block search that is the whole keep-set stage (the module
            docstring).
        gap: the relative gap at which a proof ends the search: a stage whose result is
            within ``gap`` of a proven bound (``objective - bound <= gap * objective``)
            is returned at once, ``optimal`` only where it meets the bound, else
            ``feasible`` with that bound; the keep-set stages stop at a result within
            ``gap`` of their bound, the searches beyond keep-set at one within ``gap`` of
            a bound over every schedule. 0 stops only at a proven optimum.
        stall_s: the searches beyond keep-set stop once this many seconds have passed
            since the best schedule last improved by more than ``gap`` (checked between
            searches; ``stats["beyond_keep_set_refused"]["stalled"]`` names the first
            skipped). None: they search to the limit.
    """

    solvers: tuple[str, ...] = ("keep_all", "greedy", "sqrt")
    exact: bool = True
    enumerate_max_schedules: int = 2000
    flat_max_positions: int | None = DEFAULT_MAX_POSITIONS
    pruned_max_ops: int = PRUNED_MAX_OPS
    pruned_min_positions: int | None = PRUNED_MIN_POSITIONS
    default_time_limit_s: float = 60.0
    general: bool = True
    nesting: bool = True
    general_share: float = 0.1
    gap: float = 0.01
    stall_s: float | None = None
    name: str = "auto"

    def __post_init__(self) -> None:
        if not 0.0 <= self.gap < 1.0:
            raise SolverError(
                f"auto's gap must lie in [0, 1), got {self.gap!r}; it is the relative gap "
                "(objective - bound) / objective at which a proof ends the search (0.01: 1%)"
            )

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        with frozen(graph):  # every stage simulates this graph: its facts once
            return self._solve(graph, budget_bytes, time_limit_s)

    def _solve(
        self, graph: CostGraph, budget_bytes: int, time_limit_s: float | None
    ) -> SolveResult:
        limit = self.default_time_limit_s if time_limit_s is None else time_limit_s
        deadline = Deadline.after(limit)
        cover = recompute_bound(graph, budget_bytes, deadline=deadline.share(BOUND_SHARE))
        big = graph.number_of_nodes() > EARLY_MIN_OPS
        if big:  # raised to the time-indexed bound where higher (small graphs: the staged
            # program's bound holds over every schedule there)
            cover = with_timed_bound(graph, budget_bytes, cover, deadline.share(BOUND_SHARE))
        if cover.proves_infeasible and budget_bytes > 0 and big:
            return proven_infeasible(graph, budget_bytes, cover, deadline, self.name)
        if not self.general:
            return keep_set_result(self, graph, budget_bytes, deadline, cover)
        # The roundings read only the bound's LP, so they run before the keep-set stages,
        # which would leave them little where they run to their share; the staged one
        # first, where it runs: where it closes the gap (the decoders at their layers'
        # peak), the cached-op rounding is not needed.
        rounded = None
        staged: list[SolveResult] = []
        n = graph.number_of_nodes()
        if simulate(graph, Schedule()).peak_bytes > budget_bytes:  # else keep-all is optimal
            share = BOUND_SHARE
            if self.nesting:  # staged schedules run eagerly only
                share += STAGED_ROUNDING_SHARE
                staged.append(
                    staged_rounding(
                        graph,
                        budget_bytes,
                        relaxed=cover,
                        deadline=deadline.share(share),
                        gap=self.gap,
                    )
                )
                early = early_result(n, staged, cover, deadline, self.gap, self.name)
                reachable = staged[0].feasible and closes_gap(
                    staged[0].objective, cover.bound_s, self.gap + INTEGER_GAIN
                )
                if early is None and n > EARLY_MIN_OPS and reachable:
                    # a schedule that fits, not yet proven within the gap but near it: the
                    # bound in integers may prove it (the later stages are judged by it too)
                    cover = with_integer_bound(
                        graph,
                        budget_bytes,
                        cover,
                        deadline.share(share + INTEGER_SHARE).capped(INTEGER_SHARE * limit),
                    )
                    share += INTEGER_SHARE
                    early = early_result(n, staged, cover, deadline, self.gap, self.name)
                if early is not None:
                    return dataclasses.replace(early, budget_bytes=budget_bytes)
            rounded = cache_rounding(
                graph,
                budget_bytes,
                relaxed=cover,
                deadline=deadline.share(share + ROUNDING_SHARE),
            )
            early = early_result(n, [rounded, *staged], cover, deadline, self.gap, self.name)
            if early is not None:
                return dataclasses.replace(early, budget_bytes=budget_bytes)
        keep_deadline = deadline.share(1.0 - self.general_share)
        keep = keep_set_result(self, graph, budget_bytes, keep_deadline, cover, whole=deadline)
        return beyond_keep_set(
            graph,
            budget_bytes,
            keep,
            rounded,
            deadline,
            cover,
            self.nesting,
            gap=self.gap,
            staged=staged,
            stall_s=self.stall_s,
        )
