"""The top frame of :mod:`chkpt_opt.solvers.nested.recurrence`'s DP: the forward pass, a partition
of the whole chain into plain ops and outermost regions (each solved as a region's frame by
:meth:`~chkpt_opt.solvers.nested.recurrence.NestedDp.frame`), closed by ``bwd_start``. Its pieces
keep what their backward needs through everything after them, as in a region's frame, but nothing
outside holds bytes and nothing of it is recomputed. A plain unit of it may run one of its
options instead (:mod:`~chkpt_opt.solvers.nested.unit_options`: regions inside the unit)."""

from __future__ import annotations

from chkpt_opt.solvers.nested.fronts import Entry, pieces, prune
from chkpt_opt.solvers.nested.recurrence import ALWAYS, KEY, NestedDp
from chkpt_opt.solvers.nested.unit_chain import Plan


def top_plan(dp: NestedDp, budget_bytes: int) -> tuple[float, int, Plan] | None:
    """The best plan of the whole chain within ``budget_bytes`` (the cheapest, or with
    ``dp.peak_mode`` the one of lowest peak; ``INF_BYTES``: no budget): (recompute time,
    predicted peak, outermost regions and the unit options it runs), or None when no plan
    fits. The chain's pinned bytes are counted at every step: the DP plans the rest within
    the budget less them."""
    c = dp.c
    n = c.n
    budget_bytes -= c.pinned_bytes
    start: Entry = (0, 0.0, 0, 0.0, None, None)
    pending: dict[int, dict[bool, list[Entry]]] = {0: {False: [start]}}
    for p in range(n):
        dp.deadline.check("dp_nested's DP")
        states = pending.pop(p, None)
        if not states:
            continue
        ends = dp.children_at(-1, n, p)
        inp = c.inp(p)
        # The unit plain, or running one of its options (its own regions).
        ways = []
        if dp.plain_allowed(-1, n, p):
            as_is, picks = dp.unit_ways(-1, n, p)
            if as_is:
                ways.append((None, c.w[p], c.e[p], c.sin[p], c.sout[p], c.bwd_base[p], 0.0))
            ways += [
                ((p, k), o.w, o.e, o.sin, o.sout, o.bwd, o.cost_s)
                for k in picks
                for o in (c.options_of(p)[k],)
            ]
        for ih, cands in sorted(states.items()):
            for entry in prune(cands):
                k_held = entry[0]
                if ways:
                    for pick, w, e, sin, sout, bwd, cost_s in ways:
                        held_in = p > 0 and (ih or sin)
                        need = max(
                            w + k_held + inp + c.a[p],
                            bwd
                            + k_held
                            + (inp if held_in else 0)
                            + (c.a[p] if sout and p < n - 1 else 0),
                        )
                        if need <= budget_bytes:
                            kept = (inp if held_in else 0) + e
                            new = dp.extend(entry, kept, need, cost_s, pick)
                            state = bool(sout) and p < n - 1
                            pending.setdefault(p + 1, {}).setdefault(state, []).append(new)
                run_body = c.w_run[p] + c.a[p]
                i = p + 1
                for q in ends:
                    while i < q:
                        run_body = max(run_body, dp.body[i])
                        i += 1
                    run = k_held + inp + run_body
                    room = budget_bytes - k_held
                    last = c.lp[q]
                    lower = max(dp.bwd(p, last - 1), dp.post_lb[last], dp.pre_lb[last])
                    if run > budget_bytes or (not dp.peak_mode and lower > room):
                        break  # both only grow with q
                    mode = ALWAYS if ih else KEY
                    sub = dp.frame(p, q, mode, 0, 0, False, room, room - inp)
                    if sub is None:
                        continue
                    run = k_held + inp + sub.run_peak
                    need = max(run, sub.peak + k_held)
                    new = dp.extend(entry, inp, need, sub.cost_s + c.region_s, (p, q, sub.plan))
                    pending.setdefault(q, {}).setdefault(False, []).append(new)
    finals = []
    for cands in pending.get(n, {}).values():
        for e in cands:
            # bwd_start: what the forward pass keeps, the step output and its gradient.
            closing = dp.extend(e, 0, c.cb + e[0], 0.0, None)
            if closing[2] <= budget_bytes:
                finals.append(closing)
    if not finals:
        return None
    best = min(finals, key=lambda e: (e[1], e[2], e[3]))
    return best[3], best[2] + c.pinned_bytes, pieces(best)
