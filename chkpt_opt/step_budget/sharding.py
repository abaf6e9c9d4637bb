"""Per-rank budgets of sharded training (FSDP2, DDP): what one rank holds through the step.

Under FSDP2 (``fully_shard`` per decoder layer and at the root) each rank keeps
``1/world_size`` of the parameters, gradients and optimizer states, in the dtype of the
sharded parameters (fp32 master weights under a bf16 ``MixedPrecisionPolicy``:
``master_element_bytes=4``), plus, while the step runs, the unsharded parameters of the
units alive at once and the unsharded gradients of the unit whose backward has just run.
Under DDP each rank keeps every state whole, plus its gradient buckets. Activations are
those of the local batch: trace the model at the batch one rank sees.

:func:`rank_static_memory` is the one formula, and :func:`per_rank_graph` the cost graph a
solver gets for one rank (the gradients the simulator would place in time at full size
are counted resident at their per-rank size instead). The units are read off the graph:
the repeated layers (:func:`chkpt_opt.export.layers.find_layers`) are one unit each, the
rest of the parameters (embeddings, final norm, head) the root unit.

Per rank, with ``W`` ranks, ``s(x) = ceil(x * master / traced / W)`` (``master/traced``
the ratio of the sharded to the traced element size, 1 when not given):

* FSDP2: parameters ``s(P)``, gradients ``s(T)``, optimizer state ``copies * s(T)`` plus
  one step counter per tensor; communication bytes ``root + 3 * largest`` (the root unit
  is never resharded after forward; the current layer, the next one all-gathered, and that
  all-gather's flat output until it is copied out) with ``reshard_after_forward``, else
  ``root + sum(layers) + largest`` (every layer stays unsharded until its backward), plus
  ``(root + largest) * (1 + master/traced)`` of unsharded gradients with their
  reduce-scatter input (the root unit's are reduced last). An upper bound: FSDP2 frees
  some of these before the peak.
* DDP: every state whole, plus buckets holding a copy of every gradient (``T``; measured:
  DDP's reducer allocates them at construction, whatever ``bucket_cap_mb``); with
  ``gradient_as_bucket_view`` the gradients are views of the buckets and count once.

Example:
    >>> sharding = Sharding(world_size=8)
    >>> sharding.shard_bytes(1000)
    125
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from chkpt_opt.errors import BudgetError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.sequence.gradients import PARAM_GRADS_HELD
from chkpt_opt.step_budget.budget import OptimizerSpec, StaticMemory, static_memory

STRATEGIES = ("fsdp2", "ddp")
"""The sharding strategies a per-rank budget is computed for."""

UNITS_ATTR = "sharding_unit_param_bytes"
"""Graph attribute where :func:`per_rank_graph` keeps the units' parameter bytes (root
first), read from the gradients it takes off the graph."""


@dataclass(frozen=True)
class Sharding:
    """How a training step is spread over ranks.

    Attributes:
        world_size: ranks the step runs on (each with its own local batch).
        strategy: ``"fsdp2"`` (``fully_shard``) or ``"ddp"``
            (``DistributedDataParallel``).
        reshard_after_forward: FSDP2's setting for the layer units (the root unit is
            never resharded after forward).
        master_element_bytes: bytes per element of the sharded parameters, their
            gradients and optimizer states, where they differ from the traced parameters'
            (4 for fp32 master weights traced in bf16); None: the traced dtype.
        gradient_as_bucket_view: DDP's setting of that name.
    """

    world_size: int
    strategy: str = "fsdp2"
    reshard_after_forward: bool = True
    master_element_bytes: int | None = None
    gradient_as_bucket_view: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise BudgetError(
                f"Sharding world_size {self.world_size!r} is not an int; give the number of "
                "ranks, e.g. Sharding(world_size=8)."
            )
        if self.world_size < 1:
            raise BudgetError(
                f"Sharding world_size {self.world_size} must be at least 1 (the number of "
                "ranks the step runs on)."
            )
        if self.strategy not in STRATEGIES:
            raise BudgetError(
                f"Sharding strategy {self.strategy!r} is unknown; use one of {STRATEGIES}."
            )
        if self.master_element_bytes is not None and self.master_element_bytes not in (1, 2, 4, 8):
            raise BudgetError(
                f"Sharding master_element_bytes {self.master_element_bytes!r} is not an element "
                "size; give 4 for fp32 master weights, 2 for bf16, or None for the traced dtype."
            )

    @property
    def shards_states(self) -> bool:
        """Whether parameters, gradients and optimizer states are split over the ranks."""
        return self.strategy == "fsdp2"

    def shard_bytes(self, traced_bytes: int, ratio: Fraction = Fraction(1)) -> int:
        """One rank's bytes of a state of ``traced_bytes`` (scaled by ``ratio``, the master
        to traced element size): split over the ranks under FSDP2, whole under DDP."""
        scaled = traced_bytes * ratio
        return math.ceil(scaled / self.world_size) if self.shards_states else math.ceil(scaled)


def sharding_meta(sharding: Sharding | None) -> dict[str, Any]:
    """What a schedule file records of ``sharding`` (nothing for one device)."""
    return {} if sharding is None else {"sharding": dataclasses.asdict(sharding)}


def sharding_from_meta(meta: dict[str, Any]) -> Sharding | None:
    """The sharding a schedule file records (:func:`sharding_meta`), or None.

    Raises:
        BudgetError: for a recorded sharding with unknown fields or bad values.
    """
    recorded = meta.get("sharding")
    if recorded is None:
        return None
    try:
        return Sharding(**recorded)
    except TypeError as err:
        raise BudgetError(
            f"the schedule file records sharding {recorded!r}, which is not a Sharding "
            f"({err}); write it again with this version of chkpt_opt."
        ) from None


def unit_param_bytes(graph: CostGraph) -> tuple[int, ...]:
    """The FSDP units' parameter bytes as traced: the root unit first, then one per
    repeated layer (a graph without repeated layers is one unit)."""
    if UNITS_ATTR in graph.graph:
        return tuple(int(b) for b in graph.graph[UNITS_ATTR])
    from chkpt_opt.export.layers import find_layers

    nodes = graph.nodes
    try:
        spans = find_layers(graph).spans
    except ValueError:
        spans = ()
    order = ordered_nodes(graph)
    layers = [sum(int(nodes[n]["param_grad_bytes"]) for n in order[a:b]) for a, b in spans]
    root = int(graph.graph["param_bytes"]) - sum(layers)
    return (max(root, 0), *layers)


def _master_ratio(graph_attrs: dict[str, Any], sharding: Sharding) -> Fraction:
    if sharding.master_element_bytes is None:
        return Fraction(1)
    elements = int(graph_attrs.get("param_elements", 0))
    if elements <= 0:
        raise BudgetError(
            "Sharding master_element_bytes needs the graph's parameter element count "
            "(graph attribute 'param_elements', written by the tracer); this graph has none. "
            "Trace the model again, or give master_element_bytes=None."
        )
    return Fraction(sharding.master_element_bytes * elements, int(graph_attrs["param_bytes"]))


def _padded_shard_bytes(
    shapes: list[list[Any]], world_size: int, ratio: Fraction, *, trainable: bool
) -> int:
    """One rank's bytes of FSDP2's padded shards of the parameters ``shapes`` lists
    (``[name, rows, elements, element_bytes, requires_grad]``), every one or the trainable."""
    total = 0
    for _, rows, elements, element_bytes, requires_grad in shapes:
        if trainable and not requires_grad:
            continue
        rows = max(int(rows), 1)
        total += math.ceil(rows / world_size) * (int(elements) // rows) * int(element_bytes)
    return math.ceil(total * ratio)


def _given(value: int | None, default: Any) -> int:
    return int(default) if value is None else value


def rank_static_memory(
    graph: CostGraph,
    sharding: Sharding,
    optimizer: OptimizerSpec | None,
    *,
    foreach: bool | None = None,
    trainable_param_bytes: int | None = None,
    n_trainable_tensors: int | None = None,
    largest_param_bytes: int | None = None,
) -> StaticMemory:
    """The resident memory of one rank's training step (the formulas of this module).

    ``trainable_param_bytes``, ``n_trainable_tensors`` and ``largest_param_bytes`` override
    the graph's (an optimizer instance that trains a subset); ``foreach`` as in
    :func:`chkpt_opt.step_budget.budget.graph_static_memory`.
    """
    g = graph.graph
    ratio = _master_ratio(g, sharding)
    trainable = _given(trainable_param_bytes, g["trainable_param_bytes"])
    largest = _given(largest_param_bytes, g.get("largest_param_bytes", 0))
    n_tensors = _given(n_trainable_tensors, g.get("n_trainable_tensors", 0))
    device = str(g.get("device_type", "cpu"))
    rank_trainable = sharding.shard_bytes(trainable, ratio)
    rank_params = sharding.shard_bytes(int(g["param_bytes"]), ratio)
    shapes = g.get("param_shapes")
    if sharding.shards_states and shapes is not None and trainable_param_bytes is None:
        # FSDP2 stores each shard padded to ceil(rows / world_size) rows.
        rank_trainable = _padded_shard_bytes(shapes, sharding.world_size, ratio, trainable=True)
        rank_params = _padded_shard_bytes(shapes, sharding.world_size, ratio, trainable=False)
    base = static_memory(
        param_bytes=rank_params,
        trainable_param_bytes=rank_trainable,
        buffer_bytes=int(g["buffer_bytes"]),
        input_bytes=int(g["input_bytes"]),
        n_trainable_tensors=n_tensors,
        largest_param_bytes=sharding.shard_bytes(largest, ratio) or None,
        optimizer=optimizer,
        foreach=device in ("cuda", "meta") if foreach is None else foreach,
    )
    if sharding.shards_states:
        from chkpt_opt.step_budget.fsdp2_timeline import buffers_peak_bytes, fsdp2_units

        units = fsdp2_units(
            graph, sharding.world_size, ratio, unpadded_bytes=unit_param_bytes(graph)
        )
        return dataclasses.replace(
            base,
            grad_bytes=rank_trainable,
            resident_grad_bytes=rank_trainable,
            communication_bytes=buffers_peak_bytes(
                graph, units, reshard=sharding.reshard_after_forward
            ),
            world_size=sharding.world_size,
            strategy="fsdp2",
        )
    buckets = rank_trainable
    held = sharding.gradient_as_bucket_view or bool(g.get(PARAM_GRADS_HELD))
    return dataclasses.replace(
        base,
        grad_bytes=rank_trainable,
        resident_grad_bytes=rank_trainable if held else 0,
        communication_bytes=0 if sharding.gradient_as_bucket_view else buckets,
        world_size=sharding.world_size,
        strategy="ddp",
    )


def per_rank_graph(graph: CostGraph, sharding: Sharding | None) -> CostGraph:
    """The cost graph a solver gets for one rank: ``graph`` itself on one device or under
    DDP with gradients of their own; else a copy without parameter gradients in time (FSDP2
    reduce-scatters each unit's and keeps the shard, DDP's bucket views live from
    construction), which :func:`rank_static_memory` counts resident instead. The copy keeps
    the node names and the fingerprint, so its schedules run on the model as traced."""
    if sharding is None or not (sharding.shards_states or sharding.gradient_as_bucket_view):
        return graph
    if UNITS_ATTR in graph.graph:
        return graph
    from chkpt_opt.step_budget.fsdp2_timeline import UNSHARDED_GRADS_ATTR

    units = unit_param_bytes(graph)
    copy = graph.copy()
    unsharded = {}
    for node, attrs in copy.nodes(data=True):
        if attrs["param_grad_bytes"]:
            unsharded[node] = int(attrs["param_grad_bytes"])
        attrs["param_grad_bytes"] = 0
    copy.graph[UNITS_ATTR] = list(units)
    copy.graph[UNSHARDED_GRADS_ATTR] = unsharded
    return copy


def predicted_rank_peak_bytes(
    graph: CostGraph, schedule: Any, sharding: Sharding, static: StaticMemory
) -> int:
    """One rank's predicted whole-step peak under ``schedule`` on the per-rank ``graph``:
    under FSDP2 the resident states plus the exact timeline of activations and FSDP2's
    buffers (:mod:`chkpt_opt.step_budget.fsdp2_timeline`), or the optimizer step where it is higher;
    under DDP the simulator's peak plus the resident memory (``static``, as
    :func:`rank_static_memory` gives it)."""
    from chkpt_opt.memory_model.simulate import simulate
    from chkpt_opt.step_budget.fsdp2_timeline import fsdp2_units, rank_timeline

    if not sharding.shards_states:
        return static.step_peak_bytes(simulate(graph, schedule).peak_bytes)
    ratio = _master_ratio(graph.graph, sharding)
    units = fsdp2_units(graph, sharding.world_size, ratio, unpadded_bytes=unit_param_bytes(graph))
    timeline = rank_timeline(graph, schedule, units, reshard=sharding.reshard_after_forward)
    states = static.resident_bytes - static.communication_bytes - static.resident_grad_bytes
    optimizer_phase = timeline.shard_grad_bytes + static.optimizer_step_extra_bytes
    return states + max(timeline.peak_bytes, optimizer_phase)


def sharding_of(model: Any) -> Sharding | None:
    """The sharding of a model already wrapped: ``DistributedDataParallel`` (its world size
    and ``gradient_as_bucket_view``) or FSDP2 (``fully_shard``: the world size of its mesh,
    the layers' ``reshard_after_forward``, the sharded parameters' element size where the
    mixed-precision policy computes in another dtype); None for a model that is neither."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        world = int(model.process_group.size()) if model.process_group is not None else 1
        return Sharding(
            world_size=world,
            strategy="ddp",
            gradient_as_bucket_view=bool(model.gradient_as_bucket_view),
        )
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return None
    reshard = True
    world = 1
    master: int | None = None
    for unit in units:
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            world = max(world, int(group.mesh_info.shard_mesh_size))
            if unit is not model and group.post_forward_mesh_info is None:
                reshard = False
            compute = group.mp_policy.param_dtype
            for fsdp_param in group.fsdp_params:
                sharded = fsdp_param.sharded_param
                if compute is not None and compute != sharded.dtype:
                    master = sharded.dtype.itemsize
    return Sharding(
        world_size=world,
        strategy="fsdp2",
        reshard_after_forward=reshard,
        master_element_bytes=master,
    )


def traced_module_and_sharding(
    model: Any, sharding: Sharding | None
) -> tuple[Any, Sharding | None]:
    """The module to trace and the sharding to plan for: a DDP wrapper's module with the
    sharding read off the wrapper (unless given); a model FSDP2 has already sharded is
    refused (its DTensor parameters cannot be captured).

    Raises:
        TraceError: for a model wrapped by ``fully_shard``.
    """
    import torch
    from torch.distributed.fsdp import FSDPModule

    from chkpt_opt.errors import TraceError

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module, sharding if sharding is not None else sharding_of(model)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        found = sharding_of(model)
        raise TraceError(
            f"{type(model).__name__} is already sharded by fully_shard ({found}); its DTensor "
            "parameters cannot be captured (torch.export: 'DTensor ... is not tracked with "
            "proxy'). Plan before fully_shard: chkpt_opt.optimize(model, budget=..., "
            f"sharding={found}, layerwise=True, example_kwargs=...) on the unwrapped model, "
            "then fully_shard it."
        )
    return model, sharding
