"""The layout of dp_chain's chain model: a graph cut into segments, its slots, the storages
crossing each cut or internal to a segment, and the data of every region (replay cost, peak
and release); what :class:`~chkpt_opt.solvers.chain.model.ChainModel` evaluates pieces with
(see :mod:`chkpt_opt.solvers.chain.dp_chain`)."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, region_overhead_s
from chkpt_opt.solvers.base import INF_BYTES
from chkpt_opt.solvers.chain.cuts import check_supported, cut_set, scan_storages
from chkpt_opt.solvers.chain.replay import Replay, Rmq
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.segments import last_reads


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


class ChainLayout:
    """A graph as a chain of segments: slots, storages and region data (module docstring).

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
        # The last op reading each storage (past every op for what the step returns): a
        # replay holds what an op after it reads until the replay ends.
        self.last_reader = last_reads(graph)
        self.saved_ids: list[list[str]] = [list(nodes[v]["saved"]) for v in order]
        self.workspace = [nodes[v]["fwd_workspace_bytes"] for v in order]
        self.times = [nodes[v]["fwd_time_s"] for v in order]
        readers, savers = scan.readers, scan.savers
        total = (
            2 * sum(self.size.values()) + max(self.base, default=0) + max(self.workspace, default=0)
        )
        if total >= INF_BYTES:
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
        overhead = region_overhead_s(self.graph)  # every region costs it, as simulate counts
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
                    self.region[ci][cj] = RegionData(overhead, -1, 0, release)
                    continue
                s_last = prev_saver[b - 1] if prev_saver[b - 1] >= a else a
                peak = replay.advance(last, s_last)
                cost = sum(self.times[a : last + 1]) + overhead
                self.region[ci][cj] = RegionData(cost, self.rec_slot[lp], peak, release)

        # G_a(s) = base(s) + recomputed storages owned from a on, alive at s after a replay
        # (held until their first saver's backward); kept as suffix maxima per region start.
        owned: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for sid, last in self.kept_first.items():
            owned[self.owner_idx[sid]].append((last, self.size[sid]))
        g = np.array(self.base, dtype=np.int64)
        self.after_replay: list[np.ndarray | None] = [None] * m  # max G over (s, E]
        self.after_release = [-INF_BYTES] * m  # max G over (E, inner_end(a)]
        start_of = {c: k for k, c in enumerate(cuts[:-1])}
        for a in range(n - 1, -1, -1):
            for last, size in owned[a]:
                g[: last + 1] += size
            ci = start_of.get(a)
            if ci is None or self.first_packer_end[ci] < 0:
                continue
            e = self.first_packer_end[ci]
            suffix = np.maximum.accumulate(g[: e + 1][::-1])[::-1]  # suffix[s] = max g[s..e]
            self.after_replay[ci] = np.append(suffix[1:], -INF_BYTES)  # max g over (s, e]
            hi = self.inner_end[a]
            if hi > e:
                self.after_release[ci] = int(g[e + 1 : hi + 1].max())
