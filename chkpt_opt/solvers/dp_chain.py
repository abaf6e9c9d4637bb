"""Exact dynamic programming over a chain of segments: ``solver="dp_chain"``.

Beaumont et al. ("Optimal checkpointing for heterogeneous chains", 2019) solve rotor's
multi-level model on a chain by dynamic programming; this module does the same for the
keep-set schedule model of :mod:`chkpt_opt.schedule`, with the memory of every slot exactly as
:mod:`chkpt_opt.solvers.interval_model` (and so the simulator) counts it.

**Chain.** The graph is cut at a set of allowed cut positions ``0 = c_0 < c_1 < ... < c_m = n``
into segments. A storage whose life depends on the schedule (it is read or saved after its
forward step, and is not a step output) must have its owner, readers and savers in at most
two adjacent segments. With every allowed cut position this holds for a chain of ops (saving
inputs or outputs) and for a DAG whose only allowed cuts are its articulation points; then the
DP is exact over the whole schedule model and reports ``optimal``. Otherwise the cut set is
thinned to the largest one where it holds (a restricted model: never reported optimal, see
``stats``), or, with ``require_complete``, the graph is refused.

**Pieces.** A schedule is a path of *pieces*: a segment outside every region, or a region
``[c_i, c_j)`` (one or more segments). The timeline nests: the slots of the ops from position
``p`` on (their forward steps, ``bwd_start``, their backward steps) form one contiguous range
``nest(p)``, inside which every later piece lives. What a piece ``J = [p, q)`` changes is
then:

* on its own slots ``nest(p) \\ nest(q)``: the base bytes, its replay peak at its trigger's
  recompute slot, the recomputed storages it holds after the replay, and the storages
  *crossing* its two boundary cuts (owned just before the cut, read or saved just after),
  whose end depends on the piece on each side;
* on every later slot, ``nest(q)``: the bytes ``k(J)`` it keeps through the whole of it (its
  region's kept inputs until its release, the inputs its outside ops save until their
  backward), added uniformly.

With ``K`` the bytes kept by the pieces before ``J``, the memory at ``J``'s slots is
``K + own(J)``, so a schedule fits iff ``K_J + need(J) <= budget`` for every piece, and

    best(q, s', K + k(J)) = min over pieces J = [p, q) and states s at p of
                            best(p, s, K) + recompute(J),   subject to K + need(J) <= budget.

The state ``s`` at a cut holds what the neighbouring pieces need of each other: whether the
piece before the cut holds each crossing storage (its *exit*), and whether the piece after it
holds the crossing storages whose last forward reader lies two or more ops before the cut
(its *entry class*, which the earlier piece's own slots depend on: it is fixed when the
earlier piece is chosen, and the later piece must match it). On a chain there are one or two
states per cut. The DP keeps, per cut and state, the Pareto front of (kept bytes ``K``,
recompute time): exact, since every later constraint only gets harder as ``K`` grows; entries
with ``K`` above the budget minus the base bytes somewhere after the cut are dropped (every
later slot sees ``K``). For an infeasible budget, the same recurrence with the running peak in
place of the cost gives the exact minimum peak, and the cheapest schedule at that peak is
returned. Every returned schedule is simulated; the peak the DP predicts must equal the
simulator's (else :class:`~chkpt_opt.errors.SolverError`: a bug).

Costs: ``O(m^2)`` pieces, each evaluated with a few range-maximum queries after an ``O(n^2)``
precomputation (replay peaks grown incrementally per region start), times the size of the
Pareto fronts. Measured on 2 shared cores: 300-op chains in 1 s (homogeneous) to 4 s
(heterogeneous, saving outputs, a loose budget: fronts of ~1500 entries).

Not supported (refused with :class:`~chkpt_opt.errors.SolverError`): an op that keeps
tensors but never runs its backward (its tensors live to the end of the step, across every
piece), and graphs whose byte totals would overflow 62-bit integers.
"""

from __future__ import annotations

import dataclasses
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_owners, storage_refs
from chkpt_opt.schedule import Schedule, cut_positions
from chkpt_opt.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, SolveStatus, result_from_profile
from chkpt_opt.solvers.greedy import GreedySolver
from chkpt_opt.solvers.interval_model import build_interval_model
from chkpt_opt.solvers.interval_solve import keep_all_result
from chkpt_opt.solvers.registry import register

REGION = 0
OUTSIDE = 1
_NEG = -(1 << 62)
_MAX_TOTAL = 1 << 62

Key = tuple[tuple[int, ...], tuple[bool, ...]]


@dataclass(frozen=True)
class Crossing:
    """A storage owned in the segment before a cut and read or saved in the one after it.

    Attributes:
        storage: the storage id.
        size: its bytes.
        fixed_end: last slot it is alive under every schedule.
        left_end: last slot the segment before the cut holds it when outside every region
            (the latest ``kept_until`` of its savers there), or -1.
        right_end: the same for the segment after the cut.
    """

    storage: str
    size: int
    fixed_end: int
    left_end: int
    right_end: int


@dataclass(frozen=True)
class Internal:
    """A storage whose owner, readers and savers all lie in one segment.

    Attributes:
        size: its bytes.
        fixed_end: last slot it is alive under every schedule.
        own_end: last slot the segment holds it when outside every region, or -1 (inside a
            region, which then contains its owner, nothing holds it).
    """

    size: int
    fixed_end: int
    own_end: int


@dataclass(frozen=True)
class RegionData:
    """What a region ``[a, b)`` needs from the model.

    Attributes:
        cost_s: recompute time of its replay (0 without one).
        replay_slot: recompute slot of its trigger, or -1 without a replay.
        replay_peak: peak bytes of the replay's own storages and transients.
        release: last slot at which it holds its inputs.
    """

    cost_s: float
    replay_slot: int
    replay_peak: int
    release: int


@dataclass(frozen=True)
class Evaluation:
    """A piece evaluated in a state.

    Attributes:
        need: the largest bytes at its own slots, beyond what earlier pieces keep.
        kept: bytes it adds to every later piece's slots.
        cost_s: its recompute time.
        exit: the state part it hands to the next piece.
    """

    need: int
    kept: int
    cost_s: float
    exit: tuple[int, ...]


class _Rmq:
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
            return _NEG
        k = (hi - lo + 1).bit_length() - 1
        row = self.table[k]
        return max(row[lo], row[hi - (1 << k) + 1])


class _Replay:
    """The replay of ops ``a..L`` of a region, grown op by op (see ``_replay`` in
    :mod:`chkpt_opt.solvers.interval_model`, which it reproduces incrementally): bytes alive
    plus transients at every replayed step, for the recomputed storages that savers up to
    ``S`` hold to the end of the replay and the others until their last reader."""

    def __init__(self, chain: ChainModel, a: int) -> None:
        self.chain = chain
        self.a = a
        self.last = a - 1
        self.last_saver = a - 1
        self.alive: list[int] = []
        self.end: dict[str, int] = {}
        self.held: set[str] = set()
        self.pending: set[str] = set()
        self.held_total = 0

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
        value = self.held_total + chain.workspace[t]
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
            else:
                self.end[sid] = t
            value += size
        self.alive.append(value)
        self.last = t

    def _saver(self, i: int) -> None:
        chain, a = self.chain, self.a
        for sid in chain.saved_ids[i]:
            if chain.owner_idx[sid] < a or sid in self.held:
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


class ChainModel:
    """A graph as a chain of segments, with everything the DP evaluates pieces with.

    Attributes:
        n: number of ops.
        cuts: the cut positions used, ``0`` and ``n`` included.
        allowed: number of allowed cut positions of the graph (``0`` and ``n`` included).
        complete: ``cuts`` holds every allowed cut position (the DP is exact over the whole
            schedule model).
        crossing: per cut index, the storages crossing it (empty at ``0`` and ``n``).
        internal: per segment, its internal storages.
    """

    def __init__(
        self, graph: CostGraph, *, require_complete: bool = False, max_cuts: int | None = None
    ) -> None:
        self.graph = graph
        nodes = graph.nodes
        order = ordered_nodes(graph)
        self.order = order
        n = self.n = len(order)
        _check_supported(graph, order)

        scan = _scan(graph, order)
        allowed, cuts = _cut_set(graph, n, scan.spans)
        self.allowed = len(allowed)
        self.complete = len(cuts) == len(allowed)
        if require_complete and not self.complete:
            raise SolverError(
                f"graph {graph.graph.get('name', '')!r} is not a chain at every allowed cut: "
                f"storages read or saved across several cuts leave {len(cuts)} of "
                f"{len(allowed)} allowed cut positions usable; use solver 'cpsat' or 'auto', "
                "or dp_chain without require_complete (exact over that cut subset only)."
            )
        if max_cuts is not None and len(cuts) > max_cuts:
            raise SolverError(
                f"graph {graph.graph.get('name', '')!r} has {len(cuts)} usable cut positions, "
                f"more than max_cuts={max_cuts}: the DP's region table would hold "
                f"{len(cuts) ** 2 // 2} regions; use solver 'cpsat' or raise max_cuts."
            )

        # Slots and schedule-independent bytes, from the interval model (one interval only,
        # so it is cheap to build).
        base_model = build_interval_model(graph, positions=[])
        self.slots = base_model.slots
        self.end_slot = base_model.end_slot
        self.base = list(base_model.base_bytes)
        index = {v: i for i, v in enumerate(order)}
        self.bwd_slot = [-1] * n
        self.rec_slot = [-1] * n
        slot_op: list[int] = []
        for s, (kind, v) in enumerate(self.slots):
            if kind == "bwd_start":
                slot_op.append(n - 1)
                continue
            i = index[v]
            slot_op.append(i)
            if kind == "bwd":
                self.bwd_slot[i] = s
            elif kind == "recompute":
                self.rec_slot[i] = s
        if slot_op[:n] != list(range(n)) or (n and self.slots[n][0] != "bwd_start"):
            raise SolverError("unexpected slot layout; this is a bug in chkpt_opt.")
        if any(x < y for x, y in pairwise(slot_op[n:])):
            raise SolverError("the backward slots are not in reverse op order; a bug.")
        last_of = [-1] * (n + 1)
        for s, i in enumerate(slot_op):
            last_of[i] = max(last_of[i], s)
        self.inner_end = [0] * (n + 1)  # last slot of nest(p)
        self.inner_end[n] = n  # nest(n) is empty; bwd_start (slot n) closes the forward
        running = -1
        for p in range(n - 1, -1, -1):
            running = max(running, last_of[p])
            self.inner_end[p] = running
        self.rmq = _Rmq(self.base)

        # Storages.
        self.owner_idx = scan.owner_idx
        self.size = scan.size
        self.births = scan.births
        self.reads = scan.reads
        self.saved_ids: list[list[str]] = [list(nodes[v]["saved"]) for v in order]
        self.workspace = [nodes[v]["fwd_workspace_bytes"] for v in order]
        self.times = [nodes[v]["fwd_time_s"] for v in order]
        readers, savers = scan.readers, scan.savers
        total = (
            2 * sum(self.size.values()) + max(self.base, default=0) + max(self.workspace, default=0)
        )
        if total >= _MAX_TOTAL:
            raise SolverError(f"graph byte totals ({total}) are too large for dp_chain.")
        self.kept_first = {  # saved storage -> kept_until of its first saver
            sid: max(self.bwd_slot[i] for i in savers[sid]) for sid in self.size if sid in savers
        }
        self.fixed_end = {
            sid: (self.end_slot if sid in scan.step_outputs else max([o, *readers.get(sid, ())]))
            for sid, o in ((s, self.owner_idx[s]) for s in self.size)
        }
        spans = scan.spans

        self.cuts = tuple(cuts)
        m = len(cuts) - 1
        self.seg_of = [bisect_right(cuts, i) - 1 for i in range(n)]
        self.crossing: list[list[Crossing]] = [[] for _ in range(m + 1)]
        self.internal: list[list[Internal]] = [[] for _ in range(m)]
        for lo, hi, sid in spans:
            s_lo, s_hi = self.seg_of[lo], self.seg_of[hi]
            fixed = self.fixed_end[sid]
            ends: dict[int, int] = {}
            for i in savers.get(sid, ()):
                seg = self.seg_of[i]
                ends[seg] = max(ends.get(seg, -1), self.bwd_slot[i])
            if s_lo == s_hi:
                self.internal[s_lo].append(Internal(self.size[sid], fixed, ends.get(s_lo, -1)))
            elif s_hi == s_lo + 1:
                self.crossing[s_hi].append(
                    Crossing(sid, self.size[sid], fixed, ends.get(s_lo, -1), ends.get(s_hi, -1))
                )
            else:  # _max_cuts guarantees it; checked because the DP's exactness rests on it
                raise SolverError(f"storage {sid!r} spans more than two segments; a bug.")
        # Crossing storages whose last forward reader lies before the cut's previous op: the
        # piece after the cut changes the slots of the piece before it.
        self.classed = [
            [k for k, c in enumerate(self.crossing[j]) if c.fixed_end <= cuts[j] - 2]
            for j in range(m + 1)
        ]
        self._regions()

    # -- regions -------------------------------------------------------------------------

    def _regions(self) -> None:
        """Region data for every pair of cuts, and per region start the maxima of the bytes
        after a replay (base plus recomputed storages held by their savers)."""
        nodes, order, n, cuts = self.graph.nodes, self.order, self.n, self.cuts
        packer = [nodes[v]["n_saved"] > 0 for v in order]
        saves_own = [any(self.owner_idx[s] == i for s in self.saved_ids[i]) for i in range(n)]
        saver = [bool(self.saved_ids[i]) for i in range(n)]
        next_packer = [n] * (n + 1)
        for i in range(n - 1, -1, -1):
            next_packer[i] = i if packer[i] else next_packer[i + 1]
        prev_packer = [-1] * n
        prev_saver = [-1] * n
        for i in range(n):
            prev_packer[i] = i if packer[i] else (prev_packer[i - 1] if i else -1)
            prev_saver[i] = i if saver[i] else (prev_saver[i - 1] if i else -1)
        m = len(cuts) - 1
        self.region: list[list[RegionData | None]] = [[None] * (m + 1) for _ in range(m)]
        self.first_packer_end = [-1] * m  # kept_until of the first packer from each cut
        for ci in range(m):
            a = cuts[ci]
            fp = next_packer[a]
            self.first_packer_end[ci] = self.bwd_slot[fp] if fp < n else -1
            replay = _Replay(self, a)
            for cj in range(ci + 1, m + 1):
                b = cuts[cj]
                lp = prev_packer[b - 1]
                release = self.bwd_slot[fp] if fp < b else b - 1
                last = (lp if saves_own[lp] else lp - 1) if lp >= a else a - 1
                if last < a:
                    self.region[ci][cj] = RegionData(0.0, -1, 0, release)
                    continue
                s_last = prev_saver[b - 1] if prev_saver[b - 1] >= a else a
                peak = replay.advance(last, s_last)
                cost = sum(self.times[a : last + 1])
                self.region[ci][cj] = RegionData(cost, self.rec_slot[lp], peak, release)

        # G_a(s) = base(s) + recomputed storages owned from a on, alive at s after a replay
        # (held until their first saver's backward); kept as suffix maxima per region start.
        owned: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for sid, last in self.kept_first.items():
            owned[self.owner_idx[sid]].append((last, self.size[sid]))
        g = np.array(self.base, dtype=np.int64)
        self.after_replay: list[np.ndarray | None] = [None] * m  # max G over (s, E]
        self.after_release = [_NEG] * m  # max G over (E, inner_end(a)]
        start_of = {c: k for k, c in enumerate(cuts[:-1])}
        for a in range(n - 1, -1, -1):
            for last, size in owned[a]:
                g[: last + 1] += size
            ci = start_of.get(a)
            if ci is None or self.first_packer_end[ci] < 0:
                continue
            e = self.first_packer_end[ci]
            suffix = np.maximum.accumulate(g[: e + 1][::-1])[::-1]  # suffix[s] = max g[s..e]
            self.after_replay[ci] = np.append(suffix[1:], _NEG)  # max g over (s, e]
            hi = self.inner_end[a]
            if hi > e:
                self.after_release[ci] = int(g[e + 1 : hi + 1].max())

    # -- pieces --------------------------------------------------------------------------

    def entry_class(self, ci: int, kind: int) -> tuple[bool, ...]:
        """Whether a piece starting at cut ``ci`` holds each classed crossing storage."""
        crossing = self.crossing[ci]
        if kind == REGION:
            return tuple(True for _ in self.classed[ci])
        return tuple(crossing[k].right_end > crossing[k].fixed_end for k in self.classed[ci])

    def classes(self, cj: int) -> list[tuple[bool, ...]]:
        """The entry classes of the pieces that can start at cut ``cj`` (sorted)."""
        if cj == len(self.cuts) - 1:
            return [()]
        return sorted({self.entry_class(cj, REGION), self.entry_class(cj, OUTSIDE)})

    def start_key(self) -> Key:
        """The state at position 0."""
        return ((), ())

    def _covers(self, end: int, fixed_end: int, q: int, size: int) -> int:
        """``size`` if the range ``[fixed_end + 1, end]`` covers ``nest(q)``, 0 if it misses it;
        a partial cover would break the DP and is refused."""
        if q == self.n or end < q:
            return 0
        if fixed_end + 1 <= q and end >= self.inner_end[q]:
            return size
        raise SolverError(
            f"a storage is alive on part of the slots after position {q} only; the memory "
            "does not split there (a bug in dp_chain's cut selection)."
        )

    def _max_with_adds(self, lo: int, hi: int, adds: list[tuple[int, int, int]]) -> int:
        """Max over slots ``lo..hi`` of base plus the ``(first, last, bytes)`` ranges."""
        if lo > hi:
            return _NEG
        points = {lo, hi + 1}
        for first, last, _ in adds:
            if lo < first <= hi:
                points.add(first)
            if lo <= last < hi:
                points.add(last + 1)
        best = _NEG
        bounds = sorted(points)
        for u, v in pairwise(bounds):
            extra = sum(size for first, last, size in adds if first <= u <= last)
            best = max(best, self.rmq(u, v - 1) + extra)
        return best

    def evaluate(
        self, ci: int, cj: int, kind: int, exit_before: tuple[int, ...], next_class: tuple
    ) -> Evaluation:
        """The piece ``[cuts[ci], cuts[cj])`` (a region, or the outside segment ``ci`` when
        ``cj == ci + 1``) after a piece with exit ``exit_before``, before a piece of entry
        class ``next_class``."""
        p, q = self.cuts[ci], self.cuts[cj]
        last_cut = cj == len(self.cuts) - 1
        f_hi = self.n if last_cut else q - 1  # the forward slots (and bwd_start at the end)
        b_lo, b_hi = self.inner_end[q] + 1, self.inner_end[p]
        adds: list[tuple[int, int, int]] = []
        kept = 0
        after = self.crossing[cj]
        bits = dict(zip(self.classed[cj], next_class))
        if kind == OUTSIDE:
            for c, x in zip(self.crossing[ci], exit_before):
                end = max(c.fixed_end, x, c.right_end)
                adds.append((c.fixed_end + 1, end, c.size))
                kept += self._covers(end, c.fixed_end, q, c.size)
            for c in self.internal[ci]:
                end = max(c.fixed_end, c.own_end)
                adds.append((c.fixed_end + 1, end, c.size))
                kept += self._covers(end, c.fixed_end, q, c.size)
            for k, c in enumerate(after):
                end = max(c.fixed_end, c.left_end, q if bits.get(k) else -1)
                adds.append((c.fixed_end + 1, end, c.size))
            need = max(self._max_with_adds(p, f_hi, adds), self._max_with_adds(b_lo, b_hi, adds))
            exit_after = tuple(c.left_end for c in after)
            return Evaluation(need, kept, 0.0, exit_after)

        region = self.region[ci][cj]
        if region is None:
            raise SolverError(f"no region data for {p}..{q}; a bug.")
        release = region.release
        e = self.first_packer_end[ci]
        full = at_release = 0
        for c, x in zip(self.crossing[ci], exit_before):
            end = max(c.fixed_end, x, release)
            adds.append((c.fixed_end + 1, end, c.size))
            if end >= b_hi:
                full += c.size
            elif end == e and end >= b_lo:
                at_release += c.size
            elif end >= b_lo:
                raise SolverError("a crossing storage ends inside a region's backward; a bug.")
            kept += self._covers(end, c.fixed_end, q, c.size)
        for k, c in enumerate(after):
            if bits.get(k):
                adds.append((c.fixed_end + 1, q, c.size))
        need = self._max_with_adds(p, f_hi, adds)
        rmq = self.rmq
        if b_lo <= b_hi:
            rs = region.replay_slot
            if rs < 0:
                if at_release:
                    need = max(
                        need,
                        rmq(b_lo, min(e, b_hi)) + full + at_release,
                        rmq(max(e + 1, b_lo), b_hi) + full,
                    )
                else:
                    need = max(need, rmq(b_lo, b_hi) + full)
            else:
                after_replay = self.after_replay[ci]
                if after_replay is None or not b_lo <= rs < e <= b_hi:
                    raise SolverError(f"region {p}..{q}: replay slots out of place; a bug.")
                need = max(
                    need,
                    rmq(b_lo, rs - 1) + full + at_release,
                    self.base[rs] + region.replay_peak + full + at_release,
                    int(after_replay[rs]) + full + at_release,
                    self.after_release[ci] + full,
                )
        return Evaluation(need, kept, region.cost_s, tuple(-1 for _ in after))

    def pieces(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """A schedule's regions as pieces ``(ci, cj, kind)``.

        Raises:
            SolverError: if a region boundary is not one of the model's cuts.
        """
        where = {c: k for k, c in enumerate(self.cuts)}
        pieces: list[tuple[int, int, int]] = []
        k = 0
        for a, b in sorted(spans):
            if a not in where or b not in where:
                raise SolverError(f"region {a}..{b} does not start and stop at the model's cuts.")
            while self.cuts[k] < a:
                pieces.append((k, k + 1, OUTSIDE))
                k += 1
            pieces.append((k, where[b], REGION))
            k = where[b]
        while k < len(self.cuts) - 1:
            pieces.append((k, k + 1, OUTSIDE))
            k += 1
        return pieces

    def predict(self, spans: Sequence[tuple[int, int]]) -> tuple[int, float]:
        """Peak bytes and recompute time of the schedule with these region spans, as the DP
        computes them (the tests check them against the simulator)."""
        pieces = self.pieces(spans)
        kept, peak, cost = 0, 0, 0.0
        exit_before: tuple[int, ...] = ()
        for t, (ci, cj, kind) in enumerate(pieces):
            following = pieces[t + 1] if t + 1 < len(pieces) else None
            next_class = (
                self.entry_class(following[0], following[2]) if following is not None else ()
            )
            ev = self.evaluate(ci, cj, kind, exit_before, next_class)
            peak = max(peak, kept + ev.need)
            kept += ev.kept
            cost += ev.cost_s
            exit_before = ev.exit
        return peak, cost


@dataclass(frozen=True)
class _Storages:
    """The forward storages of a graph and the ops that read and save them.

    Attributes:
        owner_idx: storage -> index of the op that allocates it.
        size: bytes of every output and own saved buffer.
        births: per op, the storages it allocates.
        reads: per op, the storages its inputs refer to.
        readers: storage -> ops reading it; savers: storage -> ops saving it.
        step_outputs: storages the step returns (alive to the end under every schedule).
        spans: ``(owner, last reader or saver, storage)`` of every storage whose life a
            schedule can extend, by owner.
    """

    owner_idx: dict[str, int]
    size: dict[str, int]
    births: list[list[tuple[str, int]]]
    reads: list[set[str]]
    readers: dict[str, list[int]]
    savers: dict[str, list[int]]
    step_outputs: set[str]
    spans: list[tuple[int, int, str]]


def _scan(graph: CostGraph, order: list[str]) -> _Storages:
    nodes = graph.nodes
    index = {v: i for i, v in enumerate(order)}
    owner_idx = {sid: index[o] for sid, o in storage_owners(graph).items()}
    refs = {v: storage_refs(graph, v) for v in order}
    size: dict[str, int] = {}
    births: list[list[tuple[str, int]]] = [[] for _ in order]
    reads: list[set[str]] = [set() for _ in order]
    readers: dict[str, list[int]] = {}
    savers: dict[str, list[int]] = {}
    for i, v in enumerate(order):
        attrs = nodes[v]
        for sid, nbytes in attrs["outputs"].items():
            size[sid] = nbytes
            births[i].append((sid, nbytes))
        for sid, nbytes in attrs["saved"].items():
            if owner_idx[sid] == i and sid not in attrs["outputs"]:
                size[sid] = nbytes
                births[i].append((sid, nbytes))
            savers.setdefault(sid, []).append(i)
        for u in graph.predecessors(v):
            for sid in refs[u]:
                reads[i].add(sid)
                readers.setdefault(sid, []).append(i)
    step_outputs = {sid for out in graph.graph["outputs"] for sid in refs[out]}
    spans = []
    for sid in sorted(size, key=lambda s: (owner_idx[s], s)):
        holders = set(readers.get(sid, ())) | set(savers.get(sid, ()))
        if holders and sid not in step_outputs:
            o = owner_idx[sid]
            spans.append((o, max(holders | {o}), sid))
    return _Storages(owner_idx, size, births, reads, readers, savers, step_outputs, spans)


def _cut_set(
    graph: CostGraph, n: int, spans: list[tuple[int, int, str]]
) -> tuple[list[int], list[int]]:
    """The allowed cut positions, and the largest subset the DP can use (see
    :func:`_max_cuts`)."""
    ok = cut_positions(graph)
    allowed = [p for p in range(n + 1) if ok[p]]
    return allowed, _max_cuts(allowed, [(lo, hi) for lo, hi, _ in spans if hi > lo])


def chain_cuts(graph: CostGraph) -> tuple[tuple[int, ...], bool]:
    """The cut positions dp_chain uses on ``graph``, and whether they are all its allowed cut
    positions (then dp_chain is exact over the whole schedule model). Cheap: no slots and no
    region data are built.

    Raises:
        SolverError: for a graph dp_chain does not model (see the module docstring).
    """
    order = ordered_nodes(graph)
    _check_supported(graph, order)
    allowed, cuts = _cut_set(graph, len(order), _scan(graph, order).spans)
    return tuple(cuts), len(cuts) == len(allowed)


def _check_supported(graph: CostGraph, order: list[str]) -> None:
    for v in order:
        attrs = graph.nodes[v]
        keeps = attrs["n_saved"] > 0 or bool(attrs["saved"])
        if keeps and not (attrs["has_backward"] and attrs["n_saved"] > 0):
            raise SolverError(
                f"op {v!r} keeps tensors for a backward that never runs (or keeps activations "
                "with n_saved == 0); its tensors live to the end of the step across every "
                "piece of the chain, which dp_chain does not model; use solver 'cpsat'."
            )


def _max_cuts(allowed: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """The largest subset of ``allowed`` (0 and n always kept) with at most one cut in every
    ``(lo, hi]`` of ``spans`` (ties: the earliest cuts); all of ``allowed`` when it qualifies.
    """
    if not allowed:
        return []
    n = allowed[-1]
    # reach[p]: the furthest hi of the spans containing position p (lo < p <= hi).
    reach = list(range(n + 1))
    starts: dict[int, int] = {}
    for lo, hi in spans:
        starts[lo + 1] = max(starts.get(lo + 1, 0), hi)
    furthest = -1
    for p in range(n + 1):
        furthest = max(furthest, starts.get(p, -1))
        reach[p] = max(p, furthest)
    interior = allowed[1:-1]
    if all(reach[a] < b for a, b in pairwise(interior)):
        return allowed
    # Longest chain of interior cuts where each next cut lies beyond the previous one's reach.
    best = [1] * len(interior)
    prev = [-1] * len(interior)
    for k, b in enumerate(interior):
        for j in range(k):
            if reach[interior[j]] < b and best[j] + 1 > best[k]:
                best[k], prev[k] = best[j] + 1, j
    if not interior:
        return allowed
    k = max(range(len(interior)), key=lambda t: (best[t], -t))
    chosen = []
    while k >= 0:
        chosen.append(interior[k])
        k = prev[k]
    return [0, *sorted(chosen), n]


@dataclass
class _Front:
    """The Pareto front of one DP state: kept bytes ascending, value strictly descending,
    with where each entry came from (cut index, state index there, entry index, piece kind).
    """

    kept: np.ndarray
    value: np.ndarray
    src_cut: np.ndarray
    src_state: np.ndarray
    src_entry: np.ndarray
    kind: np.ndarray


def _prune(parts: list[tuple]) -> _Front:
    kept = np.concatenate([p[0] for p in parts])
    value = np.concatenate([p[1] for p in parts])
    src_cut = np.concatenate([np.full(len(p[0]), p[2], dtype=np.int32) for p in parts])
    src_state = np.concatenate([np.full(len(p[0]), p[3], dtype=np.int32) for p in parts])
    src_entry = np.concatenate([p[4] for p in parts])
    kind = np.concatenate([np.full(len(p[0]), p[5], dtype=np.int8) for p in parts])
    order = np.argsort(kept, kind="stable")  # ties: the earlier source first
    value_sorted = value[order]
    best_before = np.minimum.accumulate(value_sorted)
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = value_sorted[1:] < best_before[:-1]  # strictly better than everything before
    chosen = order[keep]
    # Of several survivors with equal kept bytes, the last is the cheapest: drop the others.
    last_of_group = np.ones(len(chosen), dtype=bool)
    last_of_group[:-1] = kept[chosen][1:] != kept[chosen][:-1]
    chosen = chosen[last_of_group]
    return _Front(
        kept[chosen],
        value[chosen],
        src_cut[chosen],
        src_state[chosen],
        src_entry[chosen],
        kind[chosen],
    )


class _OutOfTime(Exception):
    pass


@dataclass(frozen=True)
class DpOutcome:
    """The DP's answer.

    Attributes:
        spans: region spans of the best schedule, or None when nothing fits.
        value: its recompute time (cost DP) or peak bytes (peak DP, an int).
        predicted_peak: the peak the DP predicts for it.
        entries: Pareto entries kept over all states.
        largest_front: the largest front of one state.
        evaluations: pieces evaluated.
    """

    spans: list[tuple[int, int]] | None
    value: float | int
    predicted_peak: int
    entries: int
    largest_front: int
    evaluations: int


def run_dp(
    chain: ChainModel,
    budget_bytes: int | None,
    *,
    max_entries: int = 3_000_000,
    deadline: float | None = None,
) -> DpOutcome:
    """The DP of the module docstring.

    Args:
        chain: the chain model.
        budget_bytes: minimize the recompute time under this budget; None: minimize the peak.
        max_entries: refuse (SolverError) when the fronts hold more entries than this.
        deadline: ``time.perf_counter()`` value after which the DP gives up (``_OutOfTime``).
    """
    peak_mode = budget_bytes is None
    m = len(chain.cuts) - 1
    keys: list[list[Key]] = [[chain.start_key()]]
    fronts: list[list[_Front]] = [
        [
            _Front(
                np.zeros(1, dtype=np.int64),
                np.zeros(1, dtype=np.int64 if peak_mode else np.float64),
                np.full(1, -1, dtype=np.int32),
                np.full(1, -1, dtype=np.int32),
                np.full(1, -1, dtype=np.int64),
                np.full(1, -1, dtype=np.int8),
            )
        ]
    ]
    classes = [chain.classes(j) for j in range(m + 1)]
    # room[j]: the most bytes the pieces before cut j may keep (every slot after it sees them).
    room = [
        (budget_bytes or 0) - chain.rmq(c, chain.inner_end[c]) if c < chain.n else 1 << 62
        for c in chain.cuts
    ]
    entry = [(chain.entry_class(i, REGION), chain.entry_class(i, OUTSIDE)) for i in range(m)]
    entries = 1
    largest = 1
    evaluations = 0
    for j in range(1, m + 1):
        if deadline is not None and time.perf_counter() > deadline:
            raise _OutOfTime
        parts: dict[Key, list[tuple]] = {}
        for i in range(j):
            # The outside piece first: on a tie it wins over a one-segment region.
            kinds = (OUTSIDE, REGION) if i == j - 1 else (REGION,)
            for s, (x, e) in enumerate(keys[i]):
                front = fronts[i][s]
                for kind in kinds:
                    if entry[i][kind] != e:
                        continue
                    for e_next in classes[j]:
                        ev = chain.evaluate(i, j, kind, x, e_next)
                        evaluations += 1
                        if peak_mode:
                            count = len(front.kept)
                            value = np.maximum(front.value, front.kept + ev.need)
                        else:
                            # Every later slot sees the kept bytes: prune what cannot fit there.
                            limit = min(budget_bytes - ev.need, room[j] - ev.kept, _MAX_TOTAL)
                            count = int(np.searchsorted(front.kept, limit, side="right"))
                            if count == 0:
                                continue
                            value = front.value[:count] + ev.cost_s
                        parts.setdefault((ev.exit, e_next), []).append(
                            (
                                front.kept[:count] + ev.kept,
                                value,
                                i,
                                s,
                                np.arange(count, dtype=np.int64),
                                kind,
                            )
                        )
        keys.append(list(parts))
        fronts.append([_prune(parts[k]) for k in keys[j]])
        size = sum(len(f.kept) for f in fronts[j])
        entries += size
        largest = max([largest, *(len(f.kept) for f in fronts[j])])
        if entries > max_entries:
            raise SolverError(
                f"the DP's Pareto fronts exceed max_entries={max_entries} (at cut {j} of {m}); "
                "the exact state space is too large for dp_chain here: use solver 'cpsat'."
            )
    finals = [(s, k) for s, f in enumerate(fronts[m]) for k in range(len(f.kept))]
    if not finals:
        return DpOutcome(None, float("inf"), 0, entries, largest, evaluations)
    s, k = min(finals, key=lambda t: (fronts[m][t[0]].value[t[1]], fronts[m][t[0]].kept[t[1]]))
    value = fronts[m][s].value[k].item()  # a Python int (peak) or float (cost)
    spans: list[tuple[int, int]] = []
    j = m
    while j > 0:
        f = fronts[j][s]
        i, kind = int(f.src_cut[k]), int(f.kind[k])
        if kind == REGION:
            spans.append((chain.cuts[i], chain.cuts[j]))
        s, k, j = int(f.src_state[k]), int(f.src_entry[k]), i
    spans.reverse()
    peak, _ = chain.predict(spans)
    return DpOutcome(spans, value, peak, entries, largest, evaluations)


@register("dp_chain", "exact DP over a chain of segments (chains, DAGs at articulation points)")
@dataclass(frozen=True)
class DpChainSolver:
    """Exact dynamic program for graphs that form a chain of segments (module docstring).

    Attributes:
        require_complete: refuse graphs where not every allowed cut position can be a
            segment boundary (then the DP would be exact over a cut subset only).
        max_cuts: refuse graphs with more usable cut positions than this (the region table
            grows with their square).
        max_entries: refuse when the DP's Pareto fronts grow beyond this many entries.
    """

    require_complete: bool = False
    max_cuts: int = 1500
    max_entries: int = 3_000_000
    name: str = "dp_chain"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        start = time.perf_counter()
        chain = ChainModel(graph, require_complete=self.require_complete, max_cuts=self.max_cuts)
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, start=start)
        if trivial is not None:
            return trivial
        build_s = time.perf_counter() - start
        deadline = None if time_limit_s is None else start + time_limit_s
        stats: dict[str, Any] = {
            "complete_model": chain.complete,
            "cuts": len(chain.cuts),
            "allowed_cuts": chain.allowed,
            "build_s": build_s,
        }
        if not chain.complete:
            stats["optimal_over"] = (
                f"schedules whose region boundaries lie in the {len(chain.cuts)} cut positions "
                f"dp_chain uses (of {chain.allowed} allowed); not proven optimal overall"
            )
        try:
            outcome = run_dp(chain, budget_bytes, max_entries=self.max_entries, deadline=deadline)
            stats.update(_dp_stats(outcome))
            if outcome.spans is None:
                lowest = run_dp(chain, None, max_entries=self.max_entries, deadline=deadline)
                stats["peak_dp"] = _dp_stats(lowest)
                cheapest = run_dp(
                    chain, int(lowest.value), max_entries=self.max_entries, deadline=deadline
                )
                spans = next(s for s in (cheapest.spans, lowest.spans, []) if s is not None)
                schedule, profile = _judged(graph, chain, spans)
                stats["min_feasible_bytes"] = profile.peak_bytes
                stats["min_feasible_proven"] = chain.complete
                stats["min_feasible_lower_bytes"] = profile.peak_bytes if chain.complete else None
                optimal = False
            else:
                schedule, profile = _judged(graph, chain, outcome.spans)
                optimal = chain.complete
        except _OutOfTime:
            stats["timed_out"] = True
            fallback = GreedySolver()(graph, budget_bytes)
            stats["chosen_from"] = fallback.solver
            result = result_from_profile(
                fallback.schedule,
                simulate(graph, fallback.schedule),
                budget_bytes=budget_bytes,
                solver=self.name,
                solve_s=time.perf_counter() - start,
                stats=stats,
            )
            if not result.feasible:
                return _replace_status(result, SolveStatus.TIMED_OUT)
            return result
        stats["dp_s"] = time.perf_counter() - start - build_s
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=time.perf_counter() - start,
            bound=profile.recompute_s if optimal else None,
            proven_optimal=optimal,
            stats=stats,
        )


def _dp_stats(outcome: DpOutcome) -> dict[str, int]:
    return {
        "entries": outcome.entries,
        "largest_front": outcome.largest_front,
        "evaluations": outcome.evaluations,
    }


def _replace_status(result: SolveResult, status: SolveStatus) -> SolveResult:
    return dataclasses.replace(result, status=status)


def _judged(
    graph: CostGraph, chain: ChainModel, spans: list[tuple[int, int]]
) -> tuple[Schedule, MemoryProfile]:
    """Simulates the schedule and checks the DP's prediction.

    Raises:
        SolverError: if the simulator and the DP disagree (a bug in dp_chain).
    """
    schedule = Schedule.from_spans(graph, spans)
    profile = simulate(graph, schedule)
    peak, cost = chain.predict(spans)
    if peak != profile.peak_bytes or abs(cost - profile.recompute_s) > 1e-9 * max(1.0, cost):
        raise SolverError(
            f"dp_chain and the simulator disagree on graph {graph.graph.get('name', '')!r} for "
            f"regions {spans}: predicted peak {peak} B, recompute {cost:.6g} s; simulated peak "
            f"{profile.peak_bytes} B, recompute {profile.recompute_s:.6g} s. This is a bug in "
            "chkpt_opt; please report it."
        )
    return schedule, profile
