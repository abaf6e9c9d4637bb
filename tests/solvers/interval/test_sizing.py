"""The program's size before its model is built (solvers.interval.sizing): a lower bound on
the terms of the model built with the same cost cap, and a deadline that stops it."""

from __future__ import annotations

from pathlib import Path

import pytest

from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.solvers.deadline import Deadline, DeadlineExceeded
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.interval.program import count_terms
from chkpt_opt.solvers.interval.sizing import program_terms_lower

CORPUS = Path(__file__).resolve().parents[3] / "graphs"


@pytest.mark.parametrize("cap_share", [None, 0.5, 0.1])
def test_the_count_without_replays_is_a_lower_bound_on_the_programs_terms(
    cap_share: float | None,
) -> None:
    graphs = [
        random_dag(40, seed=5, skip_prob=0.5, max_inputs=3),
        chain_graph(12),
        load_graph(CORPUS / "gpt_small.json"),
    ]
    for graph in graphs:
        total = sum(graph.nodes[v]["fwd_time_s"] for v in graph.nodes)
        cap = None if cap_share is None else cap_share * total
        full = count_terms(build_interval_model(graph, max_cost_s=cap))
        lower = program_terms_lower(graph, max_cost_s=cap)
        assert 0 < lower <= full, (graph.graph.get("name"), cap_share)


def test_the_count_stops_at_its_deadline() -> None:
    graph = load_graph(CORPUS / "gpt_small.json")
    with pytest.raises(DeadlineExceeded, match="interval model"):
        program_terms_lower(graph, deadline=Deadline.after(0.0))
