"""Schedules: which forward ops are recomputed, grouped in recompute regions.

The *keep-set* schedule is a set of disjoint regions, each a run of consecutive ops in
execution order. An op outside every region keeps what its backward needs until that
backward runs. The ops of a region keep nothing during the forward pass; the region's
inputs are kept instead, and the region is recomputed once, just before the first backward
op that needs one of its saved tensors. This is exactly what non-reentrant
``torch.utils.checkpoint`` does around the region, which is how codegen runs it.

The general schedule adds what PyTorch executes beyond that:

* ``nested`` regions: runs of ops inside a region (to any depth), each a non-reentrant
  checkpoint inside its parent's. An inner region's inputs count as saved by its parent
  (they are recomputed with it), and the parent's recomputation runs inner regions as
  checkpoints again; this is how multi-level schedules (Revolve, rotor) run.
* ``saved`` ops: ops inside a region whose outputs are cached in the forward pass (a
  selective-checkpoint policy's ``MUST_SAVE``) and not recomputed; their saved inputs are
  still recomputed, so a cheap producer can be recomputed from a kept tensor without its
  expensive consumer.
* ``unpacked`` ops: ops outside every region whose outputs are rebuilt on unpack. Where an
  op outside every region saves one of their outputs, a saved-tensor hook stores a recipe
  (the op and its inputs) instead, and the output is recomputed when a backward unpacks
  it (:mod:`chkpt_opt.memory_model.unpack`); a cheap layer's output is then freed after its last
  forward reader and rebuilt from tensors kept anyway.

A keep-set schedule is the special case with none of them. A *staged* schedule is another
form (:mod:`chkpt_opt.memory_model.staged`): no regions, and for each backward op the forward ops
recomputed just before it, each value kept from where it is computed to its last use
(general rematerialization, as Checkmate's program states it, without recomputation in the
forward pass).

Example:
    >>> s = Schedule(regions=(("linear", "relu"),))
    >>> s.recomputed_nodes()
    frozenset({'linear', 'relu'})
    >>> Schedule.from_dict(s.to_dict()) == s
    True
    >>> g = Schedule(regions=(("a", "b", "c"),), nested=(("b", "c"),), saved=frozenset({"c"}))
    >>> g.is_keep_set(), sorted(g.recomputed_nodes())
    (False, ['a', 'b'])
    >>> Schedule(unpacked=frozenset({"pool"})).is_keep_set()
    False
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chkpt_opt.errors import ScheduleError, short
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.graphs.frozen import graph_fact
from chkpt_opt.memory_model.staged.rule import check_staged, staged_from_json
from chkpt_opt.memory_model.unpack import check_unpacked
from chkpt_opt.memory_model.unpack.rule import self_contained_ops

SCHEDULE_KIND = "keep_set"
GENERAL_KIND = "regions"
STAGED_KIND = "staged"


@dataclass(frozen=True)
class Schedule:
    """A schedule: recompute regions, nested regions inside them, and cached ops.

    Attributes:
        regions: the outermost recompute regions, each a tuple of node names that are
            consecutive in the graph's execution order; disjoint and sorted by position.
        nested: regions inside other regions (any depth), each a run of consecutive ops
            strictly inside a region of ``regions`` or ``nested``; two of them are disjoint
            or one lies inside the other. Sorted by position, outer before inner.
        saved: ops inside regions whose outputs are cached in the forward pass instead of
            recomputed, by the innermost region that holds them.
        unpacked: ops outside every region whose outputs, where ops outside every region
            save them, are rebuilt when a backward unpacks them (recompute on unpack).
        staged: a staged schedule (then every other field is empty): ``(backward op, forward
            ops)`` pairs, the forward ops (in execution order) recomputed just before the
            backward of that op, in the order the backward pass runs
            (:mod:`chkpt_opt.memory_model.staged`).
    """

    regions: tuple[tuple[str, ...], ...] = ()
    nested: tuple[tuple[str, ...], ...] = ()
    saved: frozenset[str] = frozenset()
    unpacked: frozenset[str] = frozenset()
    staged: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def is_keep_set(self) -> bool:
        """Whether this is a keep-set schedule (no nested region, no cached or unpacked op,
        not staged)."""
        return not self.nested and not self.saved and not self.unpacked and not self.staged

    def with_unpacked(self, unpacked: frozenset[str]) -> Schedule:
        """This schedule with ``unpacked`` as its unpacked ops."""
        return Schedule(self.regions, self.nested, self.saved, frozenset(unpacked))

    def recomputed_nodes(self) -> frozenset[str]:
        """All nodes that lie in some recompute region and are not cached (of a staged
        schedule: those recomputed at some stage)."""
        staged = frozenset(n for _, ops in self.staged for n in ops)
        return frozenset(n for region in self.regions for n in region) - self.saved | staged

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (a keep-set schedule keeps the round-one form)."""
        regions = [list(r) for r in self.regions]
        if self.staged:
            return {"kind": STAGED_KIND, "recompute": [[b, list(ops)] for b, ops in self.staged]}
        if self.is_keep_set():
            return {"kind": SCHEDULE_KIND, "regions": regions}
        data: dict[str, Any] = {
            "kind": GENERAL_KIND,
            "regions": regions,
            "nested": [list(r) for r in self.nested],
            "saved": sorted(self.saved),
        }
        if self.unpacked:  # files without unpacked ops stay as older versions wrote them
            data["unpacked"] = sorted(self.unpacked)
        return data

    @staticmethod
    def from_dict(data: Any) -> Schedule:
        """Inverse of :meth:`to_dict`, with clear errors for malformed data."""
        kinds = (SCHEDULE_KIND, GENERAL_KIND, STAGED_KIND)
        if not isinstance(data, dict) or data.get("kind") not in kinds:
            raise ScheduleError(
                f'schedule data must be an object with "kind" one of {list(kinds)}, '
                f"got {str(data)[:80]!r}."
            )
        if data["kind"] == STAGED_KIND:
            return Schedule(staged=staged_from_json(data))
        general = data["kind"] == GENERAL_KIND
        allowed = (
            {"kind", "regions", "nested", "saved", "unpacked"} if general else {"kind", "regions"}
        )
        if set(data) - allowed:
            raise ScheduleError(
                f"schedule of kind {data['kind']!r} has unknown keys "
                f"{sorted(set(data) - allowed)}; allowed: {sorted(allowed)}."
            )
        runs: dict[str, tuple[tuple[str, ...], ...]] = {}
        for key in ("regions", "nested") if general else ("regions",):
            value = data.get(key, [] if key == "nested" else None)
            if not isinstance(value, list) or not all(
                isinstance(r, list) and r and all(isinstance(n, str) for n in r) for r in value
            ):
                raise ScheduleError(
                    f"schedule {key!r} must be a list of non-empty lists of node names."
                )
            runs[key] = tuple(tuple(r) for r in value)
        saved = data.get("saved", []) if general else []
        unpacked = data.get("unpacked", []) if general else []
        for key, names in (("saved", saved), ("unpacked", unpacked)):
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ScheduleError(f"schedule {key!r} must be a list of node names.")
        return Schedule(
            regions=runs["regions"],
            nested=runs.get("nested", ()),
            saved=frozenset(saved),
            unpacked=frozenset(unpacked),
        )

    @staticmethod
    def from_spans(graph: CostGraph, spans: Sequence[tuple[int, int]]) -> Schedule:
        """Builds a schedule from ``[start, stop)`` index spans of the execution order.

        Empty spans are dropped; the spans are sorted.
        """
        order = ordered_nodes(graph)
        regions = tuple(tuple(order[start:stop]) for start, stop in sorted(spans) if stop > start)
        return Schedule(regions=regions)

    def spans(self, graph: CostGraph) -> list[tuple[int, int]]:
        """The ``[start, stop)`` index span of every region."""
        return [(graph.nodes[r[0]]["index"], graph.nodes[r[-1]]["index"] + 1) for r in self.regions]


@graph_fact
def cut_positions(graph: CostGraph) -> list[bool]:
    """Where a region may begin or end: ``ok[p]`` for the boundary before index ``p``.

    ``ok[0]`` and ``ok[n]`` are always True; ``ok[p]`` is the ``cut_after_ok`` flag of the
    node at index ``p - 1``.
    """
    order = ordered_nodes(graph)
    return [True] + [graph.nodes[n]["cut_after_ok"] for n in order[:-1]] + [True]


def check_schedule(graph: CostGraph, schedule: Schedule) -> None:
    """Checks that ``schedule`` is a valid schedule of ``graph`` (regions, nested regions,
    cached and unpacked ops).

    Raises:
        ScheduleError: naming the region and node at fault.
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(schedule).__name__}.")
    if schedule.staged:
        if schedule.regions or schedule.nested or schedule.saved or schedule.unpacked:
            raise ScheduleError(
                "a staged schedule has no regions, cached or unpacked ops; give either "
                "'staged' or the others."
            )
        check_staged(graph, schedule.staged)
        return
    ok = cut_positions(graph)
    last_stop = 0
    for k, region in enumerate(schedule.regions):
        if not region:
            raise ScheduleError(f"region {k} is empty.")
        for name in region:
            if name not in graph:
                raise ScheduleError(
                    f"region {k} names node {short(name)}, which is not in graph "
                    f"{graph.graph.get('name', '')!r}; was the schedule made for another model?"
                )
        start = graph.nodes[region[0]]["index"]
        for offset, name in enumerate(region):
            if graph.nodes[name]["index"] != start + offset:
                raise ScheduleError(
                    f"region {k} is not a run of consecutive ops: {short(name)} is out of place."
                )
        stop = start + len(region)
        if start < last_stop:
            raise ScheduleError(f"region {k} overlaps or precedes the region before it.")
        for position in (start, stop):
            if not ok[position]:
                raise ScheduleError(
                    f"region {k} ({region[0]!r}..{region[-1]!r}) has a boundary at position "
                    f"{position}, inside a span that cannot be split (a tuple and its items, "
                    "an in-place op and the tensor it writes, or a no-grad span)."
                )
        last_stop = stop
    tree = region_tree(graph, schedule)
    order = ordered_nodes(graph)
    inner = innermost_regions(tree, len(order))
    stray = [n for n in schedule.saved if n not in {m for r in schedule.regions for m in r}]
    if stray:
        raise ScheduleError(
            f"saved op {short(sorted(stray)[0])} lies in no recompute region: only ops "
            "inside a region can be cached (an op outside every region keeps its saved "
            "tensors anyway). Drop it from 'saved' or put it in a region."
        )
    allowed = cacheable_ops(graph) if schedule.saved else frozenset()
    for name in sorted(schedule.saved, key=lambda n: graph.nodes[n]["index"]):
        if name not in allowed:
            raise ScheduleError(
                f"saved op {short(name)} writes a tensor in place, or a later op writes its "
                "output in place; a selective-checkpoint policy cannot cache it. Drop it "
                "from 'saved'."
            )
        span = tree[inner[graph.nodes[name]["index"]]]
        writer = next((n for n in order[span.start : span.stop] if _writes_state(graph, n)), "")
        if writer:
            raise ScheduleError(
                f"saved op {short(name)} lies in a region that also updates module state in "
                f"place ({short(writer)}); the policy would cache the wrong ops when that "
                "update is skipped on recompute. Cache no op in that region."
            )
    if schedule.unpacked:
        check_unpacked(graph, schedule.unpacked, inner)


def cacheable_ops(graph: CostGraph) -> frozenset[str]:
    """The ops whose outputs a region may cache: ops that own all the storages they return
    (a view or an in-place op would make the cache hold another op's storage, which
    costs memory and saves no compute), and whose outputs no op writes in place later
    (the cache would hold a changed tensor). Random ops are left out: dropout draws its
    mask into a buffer in place, which a cache of all its kernels' outputs cannot hold."""
    return self_contained_ops(graph)


def cache_candidates(graph: CostGraph, schedule: Schedule) -> list[str]:
    """The ops of ``schedule``'s regions that their innermost region may cache (see
    :func:`cacheable_ops` and :func:`caching_allowed`), in execution order."""
    order = ordered_nodes(graph)
    tree = region_tree(graph, schedule)
    inner = innermost_regions(tree, len(order))
    allowed = cacheable_ops(graph)
    spans_ok = [caching_allowed(graph, r.start, r.stop) for r in tree]
    return [
        order[i]
        for i in range(len(order))
        if inner[i] >= 0 and order[i] in allowed and spans_ok[inner[i]]
    ]


def _writes_state(graph: CostGraph, node: str) -> bool:
    attrs = graph.nodes[node]
    return bool(attrs["is_inplace"] and attrs["is_stateful"])


def caching_allowed(graph: CostGraph, start: int, stop: int) -> bool:
    """Whether a region over ops ``[start, stop)`` may cache ops (no in-place state update
    inside it)."""
    order = ordered_nodes(graph)
    return not any(_writes_state(graph, n) for n in order[start:stop])


def nesting_allowed(graph: CostGraph) -> bool:
    """Whether solvers may nest regions in ``graph``: not where some op writes module state
    or a model input in place (``num_batches_tracked += 1``, ``y.mul_(2)``).

    Codegen runs such nesting with the right values: an outer region snapshots the state
    its inner regions read or write in place and replays the writes into private copies
    while it is recomputed. But those copies, one per level, are not in the op sequence,
    so a nested plan at a tight budget would measure above its prediction (by a few bytes
    of counters on batch-norm nets, by whole copies of an input written in place).
    """
    return not any(_writes_state(graph, n) for n in graph.nodes)


@dataclass(frozen=True)
class RegionSpan:
    """One region of a schedule, placed in the region tree.

    Attributes:
        start: index of its first op in the execution order.
        stop: one past the index of its last op.
        parent: position of the enclosing region in the tree list, or -1 at the top.
        depth: 0 for the outermost regions.
        children: positions of the regions directly inside it, in order.
    """

    start: int
    stop: int
    parent: int
    depth: int
    children: tuple[int, ...]


def region_tree(graph: CostGraph, schedule: Schedule) -> list[RegionSpan]:
    """All regions of ``schedule`` (outermost and nested), sorted by position, outer first.

    Raises:
        ScheduleError: a nested region that is not a run of consecutive ops, has a boundary
            where no cut is allowed, lies in no region, is not strictly inside its parent,
            or overlaps another region partly.
    """
    ok = cut_positions(graph)
    spans: list[tuple[int, int]] = []
    for k, region in enumerate(schedule.nested):
        if not region or any(n not in graph for n in region):
            missing = next((n for n in region if n not in graph), None)
            raise ScheduleError(
                f"nested region {k} is empty or names {short(missing)}, which is not in the "
                "graph; was the schedule made for another model?"
            )
        start = graph.nodes[region[0]]["index"]
        if any(graph.nodes[n]["index"] != start + j for j, n in enumerate(region)):
            raise ScheduleError(f"nested region {k} is not a run of consecutive ops.")
        stop = start + len(region)
        if not (ok[start] and ok[stop]):
            raise ScheduleError(
                f"nested region {k} ({region[0]!r}..{region[-1]!r}) has a boundary inside a "
                "span that cannot be split."
            )
        spans.append((start, stop))
    top = [(i, i + len(r)) for r in schedule.regions for i in [graph.nodes[r[0]]["index"]]]
    ordered = sorted(set(top) | set(spans), key=lambda sp: (sp[0], -sp[1]))
    if len(ordered) != len(top) + len(spans):
        raise ScheduleError("a nested region repeats another region exactly; drop the copy.")
    tree: list[RegionSpan] = []
    children: list[list[int]] = []
    stack: list[int] = []
    top_set = set(top)
    for start, stop in ordered:
        while stack and tree[stack[-1]].stop <= start:
            stack.pop()
        parent = stack[-1] if stack else -1
        if parent >= 0 and stop > tree[parent].stop:
            raise ScheduleError(
                f"the nested region at ops {start}..{stop - 1} overlaps the region at ops "
                f"{tree[parent].start}..{tree[parent].stop - 1} partly; regions must be "
                "disjoint or one inside the other."
            )
        if ((start, stop) in top_set) != (parent < 0):
            raise ScheduleError(
                f"the region at ops {start}..{stop - 1} is listed as "
                f"{'outermost' if parent >= 0 else 'nested'} but lies "
                f"{'inside another region' if parent >= 0 else 'in no region'}."
            )
        depth = tree[parent].depth + 1 if parent >= 0 else 0
        tree.append(RegionSpan(start, stop, parent, depth, ()))
        children.append([])
        if parent >= 0:
            children[parent].append(len(tree) - 1)
        stack.append(len(tree) - 1)
    return [
        RegionSpan(r.start, r.stop, r.parent, r.depth, tuple(children[i]))
        for i, r in enumerate(tree)
    ]


def innermost_regions(tree: list[RegionSpan], n_nodes: int) -> list[int]:
    """For every op index, the position in ``tree`` of the innermost region holding it
    (-1 for ops outside every region)."""
    inner = [-1] * n_nodes
    for k, span in enumerate(tree):  # outer regions come first, inner ones overwrite
        for i in range(span.start, span.stop):
            inner[i] = k
    return inner
