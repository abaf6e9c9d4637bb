"""What the recomputation of each region runs, and what regions cost beyond their ops.

The rules of the replay are those of :mod:`chkpt_opt.memory_model.op_sequence` (non-reentrant
checkpoint replays a region from its first op up to its last own saved tensor); this module computes
them per region for the op sequence and for the solvers' models alike.

A region also costs time its ops do not hold (the one place this is counted):

* every region: the graph's ``region_overhead_s`` (the checkpoint call, its saved-tensor
  hooks, the replay's setup);
* a region that caches ops runs its forward and its replay under a selective-checkpoint
  policy, a Python dispatch mode that sees every op: the graph's
  ``cached_region_overhead_s`` once, and ``cached_op_overhead_s`` for every op dispatched
  through it (:func:`policy_dispatches`). Both are measured by
  :mod:`chkpt_opt.measurement.region_costs` (``trace(..., profile_times=True)``);
* unpacked ops (recompute on unpack) run the forward from the first of them on under
  saved-tensor hooks, a Python call for every tensor saved there and again when the
  backward unpacks it: ``cached_op_overhead_s`` for each call (:func:`unpack_hooks_cost_s`;
  the same kind of cost, a Python callback per event, as the policy's per-op dispatch; not
  measured apart). Without that charge the cached-op search unpacked three ops of a
  padded BERT for 0.2% less predicted recomputation, far less than its hooks cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import (
    CostGraph,
    attributes_by_node,
    ordered_nodes,
    region_overhead_s,
    storage_owners,
)
from chkpt_opt.memory_model.schedule import RegionSpan, Schedule, innermost_regions, region_tree


def saves_own_storage(graph: CostGraph, node: str, owner: dict[str, str]) -> bool:
    """Whether the op keeps one of its own outputs or buffers (packed after it runs)."""
    return any(owner.get(sid) == node for sid in graph.nodes[node]["saved"])


def replayed_ops(graph: CostGraph, region: tuple[str, ...], owner: dict[str, str]) -> list[str]:
    """The ops that the recomputation of a keep-set region runs (the rules of
    :mod:`chkpt_opt.memory_model.op_sequence`)."""
    packers = [n for n in region if graph.nodes[n]["n_saved"] > 0]
    if not any(graph.nodes[n]["has_backward"] for n in packers):
        return []
    last = packers[-1]
    return list(region[: region.index(last) + (1 if saves_own_storage(graph, last, owner) else 0)])


@dataclass(frozen=True)
class Replay:
    """What the recomputation of one region does.

    Attributes:
        prefix: indices of the ops it reaches, in order (cached ops included).
        computed: those of them it runs (the others are the region's cached ops).
        trigger: the node before whose backward it runs, or "" if it never runs.
        last_event: index of its last own saved tensor (an own op, or the first op of an
            inner region whose inputs are packed there); inner regions starting at or
            before it have their inputs packed.
        holds: whether its checkpoint outlives the forward pass (some op inside saves a
            tensor). If not, nothing refers to the inputs it saved in its parent, and the
            parent's recomputation does not keep them.
    """

    prefix: tuple[int, ...]
    computed: tuple[int, ...]
    trigger: str
    last_event: int
    holds: bool


def region_replays(
    graph: CostGraph,
    order: list[str],
    tree: list[RegionSpan],
    inner: list[int],
    saved: frozenset[str],
    owner: dict[str, str],
) -> list[Replay]:
    nodes = attributes_by_node(graph)
    trigger_index: list[int] = [-1] * len(tree)
    stops: list[int] = [0] * len(tree)
    last_events: list[int] = [-1] * len(tree)
    holds: list[bool] = [False] * len(tree)
    for k in reversed(range(len(tree))):  # inner regions come after their parents
        span = tree[k]
        # Holder events: (index, own op or -1 for an inner region's inputs).
        events: list[tuple[int, int]] = [(tree[c].start, -1) for c in span.children]
        events += [
            (i, i)
            for i in range(span.start, span.stop)
            if inner[i] == k and nodes[order[i]]["n_saved"] > 0
        ]
        events.sort()
        stop = span.start
        if events:
            i, op = events[-1]
            last_events[k] = i
            stop = i + 1 if op >= 0 and saves_own_storage(graph, order[op], owner) else i
        stops[k] = stop
        holds[k] = any(op >= 0 for _, op in events) or any(holds[c] for c in span.children)
        triggers = [i for i, op in events if op >= 0 and nodes[order[op]]["has_backward"]]
        triggers += [trigger_index[c] for c in span.children if trigger_index[c] >= 0]
        trigger_index[k] = max(triggers, default=-1)
    result = []
    for k, span in enumerate(tree):
        prefix = tuple(range(span.start, stops[k])) if trigger_index[k] >= 0 else ()
        computed = tuple(i for i in prefix if not (inner[i] == k and order[i] in saved))
        trigger = order[trigger_index[k]] if trigger_index[k] >= 0 else ""
        result.append(Replay(prefix, computed, trigger, last_events[k], holds[k]))
    return result


def policy_dispatches(graph: CostGraph, schedule: Schedule) -> list[int]:
    """For each region that caches an op of its own (in :func:`region_tree`'s order), the
    ops its selective-checkpoint policy dispatches: those of its span in the forward pass
    and those its recomputation reaches (cached ones included, which it serves from the
    cache). Replays of the region inside an outer region's replay are not counted."""
    if not schedule.saved:
        return []
    order = ordered_nodes(graph)
    tree = region_tree(graph, schedule)
    inner = innermost_regions(tree, len(order))
    replays = region_replays(graph, order, tree, inner, schedule.saved, storage_owners(graph))
    return [
        (span.stop - span.start) + len(replays[k].prefix)
        for k, span in enumerate(tree)
        if any(inner[i] == k and order[i] in schedule.saved for i in range(span.start, span.stop))
    ]


def policy_cost_s(graph: CostGraph, dispatches: int) -> float:
    """Seconds a selective-checkpoint policy adds to a step in a region that dispatches
    ``dispatches`` ops through it (see the module docstring)."""
    per_region = float(graph.graph.get("cached_region_overhead_s", 0.0))
    per_op = float(graph.graph.get("cached_op_overhead_s", 0.0))
    return per_region + per_op * dispatches


def unpack_hooks_cost_s(graph: CostGraph, schedule: Schedule) -> float:
    """Seconds the saved-tensor hooks of ``schedule``'s unpacked ops add to a step (see the
    module docstring): two calls for every tensor that an op outside every region, from the
    first unpacked op on, saves."""
    per_call = float(graph.graph.get("cached_op_overhead_s", 0.0))
    if schedule.staged and per_call:  # the whole forward runs under the staged hooks
        return 2 * per_call * sum(len(a["saved"]) for _, a in graph.nodes(data=True))
    if not schedule.unpacked or per_call == 0.0:
        return 0.0
    order = ordered_nodes(graph)
    first = min(graph.nodes[n]["index"] for n in schedule.unpacked)
    in_regions = {n for region in schedule.regions for n in region}
    packs = sum(
        len(graph.nodes[n]["saved"])
        for n in order
        if graph.nodes[n]["index"] >= first and n not in in_regions
    )
    return 2 * per_call * packs


def schedule_overhead_s(graph: CostGraph, schedule: Schedule) -> float:
    """Seconds the regions and the unpacked ops of ``schedule`` add to a step beyond the
    ops they recompute."""
    regions = len(schedule.regions) + len(schedule.nested)
    policies = sum(policy_cost_s(graph, d) for d in policy_dispatches(graph, schedule))
    return region_overhead_s(graph) * regions + policies + unpack_hooks_cost_s(graph, schedule)
