"""What FSDP2 allocates along one rank's training step, placed on the op sequence.

:func:`chkpt_opt.step_budget.sharding.rank_static_memory` counts FSDP2's buffers as one resident
upper bound, which is what the solvers subtract from the budget. This module predicts them
exactly, step by step, as ``fully_shard`` in torch 2.13 allocates them (read off
``torch/distributed/fsdp/_fully_shard/`` and measured on gloo, see ``docs/sharded.md``),
for the root unit (every parameter outside the repeated layers) and one unit per layer:

* forward: before a unit's first op its parameters are all-gathered into a flat buffer
  (``ag``), then copied out into one buffer per parameter (``un``, the unsharded
  parameters); the flat buffer of the previous unit is freed just before that copy-out,
  so the newest flat buffer lives until the next unit's copy-out (the last one until the
  forward returns). A layer's unsharded parameters are freed after its last op
  (``reshard_after_forward``); the root's stay until the end of the backward pass;
* backward: when the gradient of the loss appears, the last layer is all-gathered ahead
  (prefetch); when a layer's backward begins (its recomputation first, if checkpointed)
  it is copied out, the flat buffer freed, and the layer before it all-gathered ahead;
* after a layer's backward (its inputs' gradients computed) its unsharded parameters are
  freed, the previous unit's reduce-scatter input freed, its unsharded gradients copied
  into its own reduce-scatter input (``rs``, kept until the next unit's reduce-scatter)
  and freed, and its sharded gradients (``sg``) allocated for good. The root unit does
  the same once the whole backward pass has run, its gradients having lived till then.

Every buffer is padded: FSDP2 pads each parameter's first dimension to a multiple of the
world size (graph attribute ``param_shapes``, written by the tracer). Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.op_sequence import Step, lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import step_bytes

UNSHARDED_GRADS_ATTR = "sharding_unsharded_grad_bytes"
"""Graph attribute of the per-rank graph: the parameter gradient bytes each op's backward
creates at full size (``{node: bytes}``), which the per-rank graph itself does not place."""


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` unit as one rank sees it.

    Attributes:
        name: ``"root"`` or the layer's module path.
        span: ``[start, stop)`` op-index span of a layer; None for the root unit.
        gathered_bytes: its parameters unsharded (padded): the flat all-gather output, and
            again the per-parameter buffers they are copied out into.
        reduce_bytes: its unsharded gradients padded: the reduce-scatter input.
        shard_grad_bytes: one rank's sharded gradients (the reduce-scatter output).
        shard_param_bytes: one rank's sharded parameters (padded, as FSDP2 stores them).
    """

    name: str
    span: tuple[int, int] | None
    gathered_bytes: int
    reduce_bytes: int
    shard_grad_bytes: int
    shard_param_bytes: int


def _padded_elements(rows: int, elements: int, world: int) -> int:
    return math.ceil(rows / world) * world * (elements // max(rows, 1))


def fsdp2_units(
    graph: CostGraph,
    world_size: int,
    master_ratio: float = 1.0,
    unpadded_bytes: Sequence[int] = (),
) -> tuple[Unit, ...]:
    """The root unit, then one unit per repeated layer, with their padded bytes.

    ``master_ratio``: the sharded parameters' element size over the traced one (the
    gradients reduced into the sharded dtype). A graph traced before ``param_shapes`` was
    written counts no padding: its units' bytes are ``unpadded_bytes`` (root first).

    Raises:
        ValueError: a graph without ``param_shapes`` and no ``unpadded_bytes``.
    """
    from chkpt_opt.export.layers import find_layers

    try:
        layers = find_layers(graph)
        spans: tuple[tuple[int, int], ...] = layers.spans
    except ValueError:
        layers, spans = None, ()
    order = ordered_nodes(graph)
    names = [_layer_path(graph, order[a], layers.container) for a, _ in spans] if layers else []
    shapes = graph.graph.get("param_shapes")
    padded = [0] * (1 + len(spans))
    trainable = [0] * (1 + len(spans))  # frozen parameters are gathered, not reduced
    if shapes is None:
        if len(unpadded_bytes) != len(padded):
            raise ValueError(
                f"graph {graph.graph.get('name')!r} has no 'param_shapes' (traced before "
                f"they were recorded) and {len(unpadded_bytes)} unit sizes were given for "
                f"{len(padded)} units; pass unpadded_bytes=unit_param_bytes(graph), or trace "
                "the model again."
            )
        padded = list(unpadded_bytes)
        trainable = list(unpadded_bytes)
    else:
        for name, rows, elements, element_bytes, requires_grad in shapes:
            unit = next((i + 1 for i, n in enumerate(names) if name.startswith(n + ".")), 0)
            nbytes = _padded_elements(rows, elements, world_size) * element_bytes
            padded[unit] += nbytes
            trainable[unit] += nbytes if requires_grad else 0
    return tuple(
        Unit(
            name="root" if i == 0 else names[i - 1],
            span=None if i == 0 else spans[i - 1],
            gathered_bytes=padded[i],
            reduce_bytes=trainable[i],
            shard_grad_bytes=math.ceil(trainable[i] * master_ratio / world_size),
            shard_param_bytes=math.ceil(padded[i] * master_ratio / world_size),
        )
        for i in range(len(padded))
    )


def _layer_path(graph: CostGraph, node: str, container: str) -> str:
    path = graph.nodes[node]["module_path"]
    key = path[len(container) + 1 :].split(".", 1)[0]
    return f"{container}.{key}"


@dataclass(frozen=True)
class RankTimeline:
    """One rank's forward and backward passes under FSDP2, FSDP2's buffers included.

    Attributes:
        peak_bytes: the largest bytes alive above the resident states (parameter and
            optimizer-state shards, buffers, inputs).
        peak_step: the step where it is reached (``"fsdp"`` steps are FSDP2's hooks).
        shard_grad_bytes: the sharded gradients once the backward pass is done.
    """

    peak_bytes: int
    peak_step: Step
    shard_grad_bytes: int


class _Hooks:
    """The op sequence being built, with FSDP2's hooks as ``"fsdp"`` steps."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def add(self, name: str, alloc: dict[str, int] | None = None, free: Sequence[str] = ()) -> None:
        self.steps.append(Step("fsdp", name, tuple((alloc or {}).items()), tuple(free), 0))

    def post_backward(self, unit: Unit, key: str, grads: list[str], reduced: str) -> str:
        """One unit's post-backward: resharded, the previous reduce-scatter input freed,
        the unsharded gradients copied into this one's and freed, the sharded gradients
        allocated. Returns the reduce-scatter input now kept."""
        name = f"post_backward:{unit.name}"
        self.add(name, free=[f"un:{key}", *([reduced] if reduced else [])])
        self.add(name, {f"rs:{key}": unit.reduce_bytes}, free=grads)
        self.add(name, {f"sg:{key}": unit.shard_grad_bytes})
        return f"rs:{key}"


def fsdp2_steps(
    graph: CostGraph, schedule: Schedule, units: Sequence[Unit], *, reshard: bool = True
) -> list[Step]:
    """The op sequence of ``schedule`` on the per-rank ``graph`` (its unsharded parameter
    gradients restored from :data:`UNSHARDED_GRADS_ATTR`) with FSDP2's hooks inserted as
    ``"fsdp"`` steps (the module docstring). ``reshard``: the layers'
    ``reshard_after_forward``."""
    full = graph.copy()
    for node, nbytes in graph.graph.get(UNSHARDED_GRADS_ATTR, {}).items():
        full.nodes[node]["param_grad_bytes"] = int(nbytes)
    root, layers = units[0], list(units[1:])
    layer_of = {}
    for k, layer in enumerate(layers):
        layer_of.update(dict.fromkeys(range(*(layer.span or (0, 0))), k))
    index = {n: int(a["index"]) for n, a in full.nodes(data=True)}
    steps = lower(full, schedule)
    unit = [layer_of.get(index.get(s.node, -1), -1) for s in steps]  # -1: the root unit
    grads: dict[int, list[str]] = {}
    for step, k in zip(steps, unit, strict=True):
        grads.setdefault(k, []).extend(i for i, _ in step.alloc if i.startswith("p:"))
    last_backward = {k: p for p, (s, k) in enumerate(zip(steps, unit, strict=True))}
    hooks = _Hooks()
    hooks.add("pre_forward:root", {"ag:root": root.gathered_bytes})
    hooks.add("pre_forward:root", {"un:root": root.gathered_bytes})
    kept = "ag:root"  # the flat all-gather output FSDP2 keeps until the next copy-out
    reduced = ""  # the reduce-scatter input kept until the next unit's reduce-scatter
    started: set[int] = set()
    backward = False
    for position, (step, k) in enumerate(zip(steps, unit, strict=True)):
        layer = layers[k] if k >= 0 else None
        at = index.get(step.node, -1)
        span = layer.span if layer is not None and layer.span is not None else (-1, -1)
        if layer is not None and step.kind == "fwd" and at == span[0]:
            hooks.add(f"pre_forward:{layer.name}", {f"ag:{k}": layer.gathered_bytes})
            hooks.add(f"pre_forward:{layer.name}", free=[kept])
            hooks.add(f"pre_forward:{layer.name}", {f"un:{k}": layer.gathered_bytes})
            kept = f"ag:{k}"
        if step.kind == "bwd_start":
            hooks.add("post_forward:root", free=[kept])
            backward = True
        elif layer is not None and backward and k not in started:
            started.add(k)
            if reshard:
                hooks.add(f"pre_backward:{layer.name}", {f"un:{k}": layer.gathered_bytes})
                hooks.add(f"pre_backward:{layer.name}", free=[f"ag:{k}"])
                if k > 0:  # the layer before is all-gathered ahead
                    ahead = {f"ag:{k - 1}": layers[k - 1].gathered_bytes}
                    hooks.add(f"pre_backward:{layer.name}", ahead)
        if layer is not None and reshard and step.kind == "fwd" and at == span[1] - 1:
            step = dataclasses.replace(step, free=(*step.free, f"un:{k}"))
        hooks.steps.append(step)
        if step.kind == "bwd_start" and reshard and layers:
            last = len(layers) - 1  # prefetched when the loss's gradient appears
            hooks.add("pre_backward:root", {f"ag:{last}": layers[last].gathered_bytes})
        if layer is not None and backward and last_backward[k] == position:
            reduced = hooks.post_backward(layer, f"{k}", grads.get(k, []), reduced)
    reduced = hooks.post_backward(root, "root", grads.get(-1, []), reduced)
    hooks.add("post_backward:root", free=[reduced])
    return hooks.steps


def rank_timeline(
    graph: CostGraph, schedule: Schedule, units: Sequence[Unit], *, reshard: bool = True
) -> RankTimeline:
    """The peak of :func:`fsdp2_steps` above the resident states."""
    timeline = list(step_bytes(fsdp2_steps(graph, schedule, units, reshard=reshard)))
    peak_step, peak_bytes, _ = max(timeline, key=lambda point: point[1])
    return RankTimeline(peak_bytes, peak_step, sum(u.shard_grad_bytes for u in units))


BUFFER_PREFIXES = ("un:", "ag:", "rs:", "p:")
"""The instances of :func:`fsdp2_steps` that are FSDP2's (unsharded parameters, all-gather
and reduce-scatter buffers, unsharded gradients), the sharded gradients aside."""


def buffers_peak_bytes(graph: CostGraph, units: Sequence[Unit], *, reshard: bool = True) -> int:
    """The most bytes FSDP2's buffers and the unsharded gradients hold at once over the
    step, the sharded gradients aside. The same for every schedule (a recomputation adds
    none of them, and they come and go in the same order), so the budget split can take
    it off as resident: with the sharded gradients counted whole, an upper bound of
    FSDP2's part at every step."""
    live: dict[str, int] = {}
    peak = 0
    for step in fsdp2_steps(graph, Schedule(), units, reshard=reshard):
        live.update((i, b) for i, b in step.alloc if i.startswith(BUFFER_PREFIXES))
        peak = max(peak, sum(live.values()))
        for inst in step.free:
            live.pop(inst, None)
    return peak
