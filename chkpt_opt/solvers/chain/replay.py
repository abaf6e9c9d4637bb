"""Range maxima and incremental replays: the two fast primitives dp_chain's chain model
evaluates pieces with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from chkpt_opt.solvers.base import INF_BYTES


class ChainStorages(Protocol):
    """What a replay reads of the chain model (a ``ChainModel``)."""

    owner_idx: dict[str, int]
    size: dict[str, int]
    births: list[list[tuple[str, int]]]
    reads: list[set[str]]
    saved_ids: list[list[str]]
    workspace: list[int]
    last_reader: dict[str, int]


class Rmq:
    """Range maximum over a fixed list of ints (a sparse table)."""

    def __init__(self, values: Sequence[int]) -> None:
        table = [list(values)]
        width = 1
        while 2 * width <= len(values):
            prev = table[-1]
            table.append(
                [max(prev[i], prev[i + width]) for i in range(len(values) - 2 * width + 1)]
            )
            width *= 2
        self.table = table

    def __call__(self, lo: int, hi: int) -> int:
        """Max over ``values[lo..hi]`` (inclusive); a very negative number when empty."""
        if lo > hi:
            return -INF_BYTES
        k = (hi - lo + 1).bit_length() - 1
        row = self.table[k]
        return max(row[lo], row[hi - (1 << k) + 1])


class Replay:
    """The replay of ops ``a..L`` of a region, grown op by op (see ``_replay`` in
    :mod:`chkpt_opt.solvers.interval.model`, which it reproduces incrementally): bytes alive
    plus transients at every replayed step, for the recomputed storages that savers up to
    ``S`` hold to the end of the replay and the others until their last reader."""

    def __init__(self, chain: ChainStorages, a: int) -> None:
        self.chain = chain
        self.a = a
        self.last = a - 1
        self.last_saver = a - 1
        self.alive: list[int] = []
        self.end: dict[str, int] = {}
        self.held: set[str] = set()
        self.pending: set[str] = set()
        self.held_total = 0
        # Storages born in the replay that an op after its current end reads: alive to the
        # end, until the replay grows past their last reader.
        self.open: dict[int, list[str]] = {}
        self.open_ids: set[str] = set()
        self.open_total = 0

    def advance(self, last: int, last_saver: int) -> int:
        """Grows the replay to ops ``a..last`` with savers up to ``last_saver``; returns its
        peak."""
        while self.last < last:
            self._step(self.last + 1)
        while self.last_saver < last_saver:
            self._saver(self.last_saver + 1)
        return max(self.alive)

    def _step(self, t: int) -> None:
        chain, a = self.chain, self.a
        value = self.held_total + self.open_total + chain.workspace[t]
        for sid in chain.reads[t]:
            e = self.end.get(sid)
            if e is None:
                continue  # a region input, or held already
            size = chain.size[sid]
            for k in range(e + 1, t):
                self.alive[k - a] += size
            self.end[sid] = t
            value += size
        for sid, size in chain.births[t]:
            if sid in self.pending:
                self.held.add(sid)
                self.held_total += size
            elif chain.last_reader.get(sid, -1) > t:
                self.open.setdefault(chain.last_reader[sid], []).append(sid)
                self.open_ids.add(sid)
                self.open_total += size
            else:
                self.end[sid] = t
            value += size
        self.alive.append(value)
        self.last = t
        for sid in self.open.pop(t, ()):  # read for the last time at t
            if sid in self.open_ids:
                self.open_ids.discard(sid)
                self.open_total -= chain.size[sid]
                self.end[sid] = t

    def _saver(self, i: int) -> None:
        chain, a = self.chain, self.a
        for sid in chain.saved_ids[i]:
            if chain.owner_idx[sid] < a or sid in self.held:
                continue
            if sid in self.open_ids:  # alive to the end already; now held beyond it
                self.open_ids.discard(sid)
                self.open_total -= chain.size[sid]
                self.held.add(sid)
                self.held_total += chain.size[sid]
                continue
            e = self.end.pop(sid, None)
            if e is None:
                self.pending.add(sid)
                continue
            size = chain.size[sid]
            for k in range(e + 1, self.last + 1):
                self.alive[k - a] += size
            self.held.add(sid)
            self.held_total += size
        self.last_saver = i
