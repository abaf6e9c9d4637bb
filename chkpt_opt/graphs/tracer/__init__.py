"""The tracer: model + example inputs -> CostGraph (the only part of ``graphs`` using torch)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from chkpt_opt.errors import TraceError
from chkpt_opt.graphs.costgraph import CostGraph, check_graph
from chkpt_opt.graphs.tracer.aliases import separate_aliases
from chkpt_opt.graphs.tracer.build import ProgressFn, build_cost_graph
from chkpt_opt.graphs.tracer.capture import Captured, capture, normalize_inputs
from chkpt_opt.graphs.tracer.device_workspace import Ruler, unseen_workspaces

log = logging.getLogger(__name__)

__all__ = ["Traced", "apply_measured_times", "trace", "trace_model"]


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
    dynamic: bool = False,
) -> Traced:
    """Traces ``model`` and returns its cost graph with the captured module.

    The model is traced in its current mode (call ``model.train()`` first to plan training)
    and is not modified. Parameters may live on any device, the meta device included: the
    tracer runs ops on fake tensors, unless ``profile_times`` asks it to time every op's
    forward for real (then ``fwd_time_s`` is measured, ``bwd_time_s`` scaled by the op's
    FLOP ratio, and the graph's ``cost_model`` says ``measured-<device>``). On CUDA every
    op also runs once for real, forward and backward, to add the kernel workspace that the
    caching allocator holds beyond its tensors (:mod:`.device_workspace`; the graph's
    ``workspace_model`` says ``measured-cuda``). With ``dynamic`` the capture keeps the
    input sizes symbolic where the model allows (``captured.input_dims`` says which); the
    cost graph is that of the example's sizes.
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; wrap the function "
            "in a Module whose forward calls it."
        )
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    args, kwargs, copied = separate_aliases(args, kwargs, model)
    if copied:
        log.info(
            "inputs %s share memory with another input or a parameter: captured as separate "
            "inputs (copies), so calls with distinct tensors there compute what the model does",
            ", ".join(copied),
        )
    if not model.training:
        log.warning(
            "%s is in eval mode; tracing it as is (call model.train() to plan training)",
            type(model).__name__,
        )
    _warn_autocast_cache(model)
    captured = capture(model, args, kwargs, method=method, dynamic=dynamic)
    graph = build_cost_graph(captured, name=name or type(model).__name__, progress=progress)
    _warn_opaque_spans(graph)
    if profile_times:
        apply_measured_times(graph, captured)
    if graph.graph.get("device_type") == "cuda":
        add_unseen_workspaces(graph, captured)
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


def apply_measured_times(graph: CostGraph, captured: Captured) -> None:
    """Replaces the roofline times of ``graph`` by op times measured on the captured
    module's device (what ``trace_model(..., profile_times=True)`` does after the trace)."""
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


def add_unseen_workspaces(
    graph: CostGraph, captured: Captured, allocator: Callable[[], Ruler] | None = None
) -> None:
    """Adds to every op's forward and backward workspace what the device's allocator
    (``allocator`` makes its ruler; default CUDA's) held beyond the tensor storages while
    the op ran (see :mod:`.device_workspace`)."""
    nodes = {name: bool(attrs["has_backward"]) for name, attrs in graph.nodes(data=True)}
    try:
        unseen = unseen_workspaces(
            captured.module, captured.flat_inputs, nodes, allocator=allocator
        )
    except Exception as err:  # the plan stands on the probe's workspace, as on the CPU
        log.warning(
            "could not measure kernel workspace on the device (%s: %s); predictions leave "
            "out what kernels take beyond their tensors",
            type(err).__name__,
            err,
        )
        return
    for name, (forward, backward) in unseen.items():
        attrs = graph.nodes[name]
        attrs["fwd_workspace_bytes"] += forward
        if attrs["has_backward"]:
            attrs["bwd_workspace_bytes"] += backward
    graph.graph["workspace_model"] = f"measured-{graph.graph['device_type']}"
    log.info(
        "kernel workspace unseen by the tracer: %d ops, at most %d bytes",
        sum(1 for f, b in unseen.values() if f or b),
        max((max(f, b) for f, b in unseen.values()), default=0),
    )


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
