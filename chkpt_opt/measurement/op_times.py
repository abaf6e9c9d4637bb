"""Measured op times: run the captured graph for real and time every op's forward.

The tracer's default times come from a roofline model (FLOPs and bytes). When the model's
tensors are real (not on the meta device), :func:`measure_forward_times` runs the graph a
few times under ``torch.no_grad()`` and keeps each op's median forward time, which is what
recomputation costs. Module state (buffers, the RNG) is restored afterwards. Given a
deadline, it stops after the first run that leaves too little time for another: a 32-layer
Llama's four runs took 5.6 s of a 10 s planning limit whose capture had taken 4.6.
:func:`write_op_times` puts those times into the cost graph: the forward time measured,
the backward time scaled by the op's FLOP ratio, alike ops given their group's median.

Timing an op node by node through ``torch.fx.Interpreter`` adds the interpreter's own work
per node (fetching arguments, the timer calls), microseconds to tens of microseconds on a
CPU, which the rewritten module (plain generated code) does not pay. A transformer layer
is mostly views, casts and metadata checks that cost about a microsecond eagerly, so that
overhead inflates exactly the ops a whole-layer region recomputes besides its real work.
The interpreter's overhead, measured on a node that does no work (``aten.alias`` of a
one-element tensor, timed the same way), is taken off every op, and the eager call of that
node (timed directly) is added back: what remains is each op's own time plus the
dispatcher's, as the rewritten module runs it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from chkpt_opt.errors import TraceError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer.capture import Captured
from chkpt_opt.measurement.module_state import preserved_state
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline

log = logging.getLogger(__name__)

CALIBRATION_CALLS = 200
"""Calls of the no-work node timed to measure the interpreter's overhead."""


def measure_forward_times(
    module: torch.fx.GraphModule,
    flat_inputs: list[Any],
    *,
    repeats: int = 3,
    deadline: Deadline = NO_DEADLINE,
) -> dict[str, float]:
    """Median forward seconds of every call node, over ``repeats`` runs after a warm-up,
    with the interpreter's per-node overhead taken off (see the module docstring). Fewer
    runs where another would end past ``deadline`` (as long as the last one took): at least
    one, the warm-up, whose times are then the ones kept."""
    device = next(
        (x.device for x in flat_inputs if isinstance(x, torch.Tensor)), torch.device("cpu")
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {}
    timer = _timer_class(sync, samples)
    with preserved_state(module), torch.no_grad():
        for run in range(repeats + 1):
            start = time.perf_counter()
            timer(module).run(*flat_inputs)
            left_s = deadline.remaining_s()
            if run < repeats and left_s is not None and left_s < time.perf_counter() - start:
                log.info("op timing: %d of %d runs, cut by the time limit", run + 1, repeats + 1)
                break
    interpreted, eager = node_overhead_s(device, sync)
    return {
        name: max(0.0, statistics.median(values[1:] or values) - interpreted) + eager
        for name, values in samples.items()
    }


def _timer_class(
    sync: Callable[[], None], samples: dict[str, list[float]]
) -> type[torch.fx.Interpreter]:
    class _Timer(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            if node.op not in ("call_function", "call_method", "call_module"):
                return super().run_node(node)
            sync()
            start = time.perf_counter()
            out = super().run_node(node)
            sync()
            samples.setdefault(node.name, []).append(time.perf_counter() - start)
            return out

    return _Timer


def node_overhead_s(
    device: torch.device, sync: Callable[[], None] = lambda: None
) -> tuple[float, float]:
    """``(interpreted, eager)``: the median seconds of a node that does no work
    (``aten.alias`` of a one-element tensor on ``device``) timed through the interpreter as
    :func:`measure_forward_times` times ops, and called directly."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.alias.default, (x,)))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    samples: dict[str, list[float]] = {}
    timer = _timer_class(sync, samples)(module)
    value = torch.zeros(1, device=device)
    direct = []
    with torch.no_grad():
        for _ in range(CALIBRATION_CALLS):
            timer.run(value)
            sync()
            start = time.perf_counter()
            torch.ops.aten.alias.default(value)
            sync()
            direct.append(time.perf_counter() - start)
    (interpreted,) = samples.values()
    return statistics.median(interpreted), statistics.median(direct)


def write_op_times(
    graph: CostGraph, captured: Captured, *, deadline: Deadline = NO_DEADLINE
) -> None:
    """Replaces the roofline times of ``graph`` by op times measured on the device of
    ``captured`` (its module and inputs, whose cost graph ``graph`` is): ``fwd_time_s`` as
    measured (in as many runs as ``deadline`` allows: :func:`measure_forward_times`),
    ``bwd_time_s`` scaled by the op's FLOP ratio; the graph's ``cost_model`` says
    ``measured-<device>``.

    Raises:
        TraceError: the model is on the meta device, where nothing runs to be timed.
    """
    if graph.graph.get("device_type") == "meta":
        raise TraceError(
            "cannot time ops of a model on the meta device; trace it without profile_times, "
            "or move it to a device first."
        )
    times = _alike_ops_alike_times(
        graph, measure_forward_times(captured.module, captured.flat_inputs, deadline=deadline)
    )
    for name, attrs in graph.nodes(data=True):
        fwd = times.get(name, attrs["fwd_time_s"])
        ratio = attrs["bwd_flops"] / attrs["fwd_flops"] if attrs["fwd_flops"] else 2.0
        attrs["fwd_time_s"] = fwd
        attrs["bwd_time_s"] = fwd * ratio if attrs["has_backward"] else 0.0
    graph.graph["cost_model"] = f"measured-{graph.graph.get('device_type', 'cpu')}"


def _alike_ops_alike_times(graph: CostGraph, times: dict[str, float]) -> dict[str, float]:
    """Measured times with every group of alike ops (the same op on the same sizes and
    FLOPs: the attention of every layer) given the group's median: the same work costs
    the same, and the repeated blocks of a model stay identical for the block solvers
    (their timing noise apart, they are)."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for name, attrs in graph.nodes(data=True):
        if name in times:
            key = (
                attrs["op"],
                attrs["output_bytes"],
                attrs["saved_bytes"],
                attrs["n_saved"],
                attrs["fwd_flops"],
                attrs["bwd_flops"],
            )
            groups.setdefault(key, []).append(name)
    alike: dict[str, float] = {}
    for members in groups.values():
        median = statistics.median(times[m] for m in members)
        alike.update(dict.fromkeys(members, median))
    return alike
