"""The dynamic program of :mod:`chkpt_opt.solvers.nested.dp_nested` over a simple chain
(:mod:`chkpt_opt.solvers.nested.unit_chain`) or a chain of blocks
(:mod:`chkpt_opt.solvers.nested.separator_chain`): rotor's recurrence, with the memory of every
step as :func:`chkpt_opt.memory_model.op_sequence.lower` counts it. Below, an op is a unit of the
chain (a block's own tail before its last packer runs before the replay, with the tail).

**Frames.** The top frame runs the forward pass; a region's frame is its replay. Either
one is a partition of its span into *pieces*: plain ops (they save what their backward
needs, in that frame) and child regions (nested non-reentrant checkpoints). A frame runs
its pieces in order (the forward pass, or the replay up to its early stop), then their
*sections* in reverse: a plain op's section is its backward step; a child's is the child's
frame (its replay, then its pieces' sections). So everything a later piece does nests
between an earlier piece's run and its section, and what the earlier pieces hold through it
is a sum ``K`` of *boundary tensors*: the output of op ``p - 1`` is held past its reader
when op ``p - 1`` is a plain op saving its output (until its backward: the state ``Ih`` at
``p``) or the piece starting at ``p`` holds it (a plain op saving its input, or a child
region, which keeps its input until its replay ends). A frame's DP keeps, per position and
state, the Pareto front of (``K``, recompute time); every step of a piece is checked against
the budget with the ``K`` of its entry. Over blocks, a plain piece other than a region's
first op and its last packer may run one of the block's options instead
(:mod:`~chkpt_opt.solvers.nested.unit_options`: the block's own regions, nested there).

**A region's own frame** (what lower does): its replay is triggered before the backward of
its last packer ``L`` (the last op in it that saves anything), runs from its first op up to
that packer (included if it saves its own output) or up to the child holding it (excluded),
and keeps its input (the *outer* tensor ``O``) until the replay ends. The backward steps of
the ops after ``L`` (the *tail*, none of which saves anything) run before the replay of the
outermost region with that last packer. Past its replay, ``O`` is alive where its holders
say: the piece before the region in its parent (``ALWAYS``), the op at the region's start
saving its input (``ALWAYS``), the first child (until that child's replay ends), and for an
outermost region its checkpoint until the backward of its first packer (``KEY``: the steps
handling ops from that packer on). A frame receives how ``O`` is held from outside
(``mode``) and at most one outer tensor alive on part of its steps (``ext``: bytes alive
at the steps handling ops from ``ext_th`` on), and the bytes ``m`` left above what the
outside holds at all of its steps. Its value is the cheapest plan whose steps fit ``m``;
memoized per frame over ranges of ``m`` (a plan that is optimal for ``m`` and peaks at
``P`` is optimal for every budget in ``[P, m]``).

**Runs.** A region also *runs* inside enclosing runs: in the forward pass and in each
outer replay that reaches it, as a checkpoint holding nothing, its ops one after another,
while the code calling each region nested in it holds that region's input until it returns
(:func:`chkpt_opt.memory_model.op_sequence.lower`). What a run needs above its caller's bytes and
its own input (``FrameResult.run_peak``) depends on the region's plan, so a frame is also given
its *run room* ``r``, the least room of the runs it takes part in, and its plan must fit
it. Frames are memoized over boxes of (budget, run room); a room that turned nothing away,
here or in the regions inside, holds for any larger room
(:class:`~chkpt_opt.solvers.nested.fronts.FrameMemo`). Minimizing the peak, each frame's
plan is chosen by its own steps, which may leave a lower peak with a leaner run unfound;
``dp_nested`` proves the lowest peak with this DP under a budget one byte below it.

**Space.** Every region contains a packer: a region without one is never replayed and
holds nothing a plain op would not (or, inside a replay, makes the replay run further), so
it is never better; the brute-force tests check the claim on small chains.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.solvers.base import INF_BYTES
from chkpt_opt.solvers.chain.replay import Rmq
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.nested.fronts import (
    Entry,
    FrameMemo,
    FrameResult,
    Way,
    piece_end,
    pieces,
    plain_ways,
    prune,
    run_peak,
    split_outer,
    tail_run_bytes,
)
from chkpt_opt.solvers.nested.unit_chain import NestedChain

NONE, KEY, ALWAYS = 0, 1, 2
"""How a frame's outer tensor is held past the frame's replay (see the module docstring)."""


@dataclass(frozen=True)
class _Frame:
    """What the pieces of one frame ``[a, b)`` are evaluated with (module docstring)."""

    a: int
    b: int
    last: int  # its last packer (its replay's trigger)
    mode: int  # how its outer tensor is held from outside
    ob: int  # bytes of its outer tensor
    eb: int  # bytes of the outer tensor alive on part of its steps (0: none)
    eth: int  # ... at the steps handling ops from this one on
    rec_const: int  # bytes at each step of its replay besides the ops' own
    m: int  # bytes left above the outside
    r: int  # bytes left for its run inside enclosing runs (FrameResult.run_peak)


class NestedDp:
    """The DP of the module docstring over one chain.

    Args:
        chain: the chain's facts.
        deadline: every frame solve checks it (``DeadlineExceeded``).
        minimize_peak: find the lowest peak (ties: the cheapest) instead of the cheapest
            plan within a budget.
        cuts: the positions where regions may begin and end (allowed cuts of the chain;
            all of them by default).
        forced: evaluate one plan instead of optimizing: per frame span (``None`` for the
            top frame), the child regions it must have; every other op is plain, or runs
            the option ``forced_picks`` names for it there (per frame span, unit: index).
    """

    def __init__(
        self,
        chain: NestedChain,
        *,
        deadline: Deadline = NO_DEADLINE,
        minimize_peak: bool = False,
        forced: dict[tuple[int, int] | None, set[tuple[int, int]]] | None = None,
        forced_picks: dict[tuple[int, int] | None, dict[int, int]] | None = None,
        cuts: list[int] | None = None,
    ) -> None:
        c = self.c = chain
        self.deadline = deadline
        self.peak_mode = minimize_peak
        self.forced = forced
        self.forced_picks = forced_picks or {}
        self.cuts = [p for p in range(c.n + 1) if c.ok[p]] if cuts is None else list(cuts)
        usable = set(self.cuts)
        self.body = [c.w_run[i] + c.a[i] + (c.a[i - 1] if i else 0) for i in range(c.n)]
        # The least backward bytes of each unit, plain or running one of its options.
        self.bwd_min = [min([c.bwd_base[i], *(o.bwd for o in c.options_of(i))]) for i in range(c.n)]
        self.bwd = Rmq(self.bwd_min)
        # Bounds on a region's last packer's backward parts, no larger than the unit's
        # least backward when options may run it (so that they grow with the region).
        self.post_lb = [
            min(c.bwd_post[i], self.bwd_min[i]) if c.options_of(i) else c.bwd_post[i]
            for i in range(c.n)
        ]
        self.pre_lb = [
            min(c.bwd_pre[i], self.bwd_min[i]) if c.options_of(i) else c.bwd_pre[i]
            for i in range(c.n)
        ]
        # ends[p]: where a region starting at p may stop (it must hold a packer).
        self.ends = [
            [q for q in self.cuts if q > c.fp[p]] if p < c.n and p in usable else []
            for p in range(c.n + 1)
        ]
        self.ways_inner, self.ways_last = plain_ways(c)  # (see _ways)
        self.memo = FrameMemo()
        self.runs: dict = {}  # run_peak's memo
        self.run_limited = 0  # how often a run room has turned a plan away
        self.run_hi = INF_BYTES  # the largest run room the last frame() answer holds for
        self.frames_solved = 0

    # -- helpers ---------------------------------------------------------------------------

    def children_at(self, a: int, b: int, p: int) -> list[int]:
        """Ends of the child regions of frame ``[a, b)`` (``a < 0``: the top frame) that
        may start at ``p``, ascending."""
        if self.forced is None:
            ends = self.ends[p]
            stop = bisect_right(ends, b)
            return ends[: stop - 1] if p == a and stop and ends[stop - 1] == b else ends[:stop]
        spans = self.forced.get((a, b) if a >= 0 else None, set())
        return [q for s, q in sorted(spans) if s == p]

    def unit_ways(self, a: int, b: int, p: int) -> tuple[bool, list[int]]:
        """Whether unit ``p``, a plain piece of frame ``[a, b)`` (``a < 0``: the top frame),
        may run as it is, and the options it may run instead."""
        if self.forced is None:
            return True, list(range(len(self.c.options_of(p))))
        pick = self.forced_picks.get((a, b) if a >= 0 else None, {}).get(p)
        return pick is None, [] if pick is None else [pick]

    def plain_allowed(self, a: int, b: int, p: int) -> bool:
        if self.forced is None:
            return True
        spans = self.forced.get((a, b) if a >= 0 else None, set())
        return not any(s == p for s, _ in spans)

    def extend(
        self, entry: Entry, kept: int, need: int, cost_s: float, piece: tuple | None
    ) -> Entry:
        """``entry`` followed by a piece that keeps ``kept`` bytes more for what follows,
        peaks at ``need`` and costs ``cost_s``."""
        peak = max(entry[2], need)
        cost = entry[3] + cost_s
        return (entry[0] + kept, peak if self.peak_mode else cost, peak, cost, entry, piece)

    # -- a region's frame -----------------------------------------------------------------

    def frame(
        self, a: int, b: int, mode: int, eb: int, eth: int, tail_done: bool, m: int, r: int
    ) -> FrameResult | None:
        """The best plan of region ``[a, b)``'s frame within ``m`` bytes whose run inside
        enclosing runs needs at most ``r`` bytes (see the module docstring), or None."""
        c = self.c
        if c.sin[a] or (mode == KEY and c.fp[a] <= a):
            mode = ALWAYS
        if eb and eth <= a:
            m -= eb
            eb = 0
        if not eb or eth >= b:
            eb, eth = 0, 0
        if c.lp[b] == b - 1 and c.bwd_pre[b - 1] == -INF_BYTES:
            tail_done = False  # no tail: nothing to hoist
        if m < 0:
            return None
        if r < 0:
            self.run_limited += 1
            return None
        key = (a, b, mode, eb, eth, tail_done)
        hit, result, self.run_hi = self.memo.lookup(key, m, r)
        if hit:
            self.run_limited += self.run_hi < INF_BYTES
            return result
        self.deadline.check("dp_nested's DP")
        before = self.run_limited
        result = self._solve_frame(a, b, mode, eb, eth, tail_done, m, r)
        self.frames_solved += 1
        # Where the run room turned nothing away (here or in the regions inside), the
        # answer is the same with any larger room.
        self.run_hi = r if self.run_limited > before else INF_BYTES
        # No plan of the frame is cheaper than its replay with every op plain: that result
        # holds for every larger budget and run room too (minimizing cost).
        last = c.lp[b]
        floor = c.replay_time_s(a, last)
        least = not self.peak_mode and result is not None and result.cost_s <= floor * (1 + 1e-12)
        self.memo.store(key, m, self.run_hi, result, least=least)
        return result

    def _solve_frame(
        self, a: int, b: int, mode: int, eb: int, eth: int, tail_done: bool, m: int, r: int
    ) -> FrameResult | None:
        c = self.c
        last = c.lp[b]
        if last < a:
            raise SolverError(f"region {a}..{b} holds no packer; a bug in dp_nested.")
        ob = c.inp(a)
        tail_peak = 0
        pre = c.bwd_pre[last]  # the last packer's own tail (steps of a block after it)
        if not tail_done and (last < b - 1 or pre > -INF_BYTES):
            tail_peak = self.bwd(last + 1, min(b - 1, eth - 1) if eb else b - 1) + ob
            if eb:
                tail_peak = max(tail_peak, self.bwd(max(last + 1, eth), b - 1) + ob + eb)
            if pre > -INF_BYTES:
                tail_peak = max(tail_peak, pre + ob + (eb if eb and last >= eth else 0))
            if tail_peak > m:
                return None
        rec_const = c.rec_base[last] + ob + (eb if eb and last >= eth else 0)
        f = _Frame(a, b, last, mode, ob, eb, eth, rec_const, m, r)
        start: Entry = (0, 0.0, 0, 0.0, None, None)
        pending: dict[int, dict[tuple[bool, bool], list[Entry]]] = {a: {(False, False): [start]}}
        finals: list[Entry] = []
        for p in range(a, b):
            states = pending.pop(p, None)
            if not states:
                continue
            plain = self.plain_allowed(a, b, p)
            ends = self.children_at(a, b, p)
            for (ih, h1), cands in sorted(states.items()):
                if not cands:  # a bucket a child opened and nothing fitted
                    continue
                front = prune(cands)
                if plain:
                    self._plain(f, p, ih, h1, front, pending, finals)
                if ends:
                    self._children(f, p, ih, h1, front, ends, pending, finals)
        # The ops after the last piece run at this level when the region runs.
        fits = [e for e in finals if tail_run_bytes(c.w_run, c.a, a, piece_end(e, last), b) <= r]
        self.run_limited += len(fits) < len(finals)
        finals = fits
        if not finals:
            return None
        best = min(finals, key=lambda e: (e[1], e[2], e[3]))
        plan = pieces(best)
        run = run_peak(c.w_run, c.a, a, b, plan, self.runs, c.options)
        return FrameResult(best[3], max(best[2], tail_peak), plan, run)

    def _ways(self, f: _Frame, p: int) -> list[Way]:
        """The ways plain unit ``p`` may run in frame ``f``: ``(piece, w, w_run, e, sin,
        sout, bwd, cost_s)`` as it is (``piece`` None) and, neither the frame's first op
        nor its last packer, with each of its options (``piece`` ``(p, k)``)."""
        a, last = f.a, f.last
        if self.forced is None:
            if p == last:
                return self.ways_last[p]
            return self.ways_inner[p] if p > a else self.ways_inner[p][:1]
        as_is, picks = self.unit_ways(a, f.b, p)
        if picks and not a < p < last:
            raise SolverError(f"unit {p} runs an option as a region's first or last packer.")
        ways = [(self.ways_last if p == last else self.ways_inner)[p][0]] if as_is else []
        return ways + [self.ways_inner[p][1 + k] for k in picks]

    def _plain(
        self,
        f: _Frame,
        p: int,
        ih: bool,
        h1: bool,
        front: list[Entry],
        pending: dict[int, dict[tuple[bool, bool], list[Entry]]],
        finals: list[Entry],
    ) -> None:
        """Extends each entry of ``front`` (kept bytes ascending) by op ``p`` as a plain op
        of frame ``f``: as it is, or (neither the frame's first nor its last packer) running
        one of its options."""
        c = self.c
        a, last, mode = f.a, f.last, f.mode
        if p > last:
            raise SolverError(f"op {p} lies past the last packer of {a}..{f.b}; a bug.")
        runs = p < last or c.sown[p]
        out = c.a[p]
        inp = c.a[p - 1] if p > a else 0
        o_alive = mode == ALWAYS or (p > a and (h1 or (mode == KEY and p >= c.fp[a])))
        outer = (f.ob if o_alive else 0) + (f.eb if f.eb and p >= f.eth else 0)
        peak_mode = self.peak_mode
        for piece, w, w_run, e, sin, sout, bwd, cost in self._ways(f, p):
            if w_run + out + inp > f.r:  # its run inside the frame's run
                self.run_limited += 1
                continue
            held = inp if p > a and (ih or sin) else 0
            # Its steps' bytes besides what the pieces before it keep.
            need = bwd + outer + held + (out if sout else 0)
            if runs:
                need = max(need, f.rec_const + w + inp + out)
            room = f.m - need
            if front[0][0] > room:
                continue
            if p == last:
                bucket = finals
            else:
                state = (sout, False if p == a else h1)
                bucket = pending.setdefault(p + 1, {}).setdefault(state, [])
            # What it holds for the pieces after it: its input where held, its own buffers.
            kept = held + e
            for entry in front:  # (self.extend, inlined: the DP's innermost loop)
                k_held = entry[0]
                if k_held > room:
                    break  # the kept bytes only grow along the front
                peak = entry[2] if entry[2] > need + k_held else need + k_held
                total = entry[3] + cost
                bucket.append(
                    (k_held + kept, peak if peak_mode else total, peak, total, entry, piece)
                )

    def _children(
        self,
        f: _Frame,
        p: int,
        ih: bool,
        h1: bool,
        front: list[Entry],
        ends: list[int],
        pending: dict[int, dict[tuple[bool, bool], list[Entry]]],
        finals: list[Entry],
    ) -> None:
        """Extends each entry of ``front`` (kept bytes ascending) by each child region
        ``[p, q)`` of frame ``f``, ``q`` in ``ends`` (ascending)."""
        c = self.c
        a, mode, ob, m = f.a, f.mode, f.ob, f.m
        peak_mode = self.peak_mode
        inp = c.a[p - 1] if p > a else 0
        if p == a:  # the first child takes over the frame's outer tensor
            mode_c, const = mode, 0
        else:
            mode_c = ALWAYS if ih else NONE
            const = ob if mode == ALWAYS or h1 else 0
        partial_o = p > a and mode == KEY and not h1
        state = (False, True if p == a else h1)
        k_min = front[0][0]
        run_body = c.w_run[p] + c.a[p]
        i = p + 1  # ops p..i-1 are in run_body
        whole = -INF_BYTES  # the largest whole backward of ops p..j-1
        j = p
        for q in ends:
            while i < q:
                if self.body[i] > run_body:
                    run_body = self.body[i]
                i += 1
            while j < c.lp[q]:
                if self.bwd_min[j] > whole:
                    whole = self.bwd_min[j]
                j += 1
            star = q > f.last  # the piece holding the last packer: not run in the replay
            # What the child's steps need at least: the backward of its ops, its last
            # packer's from the replay on, and that packer's own tail unless hoisted.
            lower = max(whole, self.post_lb[j], -INF_BYTES if star else self.pre_lb[j])
            const_q, ext = const, (0, 0)
            if partial_o:
                const_q, ext = split_outer(ob, c.fp[a], p, q, const_q, ext)
            if f.eb:
                const_q, ext = split_outer(f.eb, f.eth, p, q, const_q, ext)
            room = m - const_q  # the child's bytes are this less the kept bytes
            if not peak_mode and lower > room - k_min:
                break  # every op's backward runs in the child's steps; larger q: no better
            run_base = 0 if star else f.rec_const + inp + run_body
            if run_base + k_min > m:
                continue  # (a piece holding the last packer is not run: go on to it)
            cost_run = 0.0 if star else c.run_time_s(p, q)
            bucket = finals if star else pending.setdefault(q, {}).setdefault(state, [])
            sub: FrameResult | None = None
            sub_hi = sub_run_hi = -1
            # Its run: inside this frame's run (with its input, held by this frame's code,
            # unless it starts with the frame), and inside this frame's replay unless it is
            # the piece not run there.
            run_outer = f.r - inp
            run_here = 0 if star else f.rec_const + inp
            for entry in front:
                k_held = entry[0]
                budget_c = room - k_held
                if not peak_mode and (lower > budget_c or run_base + k_held > m):
                    break  # the kept bytes only grow along the front
                run_c = run_outer if star else min(run_outer, m - run_here - k_held)
                if sub is None or not (
                    sub.peak <= budget_c <= sub_hi and sub.run_peak <= run_c <= sub_run_hi
                ):
                    sub = self.frame(p, q, mode_c, ext[0], ext[1], star, budget_c, run_c)
                    if sub is None:
                        break  # nothing fits this child with less room either
                    sub_hi, sub_run_hi = budget_c, self.run_hi
                need = sub.peak + k_held + const_q
                if not star and run_here + sub.run_peak + k_held > need:
                    need = run_here + sub.run_peak + k_held
                # (self.extend, inlined: the DP's innermost loop)
                peak = entry[2] if entry[2] > need else need
                total = entry[3] + (cost_run + sub.cost_s + c.region_s)
                piece = (p, q, sub.plan)
                bucket.append(
                    (k_held + inp, peak if peak_mode else total, peak, total, entry, piece)
                )
