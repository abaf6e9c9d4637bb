"""The one driver of the measurements (chkpt_opt.measurement.driver): the tracer alone
measures nothing; trace, plan and the attachment write every measured attribute through
measure_traced, once per graph."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.measurement import driver, measure_traced
from chkpt_opt.measurement.region_costs import RegionCosts
from chkpt_opt.solvers.deadline import Deadline

REGION_COSTS = RegionCosts(
    region_overhead_s=3e-4, cached_region_overhead_s=2e-4, cached_op_overhead_s=1e-5
)
"""What the stand-in measurement of the region costs reports."""

OP_TIME_S = 1e-3
"""What the stand-in measurement of the op times gives every op."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Stands in for the op-time and region-cost measurements (fixed values, no timing)
    and counts their calls."""
    calls = {"op_times": 0, "region_costs": 0}

    def write_op_times(graph: CostGraph, captured: Any, *, deadline: Deadline) -> None:
        calls["op_times"] += 1
        for _, attrs in graph.nodes(data=True):
            attrs["fwd_time_s"] = OP_TIME_S
        graph.graph["cost_model"] = "measured-cpu"

    def measure_region_costs(device: torch.device) -> RegionCosts:
        calls["region_costs"] += 1
        return REGION_COSTS

    monkeypatch.setattr(driver, "write_op_times", write_op_times)
    monkeypatch.setattr(driver, "measure_region_costs", measure_region_costs)
    return calls


def _assert_measured(graph: CostGraph) -> None:
    assert graph.graph["cost_model"] == "measured-cpu"
    assert graph.graph["region_overhead_s"] == REGION_COSTS.region_overhead_s
    assert graph.graph["cached_op_overhead_s"] == REGION_COSTS.cached_op_overhead_s
    assert all(a["fwd_time_s"] == OP_TIME_S for _, a in graph.nodes(data=True))


def test_the_tracer_alone_measures_nothing() -> None:
    graph = trace_model(_model(), (torch.randn(8, 16),)).graph
    assert graph.graph["cost_model"] == "roofline-cpu"
    assert "region_overhead_s" not in graph.graph
    assert not str(graph.graph.get("workspace_model", "")).startswith("measured")


def test_each_measurement_runs_once_per_graph(measured: dict[str, int]) -> None:
    traced = trace_model(_model(), (torch.randn(8, 16),))
    measure_traced(traced, profile_times=False)
    assert measured == {"op_times": 0, "region_costs": 0}
    measure_traced(traced, profile_times=True)
    measure_traced(traced, profile_times=True)
    assert measured == {"op_times": 1, "region_costs": 1}
    _assert_measured(traced.graph)


def test_op_timing_keeps_to_the_planning_deadline(
    measured: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one rule for plan() and the attachment: op timing does not start once
    OP_TIMING_SHARE of the planning's limit has passed (the capture took it), and its runs
    keep to OP_TIMING_END_SHARE of it."""
    traced = trace_model(_model(), (torch.randn(8, 16),))
    started = time.perf_counter() - (10.0 * driver.OP_TIMING_SHARE + 1.0)
    planning = Deadline(started, 10.0)  # the capture took more than the share
    measure_traced(traced, profile_times=True, deadline=planning)
    assert measured == {"op_times": 0, "region_costs": 0}
    assert traced.graph.graph["cost_model"] == "roofline-cpu"

    given: list[Deadline] = []
    monkeypatch.setattr(
        driver,
        "write_op_times",
        lambda graph, captured, *, deadline: given.append(deadline),
    )
    measure_traced(traced, profile_times=True, deadline=Deadline.after(10.0))
    assert given[0].limit_s == pytest.approx(10.0 * driver.OP_TIMING_END_SHARE)


def test_a_cuda_graph_gets_its_kernel_workspace_measured_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA the workspace is measured with or without profile_times, once per graph (a
    CPU graph labelled CUDA, the allocator's measurement stood in for)."""
    calls: list[str] = []

    def add_unseen_workspaces(graph: CostGraph, captured: Any) -> None:
        calls.append(graph.graph["name"])
        graph.graph["workspace_model"] = "measured-cuda"

    monkeypatch.setattr(driver, "add_unseen_workspaces", add_unseen_workspaces)
    traced = trace_model(_model(), (torch.randn(8, 16),), name="labelled")
    measure_traced(traced, profile_times=False)
    assert calls == []  # a CPU graph: the probe's workspace is exact there
    traced.graph.graph["device_type"] = "cuda"
    measure_traced(traced, profile_times=False)
    measure_traced(traced, profile_times=False)
    assert calls == ["labelled"]


def test_trace_plan_and_the_attachment_measure_through_the_driver(
    measured: dict[str, int],
) -> None:
    x = torch.randn(8, 16)
    _assert_measured(chkpt_opt.trace(_model(), (x,), profile_times=True))
    made = chkpt_opt.plan(_model(), (x,), budget=10**12, optimizer=None, profile_times=True)
    _assert_measured(made.graph)
    assert measured == {"op_times": 2, "region_costs": 2}
    model = chkpt_opt.optimize(_model(), budget=10**12, optimizer=None, profile_times=True)
    model(x).sum().backward()
    assert measured == {"op_times": 3, "region_costs": 3}


def test_profiled_plans_measure_the_overhead() -> None:
    model = _model()
    made = chkpt_opt.plan(
        model, (torch.randn(8, 16),), budget=10**12, optimizer=None, profile_times=True
    )
    overhead = made.graph.graph["region_overhead_s"]
    assert 0.0 < overhead < 0.05  # a checkpoint call costs microseconds to milliseconds
    assert 0.0 <= made.graph.graph["cached_region_overhead_s"] < 0.05
    assert 0.0 < made.graph.graph["cached_op_overhead_s"] < 0.01  # a Python dispatch per op
    assert "region_overhead_s" not in chkpt_opt.trace(model, (torch.randn(8, 16),)).graph
    # trace(profile_times=True) measures what plan(profile_times=True) does: trace then
    # solve sees the graph plan solves.
    profiled = chkpt_opt.trace(model, (torch.randn(8, 16),), profile_times=True)
    keys = ("region_overhead_s", "cached_region_overhead_s", "cached_op_overhead_s")
    assert all(0.0 <= profiled.graph[key] < 0.05 for key in keys)
