"""Preparing a graph for the flat integer programs: the candidate cut positions, the size
limit, the interval model with its program."""

from __future__ import annotations

import time
from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import cut_positions
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.interval.model import IntervalModel
from chkpt_opt.solvers.interval.program import IntervalProgram, build_program
from chkpt_opt.solvers.segments import candidate_cuts

DEFAULT_MAX_POSITIONS = 96
"""Graphs with more allowed cut positions than this are solved over every cut after exact
pruning (:mod:`chkpt_opt.solvers.keepset.pruned`; ``cpsat`` and ``milp`` with ``prune=True``, the
default), or over a candidate subset of cuts (``lp_round``, and ``prune=False``)."""

MAX_FLAT_OPS = 800
"""Largest graph the flat model is built for: its size grows with ops x candidate intervals;
over every cut the 586-op gpt_large has 515 cut positions, up to 132,000 intervals; a
1,162-op decoder exhausted 24 GiB. Larger graphs go to the hierarchical solver (``auto``
does this)."""


def candidate_positions(graph: CostGraph, *, max_positions: int | None) -> list[int] | None:
    """The cut positions regions may start and stop at.

    Returns None (every allowed cut: the exact model) when the graph has at most
    ``max_positions`` interior allowed cuts or ``max_positions`` is None; otherwise the
    low-crossing cuts of :func:`~chkpt_opt.solvers.segments.candidate_cuts`, thinned evenly
    to ``max_positions`` (the model is then exact only over schedules with boundaries there).
    """
    ok = cut_positions(graph)
    n = len(ok) - 1
    interior = [p for p in range(1, n) if ok[p]]
    if max_positions is None or len(interior) <= max_positions:
        return None
    chosen = candidate_cuts(graph)
    if len(chosen) > max_positions:
        step = len(chosen) / max_positions
        chosen = sorted({chosen[int(k * step)] for k in range(max_positions)})
    return [0, *chosen, n]


@dataclass(frozen=True)
class Prepared:
    """An interval model with its integer program.

    Attributes:
        model: the interval model.
        program: its integer program.
        build_s: seconds spent building both.
    """

    model: IntervalModel
    program: IntervalProgram
    build_s: float


def check_flat_size(graph: CostGraph) -> None:
    """Refuses graphs of more than :data:`MAX_FLAT_OPS` ops (SolverError, naming the fix)."""
    if graph.number_of_nodes() > MAX_FLAT_OPS:
        raise SolverError(
            f"graph {graph.graph.get('name', '')!r} has {graph.number_of_nodes()} ops; the flat "
            f"integer program is built for at most {MAX_FLAT_OPS}. Use solver='hierarchical' "
            "(repeated blocks) or 'auto', which picks it."
        )


def prepare(
    graph: CostGraph, *, max_positions: int | None = DEFAULT_MAX_POSITIONS, tight: bool = True
) -> Prepared:
    """Builds the interval model and program of ``graph`` (see :func:`candidate_positions`).

    Raises:
        SolverError: for graphs of more than :data:`MAX_FLAT_OPS` ops.
    """
    check_flat_size(graph)
    start = time.perf_counter()
    positions = candidate_positions(graph, max_positions=max_positions)
    model = build_interval_model(graph, positions=positions)
    program = build_program(model, tight=tight)
    return Prepared(model, program, time.perf_counter() - start)
