"""``auto``'s stall rule (``stall_s``): the searches beyond keep-set stop once that long has
passed without a better schedule, saying so; without it they run as before."""

from __future__ import annotations

from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver


def test_a_stalled_search_stops_before_the_next_and_says_so() -> None:
    graph = random_dag(24, seed=4)
    budget = int(simulate(graph, Schedule()).peak_bytes * 0.6)
    searched = get_solver("auto")(graph, budget, time_limit_s=10)
    stalled = get_solver("auto", stall_s=0.0)(graph, budget, time_limit_s=10)
    assert "stalled" not in searched.stats.get("beyond_keep_set_refused", {})
    assert any(k.startswith("staged#") for k in searched.stats["beyond_keep_set"])
    refused = stalled.stats["beyond_keep_set_refused"]["stalled"]
    assert refused.startswith("no better schedule for 0 s: stopped before dp_nested")
    assert not any(k.startswith(("staged#", "cached#")) for k in stalled.stats["beyond_keep_set"])
    assert stalled.peak_bytes <= budget and searched.objective <= stalled.objective
    # a long stall lets every search run, as without the rule
    patient = get_solver("auto", stall_s=1e9)(graph, budget, time_limit_s=10)
    assert patient.stats["beyond_keep_set"] == searched.stats["beyond_keep_set"]
