"""Repeated blocks of an encoder-decoder (T5: every block reads a tensor of the first, every
decoder block reads the encoder's output), the block search on them, and the incumbent of
the pruned search on such a graph."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from ortools.sat.python import cp_model

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.blocks import options
from chkpt_opt.solvers.blocks.options import OptionPool
from chkpt_opt.solvers.blocks.repeated import find_blocks, fold_shared_lifetimes, split_model
from chkpt_opt.solvers.blocks.search import BlockSearch
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.heuristics.greedy_sweep import greedy_sweep
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.keepset.bound_rounding import bound_rounding
from tests.conftest import assert_valid_result

pytest.importorskip("transformers")

CORPUS = Path(__file__).resolve().parents[3] / "graphs"


@pytest.fixture(scope="module")
def t5_graph() -> CostGraph:
    import torch

    from chkpt_opt.graphs.tracer import trace_model
    from chkpt_opt.zoo import huggingface

    torch.manual_seed(0)
    model, args, kwargs = huggingface.t5(layers=6, width=64, batch=2, seq=32)
    return trace_model(model, args, kwargs, name="t5").graph


def test_blocks_reading_a_shared_tensor_are_found_alike(t5_graph: CostGraph) -> None:
    blocks = find_blocks(t5_graph)
    assert blocks is not None
    kinds = dict(zip(blocks.names, blocks.kinds))
    # Blocks 1 and 2 read the first block's position bias (and, in the decoder, the
    # encoder's output) from wherever it is: they are the same block.
    assert kinds["hf.encoder.block.1"] == kinds["hf.encoder.block.2"]
    assert kinds["hf.decoder.block.1"] == kinds["hf.decoder.block.2"]
    assert kinds["hf.encoder.block.0"] != kinds["hf.encoder.block.1"]


@pytest.mark.slow  # 18-26 s: CI keeps to 15 min
def test_the_block_search_plans_the_encoder_decoder_within_its_limit(t5_graph: CostGraph) -> None:
    budget = int(simulate(t5_graph, Schedule()).peak_bytes * 0.6)
    start = time.perf_counter()
    result = BlockSearch().search(
        t5_graph, budget, deadline=Deadline.after(20), solver="hierarchical"
    )
    assert time.perf_counter() - start < 20 + 5
    assert_valid_result(t5_graph, result, budget)
    assert result.feasible


def test_the_block_search_returns_within_an_expired_limit(t5_graph: CostGraph) -> None:
    budget = int(simulate(t5_graph, Schedule()).peak_bytes * 0.7)
    result = BlockSearch().search(
        t5_graph, budget, deadline=Deadline.after(0.0), solver="hierarchical"
    )
    assert_valid_result(t5_graph, result, budget)
    assert result.stats["timed_out"] and result.solver == "hierarchical"


@pytest.mark.parametrize(
    "fraction",
    [pytest.param(0.9, marks=pytest.mark.slow), 0.7],  # 0.9: 22 s more
)
def test_the_pruned_search_incumbent_is_the_best_of_its_warm_starts(
    t5_graph: CostGraph, fraction: float
) -> None:
    budget = int(simulate(t5_graph, Schedule()).peak_bytes * fraction)
    rounded = bound_rounding(t5_graph, budget)
    assert_valid_result(t5_graph, rounded, budget)
    greedy = greedy_sweep(t5_graph, budget, time_limit_s=None)
    best = get_solver("pruned")(t5_graph, budget, time_limit_s=8)
    assert_valid_result(t5_graph, best, budget)
    incumbent_s = best.stats["incumbent_s"]
    for start in (rounded, greedy):
        if start.feasible:
            assert best.feasible and best.objective <= start.objective + 1e-15
            assert incumbent_s is not None and incumbent_s <= start.objective + 1e-15


def test_a_lowest_peak_solve_cut_short_still_spreads_the_sweeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lowest peak found in the first solve's share counts, proven lowest or not: a
    block whose first solve is cut keeps a range of peaks to sweep (inside auto, the padded
    Llama's first layer had only its keep-all peak left, and 12% more recompute)."""
    graph = load_graph(CORPUS / "gpt_small.json")
    blocks = find_blocks(graph)
    assert blocks is not None
    model, _ = fold_shared_lifetimes(build_interval_model(graph, segments=blocks.bounds), blocks)
    seg = split_model(model, blocks)[1]
    proven = OptionPool(model, seg, seed=0)
    real = options.run_cp

    def cut_short(*args: Any, **kwargs: Any) -> Any:  # the optimum found, not yet proven
        status = real(*args, **kwargs)
        return cp_model.FEASIBLE if status == cp_model.OPTIMAL else status

    monkeypatch.setattr(options, "run_cp", cut_short)
    unproven = OptionPool(model, seg, seed=0)
    assert unproven.p_low == proven.p_low < proven.p_high
