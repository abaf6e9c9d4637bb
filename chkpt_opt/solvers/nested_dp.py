"""The dynamic program of :mod:`chkpt_opt.solvers.dp_nested` over a simple chain
(:mod:`chkpt_opt.solvers.nested_chain`): rotor's recurrence, with the memory of every step
as :func:`chkpt_opt.op_sequence.lower` counts it.

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
the budget with the ``K`` of its entry.

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

**Space.** Every region contains a packer: a region without one is never replayed and
holds nothing a plain op would not (or, inside a replay, makes the replay run further), so
it is never better; the brute-force tests check the claim on small chains.
"""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.solvers.chain_replay import Rmq
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline
from chkpt_opt.solvers.nested_chain import NestedChain, Plan

NONE, KEY, ALWAYS = 0, 1, 2
"""How a frame's outer tensor is held past the frame's replay (see the module docstring)."""

INF_BYTES = 1 << 62


@dataclass(frozen=True)
class FrameResult:
    """The cheapest plan of a frame that fits.

    Attributes:
        cost_s: recompute time of the frame's replay and of every region inside it.
        peak: largest bytes of its steps above what the outside holds through all of them.
        plan: its child regions, each ``(start, stop, grandchildren)``.
    """

    cost_s: float
    peak: int
    plan: Plan


# A DP entry: (kept bytes K, cost, peak so far, previous entry, piece or None).
Entry = tuple


def _prune(entries: list[Entry]) -> list[Entry]:
    """The Pareto front over (kept bytes, cost): ascending bytes, strictly falling cost
    (ties: the entry found first)."""
    entries.sort(key=lambda e: (e[0], e[1]))
    front: list[Entry] = []
    for e in entries:
        if not front or e[1] < front[-1][1]:
            if front and front[-1][0] == e[0]:
                continue
            front.append(e)
    return front


def _pieces(last: Entry) -> Plan:
    plan = []
    e = last
    while e is not None and e[3] is not None:
        if e[4] is not None:
            plan.append(e[4])
        e = e[3]
    return tuple(reversed(plan))


class NestedDp:
    """The DP of the module docstring over one chain.

    Args:
        chain: the chain's facts.
        deadline: every frame solve checks it (``DeadlineExceeded``).
        forced: evaluate one plan instead of optimizing: per frame span (``None`` for the
            top frame), the child regions it must have; every other op is plain.
    """

    def __init__(
        self,
        chain: NestedChain,
        *,
        deadline: Deadline = NO_DEADLINE,
        forced: dict[tuple[int, int] | None, set[tuple[int, int]]] | None = None,
    ) -> None:
        c = self.c = chain
        self.deadline = deadline
        self.forced = forced
        self.cuts = [p for p in range(c.n + 1) if c.ok[p]]
        body = [c.w[i] + c.a[i] + (c.a[i - 1] if i else 0) for i in range(c.n)]
        self.body = Rmq(body)
        self.bwd = Rmq(list(c.bwd_base))
        self.memo: dict[tuple, list[tuple[int, int, FrameResult]]] = {}
        self.infeasible: dict[tuple, int] = {}
        self.frames_solved = 0

    # -- helpers ---------------------------------------------------------------------------

    def run_peak(self, p: int, q: int) -> int:
        """Largest bytes of the run of ops ``p..q-1`` (their own tensors and workspaces,
        without the input of op ``p``) when nothing inside is kept."""
        c = self.c
        return max(c.w[p] + c.a[p], self.body(p + 1, q - 1))

    def children_at(self, a: int, b: int, p: int) -> list[int]:
        """Ends ``q`` of the child regions of frame ``[a, b)`` (``None``: top) that may start
        at ``p``."""
        c = self.c
        if self.forced is not None:
            spans = self.forced.get((a, b) if a >= 0 else None, set())
            ends = [q for s, q in sorted(spans) if s == p]
            if any(c.fp[p] >= q for q in ends):
                raise SolverError(
                    f"the region at ops {p}..{ends[0] - 1} holds no op that saves anything; "
                    "it lies outside dp_nested's space (it never helps: make its ops plain)."
                )
            return ends
        if not c.ok[p]:
            return []
        lo = max(p + 1, c.fp[p] + 1)
        top = a < 0
        return [q for q in self.cuts if lo <= q <= b and (top or (p, q) != (a, b))]

    def plain_allowed(self, a: int, b: int, p: int) -> bool:
        if self.forced is None:
            return True
        spans = self.forced.get((a, b) if a >= 0 else None, set())
        return not any(s == p for s, _ in spans)

    # -- a region's frame -----------------------------------------------------------------

    def frame(
        self, a: int, b: int, mode: int, eb: int, eth: int, tail_done: bool, m: int
    ) -> FrameResult | None:
        """The cheapest plan of region ``[a, b)``'s frame within ``m`` bytes (see the module
        docstring), or None."""
        c = self.c
        if c.sin[a] or (mode == KEY and c.fp[a] <= a):
            mode = ALWAYS
        if eb and eth <= a:
            m -= eb
            eb = 0
        if not eb or eth >= b:
            eb, eth = 0, 0
        if m < 0:
            return None
        key = (a, b, mode, eb, eth, tail_done)
        if m <= self.infeasible.get(key, -1):
            return None
        for lo, hi, result in self.memo.get(key, ()):
            if lo <= m <= hi:
                return result
        self.deadline.check("dp_nested's DP")
        result = self._solve_frame(a, b, mode, eb, eth, tail_done, m)
        self.frames_solved += 1
        if result is None:
            self.infeasible[key] = max(m, self.infeasible.get(key, -1))
        else:
            self.memo.setdefault(key, []).append((result.peak, m, result))
        return result

    def _solve_frame(
        self, a: int, b: int, mode: int, eb: int, eth: int, tail_done: bool, m: int
    ) -> FrameResult | None:
        c = self.c
        last = c.lp[b]
        if last < a:
            raise SolverError(f"region {a}..{b} holds no packer; a bug in dp_nested.")
        ob = c.inp(a)
        tail_peak = 0
        if not tail_done and last < b - 1:
            lo_hi = min(b - 1, eth - 1) if eb else b - 1
            tail_peak = self.bwd(last + 1, lo_hi) + ob
            if eb:
                tail_peak = max(tail_peak, self.bwd(max(last + 1, eth), b - 1) + ob + eb)
            if tail_peak > m:
                return None
        rec_const = c.rec_base[last] + ob + (eb if eb and last >= eth else 0)
        key_th = c.fp[a]
        start: Entry = (0, 0.0, 0, None, None)
        pending: dict[int, dict[tuple[bool, bool], list[Entry]]] = {a: {(False, False): [start]}}
        finals: list[Entry] = []
        for p in range(a, b):
            states = pending.pop(p, None)
            if not states:
                continue
            for (ih, h1), cands in sorted(states.items()):
                for entry in _prune(cands):
                    k_held, cost, peak = entry[0], entry[1], entry[2]
                    if self.plain_allowed(a, b, p):
                        self._plain(
                            a,
                            b,
                            p,
                            last,
                            mode,
                            eb,
                            eth,
                            h1,
                            ih,
                            entry,
                            m,
                            rec_const,
                            key_th,
                            ob,
                            pending,
                            finals,
                        )
                    for q in self.children_at(a, b, p):
                        star = q > last
                        if p == a:
                            mode_c, const = mode, 0
                            ext = (0, 0)
                        else:
                            mode_c = ALWAYS if ih else NONE
                            const, ext = 0, (0, 0)
                            if mode == ALWAYS or h1:
                                const += ob
                            elif mode == KEY:
                                const, ext = _split(ob, key_th, p, q, const, ext)
                        if eb:
                            const, ext = _split(eb, eth, p, q, const, ext)
                        run = 0
                        if not star:
                            run = rec_const + k_held + (c.a[p - 1] if p > a else 0)
                            run += self.run_peak(p, q)
                            if run > m:
                                continue
                        sub = self.frame(p, q, mode_c, ext[0], ext[1], star, m - k_held - const)
                        if sub is None:
                            continue
                        new = (
                            k_held + (c.a[p - 1] if p > a else 0),
                            cost + (0.0 if star else c.run_time_s(p, q)) + sub.cost_s,
                            max(peak, run, sub.peak + k_held + const),
                            entry,
                            (p, q, sub.plan),
                        )
                        state = (False, True if p == a else h1)
                        if star:
                            finals.append(new)
                        else:
                            pending.setdefault(q, {}).setdefault(state, []).append(new)
        if not finals:
            return None
        best = min(finals, key=lambda e: (e[1], e[2]))
        return FrameResult(best[1], max(best[2], tail_peak), _pieces(best))

    def _plain(
        self, a, b, p, last, mode, eb, eth, h1, ih, entry, m, rec_const, key_th, ob, pending, finals
    ) -> None:
        """Extends ``entry`` by op ``p`` as a plain op of frame ``[a, b)``."""
        c = self.c
        if p > last:
            raise SolverError(f"op {p} lies past the last packer of {a}..{b}; a bug.")
        k_held, cost, peak = entry[0], entry[1], entry[2]
        runs = p < last or c.sout[p]
        inp = c.a[p - 1] if p > a else 0
        steps = []
        if runs:
            steps.append(rec_const + c.w[p] + k_held + inp + c.a[p])
        o_alive = mode == ALWAYS or (p > a and (h1 or (mode == KEY and p >= key_th)))
        held_in = p > a and (ih or c.sin[p])
        steps.append(
            c.bwd_base[p]
            + (ob if o_alive else 0)
            + (eb if eb and p >= eth else 0)
            + k_held
            + (inp if held_in else 0)
            + (c.a[p] if c.sout[p] else 0)
        )
        need = max(steps)
        if need > m:
            return
        new = (
            k_held + (inp if held_in else 0),
            cost + (c.t[p] if runs else 0.0),
            max(peak, need),
            entry,
            None,
        )
        if p == last:
            finals.append(new)
        else:
            state = (c.sout[p], False if p == a else h1)
            pending.setdefault(p + 1, {}).setdefault(state, []).append(new)

    # -- the top frame --------------------------------------------------------------------

    def top(self, budget_bytes: int) -> tuple[float, int, Plan] | None:
        """The cheapest plan of the whole chain within ``budget_bytes``: (recompute time,
        predicted peak, outermost regions), or None."""
        c = self.c
        n = c.n
        start: Entry = (0, 0.0, 0, None, None)
        pending: dict[int, dict[bool, list[Entry]]] = {0: {False: [start]}}
        for p in range(n):
            self.deadline.check("dp_nested's DP")
            states = pending.pop(p, None)
            if not states:
                continue
            for ih, cands in sorted(states.items()):
                for entry in _prune(cands):
                    k_held, cost, peak = entry[0], entry[1], entry[2]
                    inp = c.inp(p)
                    if self.plain_allowed(-1, n, p):
                        held_in = p > 0 and (ih or c.sin[p])
                        need = max(
                            c.w[p] + k_held + inp + c.a[p],
                            c.bwd_base[p]
                            + k_held
                            + (inp if held_in else 0)
                            + (c.a[p] if c.sout[p] and p < n - 1 else 0),
                        )
                        if need <= budget_bytes:
                            new = (
                                k_held + (inp if held_in else 0),
                                cost,
                                max(peak, need),
                                entry,
                                None,
                            )
                            state = bool(c.sout[p]) and p < n - 1
                            pending.setdefault(p + 1, {}).setdefault(state, []).append(new)
                    for q in self.children_at(-1, n, p):
                        run = k_held + inp + self.run_peak(p, q)
                        if run > budget_bytes:
                            continue
                        mode = ALWAYS if ih else KEY
                        sub = self.frame(p, q, mode, 0, 0, False, budget_bytes - k_held)
                        if sub is None:
                            continue
                        new = (
                            k_held + inp,
                            cost + sub.cost_s,
                            max(peak, run, sub.peak + k_held),
                            entry,
                            (p, q, sub.plan),
                        )
                        pending.setdefault(q, {}).setdefault(False, []).append(new)
        finals = []
        for cands in pending.get(n, {}).values():
            for e in cands:
                start_step = c.cb + e[0]  # bwd_start: what the forward pass keeps
                if start_step <= budget_bytes:
                    finals.append((e[0], e[1], max(e[2], start_step), e[3], e[4], e))
        if not finals:
            return None
        best = min(finals, key=lambda e: (e[1], e[2]))
        return best[1], best[2], _pieces(best[5])


def _split(
    nbytes: int, th: int, p: int, q: int, const: int, ext: tuple[int, int]
) -> tuple[int, tuple[int, int]]:
    """Adds a tensor alive at the steps handling ops ``>= th`` to a child ``[p, q)``: to its
    constant bytes (all of its steps), to nothing, or as its one partial tensor."""
    if th <= p:
        return const + nbytes, ext
    if th >= q:
        return const, ext
    if ext[0]:
        raise SolverError("two outer tensors alive on part of a region's steps; a bug.")
    return const, (nbytes, th)
