"""Cache columns of the interval model: a region span once more for each set of its ops it
may cache (a selective-checkpoint ``MUST_SAVE``), so that the integer programs choose
per-op save or recompute decisions inside one level of regions.

A column is an :class:`~chkpt_opt.solvers.interval.model.Interval` with ``cached`` set. It
follows :func:`chkpt_opt.memory_model.op_sequence.lower` exactly:

* its recompute time leaves out the cached ops (the recomputation takes their outputs from
  the cache) and adds what its selective-checkpoint policy costs
  (:func:`chkpt_opt.memory_model.region_replay.policy_cost_s`);
* its replay runs the other ops of the replayed prefix; a cached op allocates nothing and
  reads nothing there;
* a cached op's storages live from the forward pass until the recomputation takes them
  (its last computed op before the cached one), until their last reader in the
  recomputation, or to its end when a computed view of them is read after it; where an op
  of the region saves them, they live until that op's backward instead. The first part is
  a *hold* of the lifetime (the column keeps the storage until the slot before its replay,
  or until the savers' last backward); the part inside the replay slot is counted in the
  column's replay peak, step by step, so that the model stays exact at the replay's steps.

A storage a column caches is held by nothing else at the replay slot in the model's
domain: the model caches only ops that own their storages, none of them a step output,
and only in spans after which no op saves tensors without running its backward (such an
op, or a region around it, would keep them to the end of the step, and the replay would
count a storage the lifetime counts already).

Which sets become columns (``mode``):

* ``"subsets"``: every non-empty subset of the span's candidates (at most
  :data:`MAX_SUBSET_CANDIDATES` per span): the model is then exact over every one-level
  schedule with cached ops in its domain (the reference on small graphs);
* ``"ranked"``: the candidates ranked by recompute time saved per byte cached (ties: order)
  and every non-empty prefix of that ranking: the family of selective activation
  checkpointing (matmul and convolution outputs saved first), a column per prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import (
    CostGraph,
    ordered_nodes,
    owned_storages,
    storage_owners,
    storage_refs,
)
from chkpt_opt.memory_model.region_replay import policy_cost_s, replayed_ops
from chkpt_opt.memory_model.schedule import Schedule, cacheable_ops, caching_allowed
from chkpt_opt.solvers.interval.model import Interval

CACHE_MODES = ("none", "ranked", "subsets")
MAX_SUBSET_CANDIDATES = 10


class ReplayCounter(Protocol):
    """What the columns read from the interval model's builder
    (:mod:`chkpt_opt.solvers.interval.builder`)."""

    reads: list[list[tuple[str, int]]]  # (storage, owner index) each op reads, by op index

    def saver_ends(self, a: int, last_saver: int, holds: Callable[[str], bool]) -> dict[str, int]:
        """The last backward slot at which a saver among ops ``a..last_saver`` keeps each
        storage it saves for which ``holds`` is true."""
        ...

    def check_deadline(self, what: str) -> None:
        """Raises DeadlineExceeded once the build's deadline has passed."""
        ...

    def replay_bytes(
        self,
        a: int,
        last: int,
        last_saver: int,
        cached: frozenset[int] = frozenset(),
        cached_alive: tuple[tuple[int, int], ...] = (),
    ) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Peak bytes of a replay of ops ``a..last`` and what outlives it."""
        ...


@dataclass(frozen=True)
class CacheHold:
    """A column keeps a storage of one of its cached ops until ``last_slot``.

    Attributes:
        storage: the storage id.
        owner: index of the cached op that owns it.
        interval: the column's interval id.
        last_slot: the last slot the cache (or a saver in the region) holds it.
    """

    storage: str
    owner: int
    interval: int
    last_slot: int


class CacheColumns:
    """The cache columns of one graph's interval model (see the module docstring)."""

    def __init__(self, graph: CostGraph, mode: str) -> None:
        if mode not in CACHE_MODES[1:]:
            raise SolverError(f"cache mode {mode!r} is not one of {list(CACHE_MODES)}.")
        self.graph = graph
        self.mode = mode
        order = ordered_nodes(graph)
        n = len(order)
        index = {v: i for i, v in enumerate(order)}
        owner = storage_owners(graph)
        refs = {v: storage_refs(graph, v) for v in order}
        outputs = {sid for out in graph.graph["outputs"] for sid in refs[out]}
        allowed = cacheable_ops(graph)
        # owned[i]: the storages op i allocates in the forward pass, with their bytes.
        self.owned = [owned_storages(graph, v, owner) for v in order]
        # op_ok[i]: the model may cache op i (in a span that allows caching).
        self.op_ok = [
            order[i] in allowed and bool(self.owned[i]) and not outputs & set(self.owned[i])
            for i in range(n)
        ]
        # saves_without_backward_from[p]: some op at index >= p saves tensors and never runs
        # its backward.
        self.saves_without_backward_from = [False] * (n + 1)
        for i in reversed(range(n)):
            attrs = graph.nodes[order[i]]
            mute = attrs["n_saved"] > 0 and not attrs["has_backward"]
            self.saves_without_backward_from[i] = mute or self.saves_without_backward_from[i + 1]
        # views[i]: the ops other than i whose outputs refer to a storage op i owns.
        self.views: list[list[int]] = [[] for _ in range(n)]
        for j, v in enumerate(order):
            for sid in refs[v]:
                i = index[owner[sid]]
                if i != j and j not in self.views[i]:
                    self.views[i].append(j)
        # later_reader[j]: the last op reading op j's output (past every op for an output).
        self.later_reader = [
            max((index[s] for s in graph.successors(v)), default=-1)
            + (n + 1 if v in graph.graph["outputs"] else 0)
            for v in order
        ]
        self.fwd_time_s = [graph.nodes[v]["fwd_time_s"] for v in order]
        self.holds: list[CacheHold] = []

    def covers(self, schedule: Schedule) -> bool:
        """Whether ``schedule`` is in the space of the columns: one level of regions, each
        caching one of the sets that become its columns (nothing, or ops of its replayed
        prefix in the model's domain, as ``mode`` sets them)."""
        if schedule.nested:
            return False
        order = ordered_nodes(self.graph)
        owner = storage_owners(self.graph)
        for a, b in schedule.spans(self.graph):
            cached = frozenset(i for i in range(a, b) if order[i] in schedule.saved)
            if not cached:
                continue
            last = a + len(replayed_ops(self.graph, tuple(order[a:b]), owner)) - 1
            if cached not in set(self.cached_sets(self.candidates(a, b, last))):
                return False
        return True

    def floor_cost_s(self, a: int, last: int) -> float:
        """The recompute time of ops ``a..last`` that no column may cache: no column of a
        span whose replay runs them costs less (it only grows with ``last``)."""
        return sum(self.fwd_time_s[i] for i in range(a, last + 1) if not self.op_ok[i])

    def candidates(self, a: int, b: int, last: int) -> list[int]:
        """The ops of span ``[a, b)`` a column may cache: those of its replayed prefix
        ``a..last`` in the model's domain."""
        if self.saves_without_backward_from[b] or not caching_allowed(self.graph, a, b):
            return []
        return [i for i in range(a, last + 1) if self.op_ok[i]]

    def cached_sets(self, candidates: list[int]) -> Iterator[frozenset[int]]:
        """The sets of ops that become columns (see ``mode``)."""
        if self.mode == "subsets":
            if len(candidates) > MAX_SUBSET_CANDIDATES:
                raise SolverError(
                    f"a span has {len(candidates)} ops it may cache; cache='subsets' takes "
                    f"at most {MAX_SUBSET_CANDIDATES} per span (2**n columns). Use "
                    "cache='ranked' on this graph."
                )
            for size in range(1, len(candidates) + 1):
                for subset in itertools.combinations(candidates, size):
                    yield frozenset(subset)
            return

        def saved_per_byte(i: int) -> tuple[float, int]:
            nbytes = sum(self.owned[i].values())
            return (-self.fwd_time_s[i] / max(nbytes, 1), i)

        ranked = sorted(candidates, key=saved_per_byte)
        for size in range(1, len(ranked) + 1):
            yield frozenset(ranked[:size])

    def columns(
        self,
        builder: ReplayCounter,
        base: Interval,
        last: int,
        last_saver: int,
        first_id: int,
        max_cost_s: float,
    ) -> list[Interval]:
        """The columns of the replayed span ``base`` (ops ``a..last`` replayed), costing at
        most ``max_cost_s``, numbered from ``first_id``; their holds go to :attr:`holds`."""
        assert base.replay_slot is not None
        found: list[Interval] = []
        a = base.start
        candidates = self.candidates(a, base.stop, last)
        # The last backward slot of the region's savers of each candidate's storages (the
        # same for every column of the span).
        saver_end = builder.saver_ends(
            a, last_saver, lambda sid: any(sid in self.owned[k] for k in candidates)
        )
        # What the selective-checkpoint policy costs: the span's ops in the forward pass and
        # the replayed prefix, cached ops included, dispatched through it.
        policy_s = policy_cost_s(self.graph, (base.stop - a) + (last - a + 1))
        for cached in self.cached_sets(candidates):
            builder.check_deadline("cache columns")
            cost = base.cost_s - sum(self.fwd_time_s[i] for i in cached) + policy_s
            if cost > max_cost_s:
                continue
            alive: list[tuple[int, int]] = []
            holds: list[CacheHold] = []
            interval_id = first_id + len(found)
            for k in sorted(cached):
                for sid, nbytes in self.owned[k].items():
                    if sid in saver_end:
                        holds.append(CacheHold(sid, k, interval_id, saver_end[sid]))
                        continue
                    holds.append(CacheHold(sid, k, interval_id, base.replay_slot - 1))
                    until = self._until_in_replay(builder, a, last, k, sid, cached)
                    if until >= a:
                        alive.append((until, nbytes))
            peak, held = builder.replay_bytes(a, last, last_saver, cached, tuple(alive))
            found.append(
                Interval(
                    a,
                    base.stop,
                    cost,
                    base.replay_slot,
                    base.release_slot,
                    peak,
                    held,
                    cached=tuple(sorted(cached)),
                )
            )
            self.holds += holds
        return found

    def _until_in_replay(
        self, builder: ReplayCounter, a: int, last: int, k: int, sid: str, cached: frozenset[int]
    ) -> int:
        """The last replay step (op index) at which cached op ``k``'s storage ``sid`` is
        alive, or ``a - 1`` when it is freed before the replay."""
        computed = [i for i in range(a, last + 1) if i not in cached]
        until = max((i for i in computed if i < k), default=a - 1)
        for i in computed:
            if any(s == sid for s, _ in builder.reads[i]):
                until = max(until, i)
        for j in self.views[k]:
            if a <= j <= last and j not in cached and self.later_reader[j] > last:
                until = last
        return until
