"""How large the every-cut interval program of a graph is, known before its model is built.

The pruned search skips its exact phase where the program and its LP cannot be built in the
time left (:data:`~chkpt_opt.solvers.keepset.pruned_search.EXACT_BUILD_TERMS_PER_S`). Building
the model to count its terms took most of that decision's time: on the padded 4-layer Llama
of ``tests/data/hf_padded`` (323 ops, 29.6 million terms) 2.9 s on a quiet machine, 5.2 s on a
loaded one, most of it the replay of each candidate region, which the count barely needs.
:func:`program_terms_lower` builds the model without replays (every region replays nothing)
and counts that: 1.9 s under the same load, 23.8 million terms.

The count is a lower bound on :func:`~chkpt_opt.solvers.interval.program.count_terms` of the
model :func:`~chkpt_opt.solvers.interval.builder.build_interval_model` builds with the same
``max_cost_s``: the candidate intervals and the lifetimes (every hold row, and every memory
row term of a lifetime) do not depend on replays, and only the replays' own memory row terms
are left out. A program whose lower bound cannot be built in time is certainly too large.
"""

from __future__ import annotations

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.interval.builder import _Builder
from chkpt_opt.solvers.interval.program import count_terms


class _WithoutReplays(_Builder):
    """The interval model's builder with every replay left empty (no bytes, nothing held)."""

    def replay_bytes(
        self,
        a: int,
        last: int,
        last_saver: int,
        cached: frozenset[int] = frozenset(),
        cached_alive: tuple[tuple[int, int], ...] = (),
    ) -> tuple[int, tuple[tuple[int, int], ...]]:
        return 0, ()


def program_terms_lower(
    graph: CostGraph, *, max_cost_s: float | None = None, deadline: Deadline = NO_DEADLINE
) -> int:
    """A lower bound on the terms of the every-cut program of ``graph`` (intervals costing
    more than ``max_cost_s`` left out), counted without building the replays.

    Raises:
        DeadlineExceeded: if the count runs past ``deadline``.
    """
    model = _WithoutReplays(graph, None, (), max_cost_s, deadline).build()
    return count_terms(model)
