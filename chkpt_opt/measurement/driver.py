"""The one driver that writes measurements into a cost graph, and when it runs them.

The tracer builds the graph on fake tensors (:func:`chkpt_opt.graphs.tracer.trace_model`);
:func:`measure_traced` then writes what only a run on the model's device shows:

* on a CUDA device, always: the kernel workspace the allocator holds beyond the tensors
  (:mod:`~chkpt_opt.measurement.workspace`; the graph's ``workspace_model``);
* with ``profile_times``: every op's time (:mod:`~chkpt_opt.measurement.op_times`; the
  graph's ``cost_model``) and what a recompute region and a selective-checkpoint policy
  cost beyond their ops (:mod:`~chkpt_opt.measurement.region_costs`; the graph's
  ``region_overhead_s``, ``cached_region_overhead_s``, ``cached_op_overhead_s``).

Each measurement runs at most once per graph: a graph that holds it keeps it. ``trace``,
``plan`` and the attachment all reach the measurements through here (``trace`` and ``plan``
through :func:`trace_and_measure`), so ``trace`` then ``solve`` sees the graph ``plan``
solves.
"""

from __future__ import annotations

from typing import Any

import torch

from chkpt_opt.graphs.costgraph import check_graph
from chkpt_opt.graphs.tracer import Traced, trace_model
from chkpt_opt.graphs.tracer.build import ProgressFn
from chkpt_opt.measurement.op_times import write_op_times
from chkpt_opt.measurement.region_costs import measure_region_costs
from chkpt_opt.measurement.step import device_of
from chkpt_opt.measurement.workspace import add_unseen_workspaces
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline

MEASURED = "measured-"
"""How the graph's ``cost_model`` and ``workspace_model`` begin once measured."""


def measure_traced(
    traced: Traced, *, profile_times: bool, deadline: Deadline = NO_DEADLINE
) -> Traced:
    """Writes into ``traced.graph`` what is measured on the traced model's device (see the
    module docstring): the kernel workspace on CUDA, and with ``profile_times`` the op
    times (in as many runs as ``deadline`` allows) and the region costs. Returns
    ``traced`` (its graph checked again where something was written).

    Raises:
        TraceError: ``profile_times`` for a model on the meta device (nothing runs there).
    """
    graph = traced.graph
    attrs = graph.graph
    written = False
    if attrs.get("device_type") == "cuda" and not _measured(attrs.get("workspace_model")):
        add_unseen_workspaces(graph, traced.captured)
        written = True
    if profile_times and not _measured(attrs.get("cost_model")):
        write_op_times(graph, traced.captured, deadline=deadline)
        written = True
    if profile_times and "region_overhead_s" not in attrs:
        device = device_of(traced.captured.module, traced.args)
        measure_region_costs(device).store(graph)
        written = True
    if written:
        check_graph(graph)
    return traced


def trace_and_measure(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    method: str = "auto",
    profile_times: bool = False,
    dynamic: bool = False,
    progress: ProgressFn | None = None,
) -> Traced:
    """:func:`~chkpt_opt.graphs.tracer.trace_model` (the arguments but ``profile_times``
    are its own), then :func:`measure_traced`: the capture and the cost graph with every
    measurement asked for written in."""
    traced = trace_model(
        model,
        example_inputs,
        example_kwargs,
        name=name,
        method=method,
        progress=progress,
        dynamic=dynamic,
    )
    return measure_traced(traced, profile_times=profile_times)


def _measured(model_name: object) -> bool:
    return isinstance(model_name, str) and model_name.startswith(MEASURED)
