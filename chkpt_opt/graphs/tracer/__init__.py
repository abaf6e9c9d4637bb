"""The tracer: model + example inputs -> CostGraph (the only part of ``graphs`` using torch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from chkpt_opt.errors import TraceError
from chkpt_opt.graphs.costgraph import CostGraph, check_graph
from chkpt_opt.graphs.tracer.aliases import separate_aliases
from chkpt_opt.graphs.tracer.build import ProgressFn, build_cost_graph
from chkpt_opt.graphs.tracer.capture import Captured, capture, normalize_inputs

log = logging.getLogger(__name__)

__all__ = ["Traced", "build_traced", "capture_model", "trace_model"]


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
    dynamic: bool = False,
) -> Traced:
    """Traces ``model`` and returns its cost graph with the captured module.

    The model is traced in its current mode (call ``model.train()`` first to plan training)
    and is not modified. Parameters may live on any device, the meta device included: the
    tracer runs ops on fake tensors only, so op times are roofline estimates (the graph's
    ``cost_model`` says ``roofline-<device>``) and workspace is what the probe sees; what
    only a run on the device shows is written in by :mod:`chkpt_opt.measurement`
    (``chkpt_opt.trace`` does both). With ``dynamic`` the capture keeps the input sizes
    symbolic where the model allows (``captured.input_dims`` says which); the cost graph is
    that of the example's sizes.
    """
    captured, args, kwargs = capture_model(
        model, example_inputs, example_kwargs, method=method, dynamic=dynamic
    )
    return build_traced(
        captured, args, kwargs, name=name or type(model).__name__, progress=progress
    )


def capture_model(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    method: str = "auto",
    dynamic: bool = False,
) -> tuple[Captured, tuple[Any, ...], dict[str, Any]]:
    """The first half of :func:`trace_model`: the capture (and the inputs as captured),
    without the cost graph."""
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
    return capture(model, args, kwargs, method=method, dynamic=dynamic), args, kwargs


def build_traced(
    captured: Captured,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    name: str,
    progress: ProgressFn | None = None,
) -> Traced:
    """The second half of :func:`trace_model`: the cost graph of a capture."""
    graph = build_cost_graph(captured, name=name, progress=progress)
    _warn_opaque_spans(graph)
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
