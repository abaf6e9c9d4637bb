"""The chain model of dp_chain: a graph cut into segments, with what the DP needs to evaluate
every piece (a segment outside every region, or a region over one or more segments) in
every state (see :mod:`chkpt_opt.solvers.dp_chain`)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.solvers.chain_cuts import check_supported, cut_set, scan_storages
from chkpt_opt.solvers.chain_replay import NEG, Replay, Rmq
from chkpt_opt.solvers.interval_builder import build_interval_model

REGION = 0
OUTSIDE = 1
MAX_TOTAL = 1 << 62

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
        check_supported(graph, order)

        scan = scan_storages(graph, order)
        allowed, cuts = cut_set(graph, n, scan.spans)
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
        self.rmq = Rmq(self.base)

        # Storages.
        self.owner_idx = scan.owner_idx
        self.size = scan.size
        self.births = scan.births
        self.reads = scan.reads
        self.last_reader = {sid: max(ops) for sid, ops in scan.readers.items()}
        self.last_reader.update({sid: len(order) for sid in scan.step_outputs})
        self.saved_ids: list[list[str]] = [list(nodes[v]["saved"]) for v in order]
        self.workspace = [nodes[v]["fwd_workspace_bytes"] for v in order]
        self.times = [nodes[v]["fwd_time_s"] for v in order]
        readers, savers = scan.readers, scan.savers
        total = (
            2 * sum(self.size.values()) + max(self.base, default=0) + max(self.workspace, default=0)
        )
        if total >= MAX_TOTAL:
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
            else:  # max_cuts guarantees it; checked because the DP's exactness rests on it
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
            replay = Replay(self, a)
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
        self.after_release = [NEG] * m  # max G over (E, inner_end(a)]
        start_of = {c: k for k, c in enumerate(cuts[:-1])}
        for a in range(n - 1, -1, -1):
            for last, size in owned[a]:
                g[: last + 1] += size
            ci = start_of.get(a)
            if ci is None or self.first_packer_end[ci] < 0:
                continue
            e = self.first_packer_end[ci]
            suffix = np.maximum.accumulate(g[: e + 1][::-1])[::-1]  # suffix[s] = max g[s..e]
            self.after_replay[ci] = np.append(suffix[1:], NEG)  # max g over (s, e]
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
            return NEG
        points = {lo, hi + 1}
        for first, last, _ in adds:
            if lo < first <= hi:
                points.add(first)
            if lo <= last < hi:
                points.add(last + 1)
        best = NEG
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
