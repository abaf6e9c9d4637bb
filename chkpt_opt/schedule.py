"""Schedules: which forward ops are recomputed, grouped in recompute regions.

Round one is the *keep-set* schedule: a set of disjoint regions, each a run of consecutive
ops in execution order. An op outside every region keeps what its backward needs until that
backward runs. The ops of a region keep nothing during the forward pass; the region's
inputs are kept instead, and the region is recomputed once, just before the first backward
op that needs one of its saved tensors. This is exactly what non-reentrant
``torch.utils.checkpoint`` does around the region, which is how codegen runs it.

Example:
    >>> s = Schedule(regions=(("linear", "relu"),))
    >>> s.recomputed_nodes()
    frozenset({'linear', 'relu'})
    >>> Schedule.from_dict(s.to_dict()) == s
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chkpt_opt.errors import ScheduleError, short
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes

SCHEDULE_KIND = "keep_set"


@dataclass(frozen=True)
class Schedule:
    """A keep-set schedule.

    Attributes:
        regions: recompute regions, each a tuple of node names that are consecutive in the
            graph's execution order; regions are disjoint and sorted by position.
    """

    regions: tuple[tuple[str, ...], ...] = ()

    def recomputed_nodes(self) -> frozenset[str]:
        """All nodes that lie in some recompute region."""
        return frozenset(n for region in self.regions for n in region)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kind": SCHEDULE_KIND, "regions": [list(r) for r in self.regions]}

    @staticmethod
    def from_dict(data: Any) -> Schedule:
        """Inverse of :meth:`to_dict`, with clear errors for malformed data."""
        if not isinstance(data, dict) or data.get("kind") != SCHEDULE_KIND:
            raise ScheduleError(
                f'schedule data must be an object with "kind": "{SCHEDULE_KIND}", '
                f"got {str(data)[:80]!r}."
            )
        regions = data.get("regions")
        if not isinstance(regions, list) or not all(
            isinstance(r, list) and r and all(isinstance(n, str) for n in r) for r in regions
        ):
            raise ScheduleError(
                "schedule 'regions' must be a list of non-empty lists of node names."
            )
        return Schedule(regions=tuple(tuple(r) for r in regions))

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


def cut_positions(graph: CostGraph) -> list[bool]:
    """Where a region may begin or end: ``ok[p]`` for the boundary before index ``p``.

    ``ok[0]`` and ``ok[n]`` are always True; ``ok[p]`` is the ``cut_after_ok`` flag of the
    node at index ``p - 1``.
    """
    order = ordered_nodes(graph)
    return [True] + [graph.nodes[n]["cut_after_ok"] for n in order[:-1]] + [True]


def check_schedule(graph: CostGraph, schedule: Schedule) -> None:
    """Checks that ``schedule`` is a valid keep-set schedule of ``graph``.

    Raises:
        ScheduleError: naming the region and node at fault.
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(schedule).__name__}.")
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
