"""The tracer: model + example inputs -> CostGraph (the only part of ``graphs`` using torch)."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from chkpt_opt.errors import TraceError
from chkpt_opt.graphs.costgraph import CostGraph, check_graph
from chkpt_opt.graphs.tracer.build import ProgressFn, build_cost_graph
from chkpt_opt.graphs.tracer.capture import Captured, capture, normalize_inputs

log = logging.getLogger(__name__)

__all__ = ["Traced", "trace", "trace_model"]


@dataclass
class Traced:
    """A traced model: its cost graph and the captured fx module codegen rewrites.

    Attributes:
        graph: the CostGraph.
        captured: the capture (GraphModule sharing the model's parameters, inputs, method).
        args: the positional example inputs.
        kwargs: the keyword example inputs.
    """

    graph: CostGraph
    captured: Captured
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def trace_model(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    method: str = "auto",
    progress: ProgressFn | None = None,
    profile_times: bool = False,
) -> Traced:
    """Traces ``model`` and returns its cost graph with the captured module.

    The model is traced in its current mode (call ``model.train()`` first to plan training)
    and is not modified. Parameters may live on any device, the meta device included: the
    tracer only ever runs ops on fake tensors, unless ``profile_times`` asks it to time
    every op's forward for real (then ``fwd_time_s`` is measured, ``bwd_time_s`` scaled by
    the op's FLOP ratio, and the graph's ``cost_model`` says ``measured-<device>``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; wrap the function "
            "in a Module whose forward calls it."
        )
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    if not model.training:
        log.warning(
            "%s is in eval mode; tracing it as is (call model.train() to plan training)",
            type(model).__name__,
        )
    _warn_autocast_cache(model)
    captured = capture(model, args, kwargs, method=method)
    graph = build_cost_graph(captured, name=name or type(model).__name__, progress=progress)
    _warn_opaque_spans(graph)
    if profile_times:
        _apply_measured_times(graph, captured)
    check_graph(graph)
    return Traced(graph=graph, captured=captured, args=args, kwargs=kwargs)


def _warn_autocast_cache(model: torch.nn.Module) -> None:
    """Warns that autocast's weight cache, which the cost graph does not see, is on.

    Under ``torch.autocast(cache_enabled=True)`` (the default) the low-precision copies of
    the parameters stay cached until autocast exits, so a step planned in that context can
    take up to their size more than the plan says.
    """
    devices = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if not devices or not torch.is_autocast_cache_enabled():
        return
    itemsize = torch.get_autocast_dtype(devices[0]).itemsize
    cached = sum(
        p.numel() * itemsize
        for p in model.parameters()
        if p.requires_grad and p.dtype.is_floating_point and p.dtype.itemsize > itemsize
    )
    log.warning(
        "tracing under torch.autocast with its weight cache on: the cached low-precision "
        "copies of the parameters (up to %d bytes) are not in the plan, so the step can take "
        "that much more than planned; use torch.autocast(..., cache_enabled=False) to train "
        "as planned",
        cached,
    )


def _warn_opaque_spans(graph: CostGraph) -> None:
    """Warns about autocast blocks inside forward, which torch.export keeps as one op."""
    spans = [n for n, a in graph.nodes(data=True) if "wrap_with_autocast" in a["op"]]
    if spans:
        log.warning(
            "%d torch.autocast block(s) inside forward (%s) are single ops in the plan: nothing "
            "inside them is recomputed separately, and their backward is estimated as one "
            "step (conservatively)",
            len(spans),
            ", ".join(spans[:3]),
        )


def trace(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    method: str = "auto",
) -> CostGraph:
    """Traces ``model`` on example inputs into a CostGraph.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> g = trace(net, (torch.randn(4, 8),))
        >>> [g.nodes[n]["op"] for n in sorted(g, key=lambda n: g.nodes[n]["index"])]
        ['aten.linear.default', 'aten.relu.default', 'aten.linear.default']
    """
    return trace_model(model, example_inputs, example_kwargs, name=name, method=method).graph


def _apply_measured_times(graph: CostGraph, captured: Captured) -> None:
    from chkpt_opt.graphs.tracer.timing import measure_forward_times

    if graph.graph.get("device_type") == "meta":
        raise TraceError(
            "cannot time ops of a model on the meta device; trace without profile_times."
        )
    times = _alike_ops_alike_times(
        graph, measure_forward_times(captured.module, captured.flat_inputs)
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
