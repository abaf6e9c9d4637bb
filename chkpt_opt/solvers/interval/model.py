"""The interval model: what an integer program needs to know about a graph's keep-set schedules.

A keep-set schedule is a set of disjoint recompute regions, each an interval ``[a, b)`` of the
execution order whose ends are allowed cut positions. This module precomputes, from the graph
alone and following the rules of :mod:`chkpt_opt.memory_model.op_sequence` exactly, everything the
memory and compute of such a schedule depend on, so that a schedule becomes a choice of intervals
and its memory a linear function of that choice:

* **slots**: a fixed timeline shared by every schedule: the forward steps, ``bwd_start``, then
  for each backward op (reverse order) a ``recompute`` slot (only for ops that can trigger a
  replay), its ``bwd`` slot and its ``accumulate`` slot (where it has one). Every step of a
  lowered schedule maps to one slot; the recompute steps of a replay map to the recompute slot
  of the trigger, whose bytes are the peak over those steps.
* **intervals**: every candidate region with its recompute cost (the forward time of the ops
  its replay runs, :func:`chkpt_opt.memory_model.region_replay.replayed_ops`: from its start up to
  its last op with ``n_saved > 0``, that op included only if it saves one of its own storages; a
  region is replayed only if it has a trigger, an op with ``n_saved > 0`` and a backward), the slot
  of its replay, the peak bytes of that replay, the recomputed storages it holds after the
  replay, and its *release*: the slot until which it keeps its inputs (the latest
  ``kept_until`` of its packers; its last forward op when it has none).
* **lifetimes**: every forward storage whose end depends on the schedule. It lives from its
  allocation to at least its ``fixed_end`` (last forward reader, or the end for step outputs),
  and longer when a *holder* holds it: a saver outside every region until its backward; a
  saver or reader inside a region that does not contain the storage's owner until the
  region's release. The possible ends form a short sorted list ``ends``.
* **base bytes**: what does not depend on the schedule: gradients and parameter gradients
  (taken from the op sequence of the keep-all schedule, which places them identically for every
  schedule), transients of forward, backward and accumulate steps, and the fixed part of every
  forward storage's life.

The memory at slot ``s`` under a choice of intervals is then::

    base[s] + sum over lifetimes alive past fixed_end at s of size
            + sum over chosen intervals of replay_peak (at the replay slot)
              and held_after_replay bytes (after it)

:meth:`IntervalModel.slot_bytes` evaluates it; the integer programs state it as constraints.
:func:`chkpt_opt.solvers.interval.builder.build_interval_model` builds the model.
:func:`simulator_slot_bytes` maps a simulated timeline onto the slots, so the two can be
compared (the tests do, on many random schedules).

On large graphs the candidate intervals can be restricted to boundaries in a subset of the
cut positions (``positions``), or kept inside segments (``segments``, for the hierarchical
solver); the model is then exact for the schedules whose regions obey the restriction, and
``complete`` is False.

Intervals can also be left out by cost (``max_cost_s``): every interval whose recompute time
alone exceeds it. This is exact for every schedule costing at most ``max_cost_s`` (each of
its regions costs no more than the whole), so with ``max_cost_s`` at least the cost of a
known schedule that fits the budget, the optimum is still in the model (see
:mod:`chkpt_opt.solvers.keepset.pruned`). A region's cost only grows when its end moves right, so
the builder stops extending a start at the first interval over the cap and never builds the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from chkpt_opt.errors import ScheduleError, SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile


@dataclass(frozen=True)
class Interval:
    """A candidate recompute region ``[start, stop)`` and what choosing it costs.

    Attributes:
        start: index of its first op.
        stop: one past the index of its last op.
        cost_s: recompute time (0 when it has no trigger and is never replayed).
        replay_slot: slot of its replay, or None when it is never replayed.
        release_slot: last slot at which the region still holds its inputs.
        replay_peak_bytes: peak of the replay's own storages and transients over its steps.
        held_after_replay: ``(last slot, bytes)`` of recomputed storages that outlive the
            replay; they are alive from ``replay_slot + 1`` to ``last slot``.
        cached: indices of the ops the region caches (a selective-checkpoint ``MUST_SAVE``);
            empty for a keep-set region. A model built with cache columns
            (:mod:`chkpt_opt.solvers.interval.cache_columns`) has several intervals per span.
    """

    start: int
    stop: int
    cost_s: float
    replay_slot: int | None
    release_slot: int
    replay_peak_bytes: int
    held_after_replay: tuple[tuple[int, int], ...]
    cached: tuple[int, ...] = ()


@dataclass(frozen=True)
class Holder:
    """One op that may extend the life of a forward storage.

    Attributes:
        node: index of the op.
        outside_end: last slot the op holds the storage when it lies outside every region (it
            saves it), or None when it then holds it no longer than its forward step.
        region_ends: ``(interval id, last slot)`` for every candidate interval that contains the
            op but not the storage's owner: the region holds the storage until its release;
            or, for the owner of a storage a cache column caches, that column and the last
            slot its cache (or the savers of its recomputation) hold the storage.
    """

    node: int
    outside_end: int | None
    region_ends: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Lifetime:
    """A forward storage whose last slot depends on the schedule.

    Attributes:
        storage: the storage id.
        size_bytes: its bytes.
        alloc_slot: slot of the forward step that allocates it.
        fixed_end: last slot it is alive under every schedule.
        ends: the possible later last slots, sorted; each > ``fixed_end``.
        holders: the ops whose place in the schedule decides how long it lives.
    """

    storage: str
    size_bytes: int
    alloc_slot: int
    fixed_end: int
    ends: tuple[int, ...]
    holders: tuple[Holder, ...]

    def end_under(self, containing: dict[int, int]) -> int:
        """Last slot alive when op ``i`` lies in chosen interval ``containing[i]`` (ops not
        in the mapping lie in no region)."""
        end = self.fixed_end
        for holder in self.holders:
            k = containing.get(holder.node)
            if k is None:
                if holder.outside_end is not None:
                    end = max(end, holder.outside_end)
                continue
            for kk, region_end in holder.region_ends:
                if kk == k:
                    end = max(end, region_end)
                    break
        return end


@dataclass(frozen=True)
class IntervalModel:
    """The precomputed interval model of one graph (see the module docstring).

    Attributes:
        n_ops: number of ops.
        nodes: node names in execution order.
        positions: the cut positions candidate intervals start and stop at (sorted, 0 and
            ``n_ops`` included).
        slots: ``(kind, node)`` of every slot.
        end_slot: ``len(slots)``: a storage held "to the end" has this last slot.
        intervals: the candidate intervals, sorted by ``(start, stop)``.
        lifetimes: forward storages with schedule-dependent ends.
        base_bytes: schedule-independent bytes at every slot.
        complete: whether ``positions`` holds every allowed cut position and no segment
            bound restricts the intervals (then the model is exact for the whole schedule
            model).
        total_fwd_s: forward time of all ops (no schedule recomputes more).
        max_cost_s: intervals whose recompute time exceeds this were left out (None: none
            were); the model is then exact only for schedules costing at most this.
        cache: the cache columns it holds (:mod:`chkpt_opt.solvers.interval.cache_columns`):
            ``"none"`` (keep-set regions only), ``"ranked"`` or ``"subsets"``.
    """

    n_ops: int
    nodes: tuple[str, ...]
    positions: tuple[int, ...]
    slots: tuple[tuple[str, str], ...]
    end_slot: int
    intervals: tuple[Interval, ...]
    lifetimes: tuple[Lifetime, ...]
    base_bytes: tuple[int, ...]
    complete: bool
    total_fwd_s: float
    max_cost_s: float | None = None
    cache: str = "none"

    @property
    def n_slots(self) -> int:
        """Number of slots."""
        return len(self.slots)

    def interval_ids(self, spans: Iterable[tuple[int, int]]) -> list[int]:
        """Ids of the candidate intervals with the given ``[start, stop)`` spans (the column
        that caches nothing, where a span has several).

        Raises:
            ScheduleError: for a span that is not a candidate interval of this model.
        """
        index = {(iv.start, iv.stop): k for k, iv in enumerate(self.intervals) if not iv.cached}
        ids = []
        for span in spans:
            if span not in index:
                raise ScheduleError(
                    f"region span {span} is not a candidate interval of the model (its ends "
                    f"must lie in the model's cut positions {list(self.positions)[:12]}...); "
                    "build the model with positions=None to allow every valid cut."
                )
            ids.append(index[span])
        return ids

    def schedule(self, graph: CostGraph, chosen: Iterable[int]) -> Schedule:
        """The schedule whose regions are the chosen intervals, with the ops they cache."""
        chosen = list(chosen)
        spans = sorted((self.intervals[k].start, self.intervals[k].stop) for k in chosen)
        cached = frozenset(self.nodes[i] for k in chosen for i in self.intervals[k].cached)
        schedule = Schedule.from_spans(graph, spans)
        return dataclasses.replace(schedule, saved=cached) if cached else schedule

    def cost_s(self, chosen: Iterable[int]) -> float:
        """Recompute time of the chosen intervals."""
        return sum(self.intervals[k].cost_s for k in chosen)

    def containing(self, chosen: Iterable[int]) -> dict[int, int]:
        """Op index -> the chosen interval that contains it."""
        mapping: dict[int, int] = {}
        for k in chosen:
            iv = self.intervals[k]
            for i in range(iv.start, iv.stop):
                mapping[i] = k
        return mapping

    def lifetime_ends(self, chosen: Iterable[int]) -> list[int]:
        """The last slot of every lifetime under the chosen intervals."""
        containing = self.containing(chosen)
        return [life.end_under(containing) for life in self.lifetimes]

    def slot_bytes(self, chosen: Iterable[int]) -> list[int]:
        """Bytes alive at every slot under the chosen intervals (exact, no relaxation)."""
        chosen = list(chosen)
        total = list(self.base_bytes)
        for life, end in zip(self.lifetimes, self.lifetime_ends(chosen)):
            for s in range(life.fixed_end + 1, min(end, self.end_slot - 1) + 1):
                total[s] += life.size_bytes
        for k in chosen:
            iv = self.intervals[k]
            if iv.replay_slot is None:
                continue
            total[iv.replay_slot] += iv.replay_peak_bytes
            for last, nbytes in iv.held_after_replay:
                for s in range(iv.replay_slot + 1, min(last, self.end_slot - 1) + 1):
                    total[s] += nbytes
        return total

    def peak_bytes(self, chosen: Iterable[int]) -> int:
        """Peak of :meth:`slot_bytes`."""
        return max(self.slot_bytes(chosen), default=0)


def simulator_slot_bytes(model: IntervalModel, profile: MemoryProfile) -> list[int | None]:
    """Maps a simulated timeline onto the model's slots: the largest ``during_bytes`` of the
    steps of each slot, None for a slot no step maps to (a recompute slot with no replay).

    Raises:
        SolverError: if the timeline does not fit the slots (a model bug).
    """
    index = {key: s for s, key in enumerate(model.slots)}
    result: list[int | None] = [None] * model.n_slots
    pending: list[int] = []
    for point in profile.timeline:
        if point.kind == "recompute":
            pending.append(point.during_bytes)
            continue
        key = (point.kind, point.node)
        if key not in index:
            raise SolverError(f"simulator step {key} has no slot in the interval model.")
        s = index[key]
        if pending:
            rec = index.get(("recompute", point.node))
            if point.kind != "bwd" or rec is None:
                raise SolverError(f"recompute steps before {key} have no recompute slot.")
            result[rec] = max(pending)
            pending = []
        result[s] = point.during_bytes
    return result
