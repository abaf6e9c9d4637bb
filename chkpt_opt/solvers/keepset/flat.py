"""What the flat front-ends (``cpsat``, ``milp``) share: from a graph to a judged result.

Keep-all when it fits; above ``max_positions`` allowed cuts, the pruned every-cut search
(:mod:`~chkpt_opt.solvers.keepset.pruned_search`) with the caller's engine settings; otherwise the
interval program over every cut (or a candidate subset), the greedy warm start, the engine,
the lowest-peak search when the engine proves the budget infeasible, and the simulator's
judgement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.base import SolveResult, keep_all_result
from chkpt_opt.solvers.bounds.lowest_peak import with_lowest_peak
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.interval.judge import Outcome, finish
from chkpt_opt.solvers.interval.prepare import candidate_positions, prepare
from chkpt_opt.solvers.interval.program import IntervalProgram
from chkpt_opt.solvers.keepset.pruned_search import PrunedSearch
from chkpt_opt.solvers.keepset.warm_start import warm_start

Engine = Callable[[IntervalProgram, int, "list[int] | None", Deadline], Outcome]
"""``engine(program, budget_bytes, hint_ids, deadline)``: one engine with its settings."""


def solve_flat(
    name: str,
    graph: CostGraph,
    budget_bytes: int,
    *,
    deadline: Deadline,
    engine: Engine,
    max_positions: int | None,
    pruned: PrunedSearch | None,
    warm_start_hint: bool,
    lowest_settings: Mapping[str, Any],
) -> SolveResult:
    """Solves ``graph`` under ``budget_bytes`` with ``engine`` (see the module docstring).

    Args:
        name: the front-end's name (the result's ``solver``).
        graph: the cost graph.
        budget_bytes: the budget.
        deadline: the solve's deadline.
        engine: the engine, settings bound.
        max_positions: see :func:`~chkpt_opt.solvers.interval.prepare.candidate_positions`.
        pruned: the pruned search for graphs above ``max_positions`` (None: solve over a
            candidate subset of cuts instead); its result is marked ``pruned`` in its stats.
        warm_start_hint: give the engine the greedy schedule as a hint.
        lowest_settings: CP-SAT settings of the lowest-peak search (seed, workers,
            formulation).
    """
    trivial = keep_all_result(graph, budget_bytes, solver=name, deadline=deadline)
    if trivial is not None:
        return trivial
    if pruned is not None and candidate_positions(graph, max_positions=max_positions):
        result = pruned.search(
            graph, budget_bytes, deadline=Deadline.after(deadline.remaining_s()), solver=name
        )
        return dataclasses.replace(
            result, solve_s=deadline.elapsed_s(), stats={**result.stats, "pruned": True}
        )
    prepared = prepare(graph, max_positions=max_positions)
    fallback, hint_ids = warm_start(graph, budget_bytes, prepared.model, time_limit_s=None)
    outcome = engine(
        prepared.program, budget_bytes, hint_ids if warm_start_hint else None, deadline
    )
    outcome, lowest = with_lowest_peak(graph, prepared, outcome, deadline, lowest_settings)
    return finish(
        graph,
        budget_bytes,
        prepared,
        outcome,
        solver=name,
        deadline=deadline,
        fallback=fallback,
        lowest=lowest,
    )
