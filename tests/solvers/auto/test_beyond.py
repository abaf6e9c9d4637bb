"""auto beyond keep-set (solvers/auto/beyond.py) on a decoder: below its keep-set floor the
plan is dp_nested's over the layers (cut beside the rotary tables every layer reads), which
gets the larger share of the time left."""

from __future__ import annotations

from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.solvers import get_solver
from chkpt_opt.zoo import huggingface as hf_zoo
from tests.conftest import assert_valid_result


def test_below_its_keep_set_floor_a_decoder_gets_dp_nesteds_plan_over_its_layers() -> None:
    model, args, _ = hf_zoo.llama(layers=4, width=64, batch=2, seq=64)
    graph = trace_model(model, args, {}).graph
    lowest = get_solver("dp_nested", block_options=False)(graph, 0, time_limit_s=30)
    budget = lowest.peak_bytes  # the lowest peak of its space: no keep-set schedule fits
    result = get_solver("auto")(graph, budget, time_limit_s=10)
    assert_valid_result(graph, result, budget)
    assert result.feasible and result.stats["keep_set"]["status"] == "infeasible"
    assert result.stats["chosen"] == "dp_nested", result.stats.get("beyond_keep_set")
    assert result.objective <= lowest.objective * (1 + 1e-9)
