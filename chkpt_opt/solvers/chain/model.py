"""The chain model of dp_chain: the pieces of a schedule (a segment outside every region, or
a region over one or more segments) evaluated in every state, over the layout of
:mod:`~chkpt_opt.solvers.chain.layout` (see :mod:`chkpt_opt.solvers.chain.dp_chain`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from chkpt_opt.errors import SolverError
from chkpt_opt.solvers.base import INF_BYTES
from chkpt_opt.solvers.chain.layout import ChainLayout

REGION = 0
OUTSIDE = 1

Key = tuple[tuple[int, ...], tuple[bool, ...]]


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


class ChainModel(ChainLayout):
    """A graph as a chain of segments (:class:`~chkpt_opt.solvers.chain.layout.ChainLayout`),
    with the evaluation of every piece the DP chains."""

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
            return -INF_BYTES
        points = {lo, hi + 1}
        for first, last, _ in adds:
            if lo < first <= hi:
                points.add(first)
            if lo <= last < hi:
                points.add(last + 1)
        best = -INF_BYTES
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
