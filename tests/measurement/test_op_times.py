"""Op times measured on the device (chkpt_opt.measurement.op_times)."""

from __future__ import annotations

import pytest
import torch

from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.measurement import op_times
from chkpt_opt.measurement.op_times import write_op_times
from chkpt_opt.solvers.deadline import Deadline
from tests.conftest import MODELS


def test_measured_times_take_off_the_interpreters_per_node_overhead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each op's measured time loses the interpreter's overhead and gains the eager call's
    (both measured on a node that does no work), never going below the eager call's."""
    module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    inputs = [torch.randn(4, 8)]
    interpreted, eager = op_times.node_overhead_s(torch.device("cpu"))
    assert interpreted > eager > 0.0
    monkeypatch.setattr(op_times, "node_overhead_s", lambda device, sync=None: (0.0, 0.0))
    raw = op_times.measure_forward_times(module, inputs)
    assert raw and all(t > 0.0 for t in raw.values())
    monkeypatch.setattr(op_times, "node_overhead_s", lambda device, sync=None: (10.0, 1e-6))
    corrected = op_times.measure_forward_times(module, inputs)
    assert set(corrected) == set(raw) and all(t == 1e-6 for t in corrected.values())


def test_profiled_times_replace_estimates_and_leave_the_model_alone() -> None:
    model, args, kwargs = MODELS["resnet"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    traced = trace_model(model, args, kwargs)
    assert traced.graph.graph["cost_model"] == "roofline-cpu"
    write_op_times(traced.graph, traced.captured)
    graph = traced.graph
    assert graph.graph["cost_model"] == "measured-cpu"
    convs = [a for _, a in graph.nodes(data=True) if a["op"] == "aten.conv2d.default"]
    assert convs and all(a["fwd_time_s"] > 0 and a["bwd_time_s"] > 0 for a in convs)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize(("limit_s", "runs"), [(None, 4), (0.0, 1)])
def test_op_timing_runs_the_model_again_only_within_its_deadline(
    monkeypatch: pytest.MonkeyPatch, limit_s: float | None, runs: int
) -> None:
    """Four runs (a warm-up and three timed) without a limit; where a run leaves less time
    than it took, no other starts, and the warm-up's times are the ones kept."""
    module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    started = []
    timer_class = op_times._timer_class

    def counting_timer_class(sync, samples):  # type: ignore[no-untyped-def]
        timer = timer_class(sync, samples)

        def start(module: torch.fx.GraphModule) -> torch.fx.Interpreter:
            started.append(module)
            return timer(module)

        return start

    monkeypatch.setattr(op_times, "_timer_class", counting_timer_class)
    monkeypatch.setattr(op_times, "node_overhead_s", lambda device, sync=None: (0.0, 0.0))
    times = op_times.measure_forward_times(
        module, [torch.randn(4, 8)], deadline=Deadline.after(limit_s)
    )
    assert len(started) == runs
    assert set(times) == {"_0", "_1"} and all(t > 0.0 for t in times.values())
