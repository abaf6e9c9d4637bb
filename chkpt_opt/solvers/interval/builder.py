"""Builds the interval model of a graph (:mod:`chkpt_opt.solvers.interval.model` says what
it holds), one pass per quantity, following :mod:`chkpt_opt.memory_model.op_sequence` exactly."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import (
    CostGraph,
    ordered_nodes,
    region_overhead_s,
    storage_owners,
    storage_refs,
)
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.region_replay import replayed_ops
from chkpt_opt.memory_model.schedule import Schedule, cut_positions
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.interval.cache_columns import CacheColumns
from chkpt_opt.solvers.interval.model import Holder, Interval, IntervalModel, Lifetime
from chkpt_opt.solvers.segments import last_reads


def build_interval_model(
    graph: CostGraph,
    *,
    positions: Sequence[int] | None = None,
    segments: Sequence[int] = (),
    max_cost_s: float | None = None,
    cache: str = "none",
    deadline: Deadline = NO_DEADLINE,
) -> IntervalModel:
    """Precomputes the interval model of ``graph``.

    Args:
        graph: the cost graph.
        positions: cut positions that candidate intervals may start and stop at; None means
            every allowed cut position (the exact model). Invalid positions are refused.
        segments: positions no interval may cross (an interval may start or stop there);
            used by the hierarchical solver to keep regions inside blocks.
        max_cost_s: leave out every interval whose recompute time exceeds this (see the
            module docstring); None keeps all.
        cache: ``"none"`` (keep-set regions only), or the cache columns to add
            (``"ranked"`` or ``"subsets"``, see :mod:`chkpt_opt.solvers.interval.cache_columns`).
        deadline: the build stops with
            :class:`~chkpt_opt.solvers.deadline.DeadlineExceeded` once it has expired.

    Raises:
        SolverError: if ``positions`` holds a position that is not an allowed cut, or
            ``cache`` is not a cache mode.
        DeadlineExceeded: if the build runs past ``deadline``.
    """
    if max_cost_s is not None and not max_cost_s >= 0:
        raise SolverError(f"max_cost_s must be a number >= 0, got {max_cost_s!r}.")
    builder = _Builder(graph, positions, segments, max_cost_s, deadline)
    if cache != "none":
        builder.cache = CacheColumns(graph, cache)
    return builder.build()


def _last_before(flags: list[bool]) -> list[int]:
    """``out[p]``: the largest ``i < p`` with ``flags[i]``, or -1 (for ``p`` in ``0..n``)."""
    out = [-1]
    for i, flag in enumerate(flags):
        out.append(i if flag else out[-1])
    return out


class _Builder:
    """Builds an :class:`IntervalModel` (one pass per quantity, mirroring op_sequence.py)."""

    def __init__(
        self,
        graph: CostGraph,
        positions: Sequence[int] | None,
        segments: Sequence[int],
        max_cost_s: float | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> None:
        self.graph = graph
        self.cache: CacheColumns | None = None
        self.max_cost_s = max_cost_s
        self.deadline = deadline
        self.nodes = graph.nodes
        self.order = ordered_nodes(graph)
        self.n = len(self.order)
        ok = cut_positions(graph)
        allowed = [p for p in range(self.n + 1) if ok[p]]
        if positions is None:
            chosen = allowed
        else:
            bad = sorted(set(positions) - set(allowed))
            if bad:
                raise SolverError(
                    f"cut positions {bad[:8]} are not allowed cuts of graph "
                    f"{graph.graph.get('name', '')!r}; pick positions p with "
                    "cut_positions(graph)[p] True."
                )
            chosen = sorted({0, self.n, *positions})
        self.positions = tuple(chosen)
        self.bounds = sorted(set(segments))
        self.complete = len(self.positions) == len(allowed) and not any(
            0 < p < self.n for p in self.bounds
        )
        self.owner = storage_owners(graph)
        self.refs = {v: storage_refs(graph, v) for v in self.order}
        self.idx = {v: i for i, v in enumerate(self.order)}
        self.preds = [sorted(self.idx[u] for u in graph.predecessors(v)) for v in self.order]
        self.owner_idx = {sid: self.idx[o] for sid, o in self.owner.items()}
        self.attrs = [graph.nodes[v] for v in self.order]
        # (storage, index of its owner) of everything op i reads, from its inputs.
        self.reads = [
            [(sid, self.owner_idx[sid]) for u in self.preds[i] for sid in self.refs[self.order[u]]]
            for i in range(self.n)
        ]
        # The last op that reads each storage (past every op for what the step returns):
        # a replay holds what an op after it reads until the replay ends.
        self.last_reader = last_reads(graph)

    # -- slots ---------------------------------------------------------------------------

    def _slots(self) -> None:
        """Slots from the keep-all op sequence, with a recompute slot before every op that can
        trigger a replay; also the schedule-independent gradient and transient bytes."""
        nodes = self.nodes
        steps = lower(self.graph, Schedule())
        slots: list[tuple[str, str]] = []
        step_slot: list[int] = []
        for step in steps:
            if step.kind == "bwd":
                attrs = nodes[step.node]
                if attrs["n_saved"] > 0 and attrs["has_backward"]:
                    slots.append(("recompute", step.node))
            step_slot.append(len(slots))
            slots.append((step.kind, step.node))
        self.slots = tuple(slots)
        self.end = len(slots)
        self.slot_index = {key: s for s, key in enumerate(slots)}
        self.bwd_slot = {v: s for s, (kind, v) in enumerate(slots) if kind == "bwd"}
        base = [0] * self.end
        alloc: dict[str, tuple[int, int]] = {}
        for position, step in enumerate(steps):
            s = step_slot[position]
            base[s] += step.transient_bytes
            for inst, nbytes in step.alloc:
                if not inst.startswith("f:"):  # gradients: the same for every schedule
                    alloc[inst] = (s, nbytes)
            for inst in step.free:
                if inst in alloc:
                    first, nbytes = alloc.pop(inst)
                    self._add_range(base, first, s, nbytes)
        for first, nbytes in alloc.values():
            self._add_range(base, first, self.end - 1, nbytes)
        self.base = base

    @staticmethod
    def _add_range(values: list[int], first: int, last: int, nbytes: int) -> None:
        for s in range(first, last + 1):
            values[s] += nbytes

    def saver_ends(self, a: int, last_saver: int, holds: Callable[[str], bool]) -> dict[str, int]:
        """The last backward slot at which a saver among ops ``a..last_saver`` keeps each
        storage it saves for which ``holds`` is true."""
        ends: dict[str, int] = {}
        for i in range(a, last_saver + 1):
            for sid in self.attrs[i]["saved"]:
                if holds(sid):
                    ends[sid] = max(ends.get(sid, -1), self.kept(i))
        return ends

    def check_deadline(self, what: str) -> None:
        """Raises DeadlineExceeded once the deadline has passed."""
        self.deadline.check(
            f"building the interval model of graph {self.graph.graph.get('name', '')!r} ({what})"
        )

    def kept(self, i: int) -> int:
        """``kept_until`` of op ``i`` as a slot."""
        return self.bwd_slot.get(self.order[i], self.end)

    # -- intervals -----------------------------------------------------------------------

    def _intervals(self) -> None:
        attrs = self.attrs
        n = self.n
        packer = [a["n_saved"] > 0 for a in attrs]
        trig = [packer[i] and a["has_backward"] for i, a in enumerate(attrs)]
        saver = [bool(a["saved"]) for a in attrs]
        # The last op before each position with each flag (-1: none), and running counts of
        # packers without a backward: each interval's scans become lookups.
        last_packer_before = _last_before(packer)
        last_trig_before = _last_before(trig)
        last_saver_before = _last_before(saver)
        mute = [0]
        for i in range(n):
            mute.append(mute[-1] + (packer[i] and not trig[i]))
        intervals: list[Interval] = []
        replay_cache: dict[tuple[int, int, int], tuple[int, tuple[tuple[int, int], ...]]] = {}
        # The replayed ops of a region depend only on its start and its last packer.
        replayed_cache: dict[tuple[int, int], int] = {}
        cost_cache: dict[tuple[int, int], float] = {}
        cap = math.inf if self.max_cost_s is None else self.max_cost_s
        overhead = region_overhead_s(self.graph)  # every region costs it, as simulate counts
        for ai, a in enumerate(self.positions):
            self.check_deadline("intervals")
            first_packer = next((i for i in range(a, n) if packer[i]), None)
            limit = next((p for p in self.bounds if p > a), self.n)
            for b in self.positions[ai + 1 :]:
                if b > limit:
                    break
                last_packer = last_packer_before[b] if last_packer_before[b] >= a else None
                trigger = last_trig_before[b] if last_trig_before[b] >= a else None
                if last_packer is None:
                    release = b - 1  # fwd slot of the region's last op
                elif mute[b] > mute[a]:
                    release = self.end
                else:
                    assert first_packer is not None
                    release = self.kept(first_packer)
                n_replayed = 0
                if trigger is not None:
                    assert last_packer is not None
                    if (a, last_packer) not in replayed_cache:
                        region = tuple(self.order[a:b])
                        replayed_cache[a, last_packer] = len(
                            replayed_ops(self.graph, region, self.owner)
                        )
                    n_replayed = replayed_cache[a, last_packer]
                if n_replayed == 0:
                    intervals.append(Interval(a, b, overhead, None, release, 0, ()))
                    continue
                assert trigger is not None
                last_replayed = a + n_replayed - 1
                if (a, last_replayed) not in cost_cache:
                    cost_cache[a, last_replayed] = sum(
                        attrs[i]["fwd_time_s"] for i in range(a, last_replayed + 1)
                    )
                cost = cost_cache[a, last_replayed] + overhead
                floor = cost
                if self.cache is not None:
                    floor = self.cache.floor_cost_s(a, last_replayed) + overhead
                if floor > cap:
                    break  # a later stop replays at least these ops: it costs at least as much
                last_saver = last_saver_before[b] if last_saver_before[b] >= a else a
                key = (a, last_replayed, last_saver)
                if key not in replay_cache:
                    replay_cache[key] = self.replay_bytes(a, last_replayed, last_saver)
                peak, held = replay_cache[key]
                replay_slot = self.slot_index[("recompute", self.order[trigger])]
                base = Interval(a, b, cost, replay_slot, release, peak, held)
                if cost <= cap:
                    intervals.append(base)
                if self.cache is not None:
                    intervals += self.cache.columns(
                        self, base, last_replayed, last_saver, len(intervals), cap
                    )
        self.intervals = intervals

    def replay_bytes(
        self,
        a: int,
        last: int,
        last_saver: int,
        cached: frozenset[int] = frozenset(),
        cached_alive: tuple[tuple[int, int], ...] = (),
    ) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Peak bytes of the replay of ops ``a..last`` and what outlives it.

        Savers up to ``last_saver`` hold the recomputed storages of owners inside the region
        until their ``kept_until``; a storage that an op after the replay reads lives to the
        end of the replay. The ops in ``cached`` do not run (no step, no fresh storage, no
        reads); ``cached_alive`` lists ``(last op index, bytes)`` of the cached storages
        alive from the replay's first step to that op's step
        (:mod:`chkpt_opt.solvers.interval.cache_columns` finds them).
        """
        owner_idx = self.owner_idx
        steps = range(a, last + 1)
        size: dict[str, int] = {}
        born: dict[str, int] = {}
        last_read: dict[str, int] = {}
        for i in steps:
            if i in cached:
                continue
            attrs = self.attrs[i]
            for sid, nbytes in attrs["outputs"].items():
                size[sid], born[sid] = nbytes, i
            for sid, nbytes in attrs["saved"].items():
                if owner_idx[sid] == i and sid not in attrs["outputs"]:
                    size[sid], born[sid] = nbytes, i
            for sid, o in self.reads[i]:
                if a <= o <= last:
                    last_read[sid] = i  # i only grows
        held = self.saver_ends(a, last_saver, lambda sid: owner_idx[sid] >= a and sid in size)
        # Bytes alive at each step: a storage lives from its birth to its last read (to the
        # end of the replay when a saver holds it); summed with a difference array.
        delta = [0] * (last - a + 2)
        for sid, nbytes in size.items():
            read_later = self.last_reader.get(sid, -1) > last
            until = last if sid in held or read_later else max(born[sid], last_read.get(sid, -1))
            if until >= born[sid]:
                delta[born[sid] - a] += nbytes
                delta[min(until, last) - a + 1] -= nbytes
        for until, nbytes in cached_alive:
            delta[0] += nbytes
            delta[until - a + 1] -= nbytes
        peak = 0
        alive = 0
        for i in steps:
            alive += delta[i - a]
            if i not in cached:
                peak = max(peak, alive + self.attrs[i]["fwd_workspace_bytes"])
        by_end: dict[int, int] = {}
        for sid, last in held.items():
            by_end[last] = by_end.get(last, 0) + size[sid]
        return peak, tuple(sorted(by_end.items()))

    # -- lifetimes -----------------------------------------------------------------------

    def _lifetimes(self) -> None:
        nodes = self.nodes
        outputs = set()
        for out in self.graph.graph["outputs"]:
            outputs.update(self.refs[out])
        size: dict[str, int] = {}
        alloc: dict[str, int] = {}
        fixed_end: dict[str, int] = {}
        saved_by: dict[str, list[int]] = {}
        read_by: dict[str, list[int]] = {}
        for i, v in enumerate(self.order):
            attrs = nodes[v]
            for sid, nbytes in attrs["outputs"].items():
                size[sid], alloc[sid], fixed_end[sid] = nbytes, i, i
            for sid, nbytes in attrs["saved"].items():
                if self.owner_idx[sid] == i and sid not in attrs["outputs"]:
                    size[sid], alloc[sid], fixed_end[sid] = nbytes, i, i
                saved_by.setdefault(sid, []).append(i)
            for u in self.preds[i]:
                for sid in self.refs[self.order[u]]:
                    fixed_end[sid] = max(fixed_end[sid], i)
                    read_by.setdefault(sid, []).append(i)
        for sid in outputs:
            fixed_end[sid] = self.end
        # Intervals containing each op, by op index.
        containing: list[list[int]] = [[] for _ in range(self.n)]
        for k, iv in enumerate(self.intervals):
            if k % 1024 == 0:
                self.check_deadline("lifetimes")
            for i in range(iv.start, iv.stop):
                containing[i].append(k)
        lifetimes: list[Lifetime] = []
        base = self.base
        cache_holders: dict[str, list[Holder]] = {}
        if self.cache is not None:
            by_storage: dict[tuple[str, int], list[tuple[int, int]]] = {}
            for hold in self.cache.holds:
                by_storage.setdefault((hold.storage, hold.owner), []).append(
                    (hold.interval, hold.last_slot)
                )
            for (sid, k), ends_by_column in sorted(by_storage.items()):
                cache_holders.setdefault(sid, []).append(Holder(k, None, tuple(ends_by_column)))
        for sid in sorted(size, key=lambda s: (alloc[s], s)):
            self.check_deadline("lifetimes")
            o = self.owner_idx[sid]
            fixed = fixed_end[sid]
            self._add_range(base, alloc[sid], min(fixed, self.end - 1), size[sid])
            if fixed >= self.end:
                continue
            savers = set(saved_by.get(sid, ()))
            holders = list(cache_holders.get(sid, ()))
            ends: set[int] = {e for h in holders for _, e in h.region_ends}
            for i in sorted(savers | set(read_by.get(sid, ()))):
                outside = self.kept(i) if i in savers else None
                if outside is not None and outside <= fixed:
                    outside = None
                region_ends = []
                for k in containing[i]:
                    iv = self.intervals[k]
                    if not iv.start <= o < iv.stop and iv.release_slot > fixed:
                        region_ends.append((k, iv.release_slot))
                if outside is None and not region_ends:
                    continue
                holders.append(Holder(i, outside, tuple(region_ends)))
                if outside is not None:
                    ends.add(outside)
                ends.update(e for _, e in region_ends)
            if holders:
                lifetimes.append(
                    Lifetime(sid, size[sid], alloc[sid], fixed, tuple(sorted(ends)), tuple(holders))
                )
        self.lifetimes = lifetimes

    def build(self) -> IntervalModel:
        self._slots()
        self._intervals()
        self._lifetimes()
        return IntervalModel(
            n_ops=self.n,
            nodes=tuple(self.order),
            positions=self.positions,
            slots=self.slots,
            end_slot=self.end,
            intervals=tuple(self.intervals),
            lifetimes=tuple(self.lifetimes),
            base_bytes=tuple(self.base),
            complete=self.complete,
            max_cost_s=self.max_cost_s,
            total_fwd_s=sum(self.nodes[v]["fwd_time_s"] for v in self.order),
            cache=self.cache.mode if self.cache is not None else "none",
        )
