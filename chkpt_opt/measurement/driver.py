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

import logging
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

OP_TIMING_SHARE = 0.5
"""Op timing starts only while less than this share of the planning's limit has passed: on
2 cores under a load of 8 it took 15-20 s for a 4-layer Llama of width 64 whose capture had
taken 12 s of a 10 s limit. Where it does not start, the plan is made on the estimated op
times (and without the timed choice, which needs measured ones)."""

OP_TIMING_END_SHARE = 0.6
"""Op timing runs the model again only where the run would end before this share of the
planning's limit (the first run always goes): the solve gets the rest."""

log = logging.getLogger(__name__)


def measure_traced(
    traced: Traced, *, profile_times: bool, deadline: Deadline = NO_DEADLINE
) -> Traced:
    """Writes into ``traced.graph`` what is measured on the traced model's device (see the
    module docstring): the kernel workspace on CUDA, and with ``profile_times`` the op
    times and the region costs. Returns ``traced`` (its graph checked again where something
    was written).

    ``deadline`` is the planning's, the one rule for every caller: op timing starts only
    before :data:`OP_TIMING_SHARE` of it has passed, and runs the model again only where
    the run ends before :data:`OP_TIMING_END_SHARE` of it.

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
        if deadline.share(OP_TIMING_SHARE).expired():
            log.info("op timing: skipped, the capture took the time limit; op times estimated")
            return traced
        write_op_times(graph, traced.captured, deadline=deadline.share(OP_TIMING_END_SHARE))
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
