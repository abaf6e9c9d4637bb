"""A graph cut at its separators, as the chain that :mod:`chkpt_opt.solvers.nested.dp_nested` plans
nested schedules on: each block between two separators is one unit.

A *separator* is an allowed region boundary across which exactly one storage made before
it is read after it: the output of the op just before it (a transformer's residual stream
between its blocks and between the attention and MLP halves of a block). Between
consecutive separators lies a *unit*, any sub-graph of ops whose only link to the ops
after it is its output. The recurrence of :mod:`~chkpt_opt.solvers.nested.recurrence` needs, per
unit, the bytes of its steps that no schedule changes, in every way a unit runs: its forward
saving what its backward needs (the forward pass, a replay), its run inside a checkpoint
(saving nothing), a replay that stops at its last packer, and its backward (whole; from
the op whose backward triggers a replay on; the steps before that op, which run before
the replay). A simple chain's unit has one step of each and
:mod:`~chkpt_opt.solvers.nested.unit_chain` writes its bytes down; a block has many, so they are
read off the op sequence of :func:`chkpt_opt.memory_model.op_sequence.lower` (the one memory model)
for two schedules: keep-all (forward, replay and backward steps) and one region over the
whole graph (runs). At each step of a unit's window the bytes alive are what the units
before it keep (the DP's kept bytes: :func:`separator_chain` checks them against the op
sequence), the unit's input where alive, and the unit's own part, which is the same in
every schedule since nothing else crosses a separator.

**Exactness.** The DP counts a unit's input alive at every step of a window where the
schedule holds it (a plain unit before it saving it, a region's checkpoint, an op of the
unit saving it). In the op sequence an input that the unit's own op holds, or a region's
checkpoint up to its first packer's backward, is freed inside the window, and one that
nothing holds is freed after its last reader. So the DP never counts fewer bytes than the
simulator, and exactly as many where every window peaks while the input is alive in
every schedule: :attr:`~chkpt_opt.solvers.nested.unit_chain.NestedChain.exact` records whether
that holds for every unit (it does in pre-norm transformer blocks: the first op saves the
input and the residual add reads it last). Where it does not, the DP counts at most
``slack_bytes`` too many at any step (the inputs it may count alive for nothing), so
``dp_nested`` bounds its optimum with the DP's at a budget that much larger.

**Broadcast storages.** A decoder computes its rotary tables (an encoder-decoder its
encoder's output, a padded batch its mask) once and every layer reads them, so they cross
every cut between layers and no such cut would separate. :func:`broadcast_storages` names
the storages that cross at least half of the allowed cuts, where leaving them out of what
crosses finds more separators (the 32-layer LoRA Llama at 768 tokens: 6 separators where
they count as crossing, 68 where they do not). Their forward instances are then left out
of every step's bytes read off the op sequence
(:func:`~chkpt_opt.solvers.nested.step_timeline.timeline`), and the DP counts their bytes
alive at every step instead (``NestedChain.pinned_bytes``, added by
:func:`~chkpt_opt.solvers.nested.top_frame.top_plan`): they are never recomputed in their
forward instances (a replay's copies are read off the sequence as the unit's own), so the
count is at most their bytes above the simulator, where they are not yet made or already
freed; the chain is then conservative with that slack.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Sequence

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_owners, storage_refs
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule, cut_positions, nesting_allowed
from chkpt_opt.solvers.base import INF_BYTES
from chkpt_opt.solvers.nested.step_timeline import Timeline, timeline
from chkpt_opt.solvers.nested.unit_chain import NestedChain, positions
from chkpt_opt.solvers.segments import last_reads

_log = logging.getLogger(__name__)

UNITS = "blocks between separators"
"""What the units of a separator chain are (:attr:`NestedChain.units`)."""


Spans = tuple[list[str], list[bool], dict[str, int], dict[str, int]]
"""The op order, the allowed cuts, where each storage is made and where it is last read."""


def broadcast_storages(graph: CostGraph) -> frozenset[str]:
    """Storages that most of the graph reads (a decoder's rotary tables, an attention mask,
    an encoder's output): those crossing at least half of the allowed cuts, where leaving
    them out finds more separators (module docstring: the DP counts them alive at every
    step)."""
    return _pinned_and_cuts(graph, _storage_spans(graph), broadcast=True)[0]


def separators(graph: CostGraph, *, broadcast: bool = True) -> dict[int, str]:
    """The separators of ``graph``: positions ``p`` (``0 < p < n``) where a region may begin
    and end and the only storage made before ``p`` and read at or after it, its
    :func:`broadcast_storages` aside (with ``broadcast``), is one that op ``p - 1`` returns
    (its output, or a view of it) and an op after the separator before made, with that
    storage."""
    return _pinned_and_cuts(graph, _storage_spans(graph), broadcast=broadcast)[1]


def separators_apart_from(graph: CostGraph, pinned: frozenset[str]) -> dict[int, str]:
    """:func:`separators` with the storages ``pinned`` left out of what crosses a cut."""
    return _cuts(graph, _storage_spans(graph), pinned)


def _storage_spans(graph: CostGraph) -> Spans:
    order = ordered_nodes(graph)
    made: dict[str, int] = {}
    for i, v in enumerate(order):
        for sid in graph.nodes[v]["outputs"]:
            made[sid] = i
    return order, cut_positions(graph), made, last_reads(graph)


def _pinned_and_cuts(
    graph: CostGraph, spans: Spans, *, broadcast: bool
) -> tuple[frozenset[str], dict[int, str]]:
    """The broadcast storages (none without ``broadcast``) and the separators beside them,
    from the graph's spans read once."""
    plain = _cuts(graph, spans, frozenset())
    if not broadcast:
        return frozenset(), plain
    order, ok, made, last_read = spans
    allowed = [p for p in range(1, len(order)) if ok[p]]
    long_lived = frozenset(
        sid
        for sid, i in made.items()
        if 2
        * (bisect.bisect_right(allowed, last_read.get(sid, -1)) - bisect.bisect_right(allowed, i))
        >= len(allowed)
        > 0
    )
    if long_lived:
        beside = _cuts(graph, spans, long_lived)
        if len(beside) > len(plain):
            return long_lived, beside
    return frozenset(), plain


def _cuts(graph: CostGraph, spans: Spans, pinned: frozenset[str]) -> dict[int, str]:
    """:func:`separators_apart_from` on spans read once."""
    order, ok, made, last_read = spans
    n = len(order)
    crossing = [0] * (n + 2)  # how many storages are alive across each position
    for sid, i in made.items():
        if last_read.get(sid, -1) > i and sid not in pinned:
            crossing[i + 1] += 1
            crossing[last_read[sid] + 1] -= 1
    found: dict[int, str] = {}
    count = start = 0
    for p in range(1, n):
        count += crossing[p]
        refs = [
            x
            for x in storage_refs(graph, order[p - 1])
            if last_read.get(x, -1) >= p and x not in pinned
        ]
        # (a view of a storage made before the last separator stays with its readers)
        if ok[p] and count == 1 and len(refs) == 1 and made.get(refs[0], -1) >= start:
            found[p] = refs[0]
            start = p
    return found


def unit_storages(graph: CostGraph, cuts: dict[int, str]) -> list[str]:
    """The storage each unit between the separators ``cuts`` passes on: the one crossing
    each separator, then the step output."""
    return [*cuts.values(), next(iter(graph.nodes[ordered_nodes(graph)[-1]]["outputs"]))]


def input_slack(a: Sequence[int], packer: Sequence[bool], u: int) -> int:
    """What the DP may count above the simulator at a step of unit ``u`` that it counts
    loosely: its input, and the inputs of the regions that start in the run of units
    without packers before it (their checkpoints free those inputs at the unit's first
    packer's backward)."""
    extra, v = a[u - 1] if u else 0, u - 1
    while v > 0 and not packer[v]:
        extra += a[v - 1]
        v -= 1
    return extra


def separator_chain(graph: CostGraph, *, broadcast: bool = True) -> NestedChain:
    """The chain of ``graph``'s blocks between separators, its bytes read off the op
    sequence (module docstring); ``broadcast=False`` counts no storage as broadcast.

    Raises:
        SolverError: naming what keeps ``graph`` from being such a chain.
    """
    nodes = graph.nodes
    order = ordered_nodes(graph)
    name = graph.graph.get("name", "")
    n_ops = len(order)

    def refuse(why: str) -> SolverError:
        return SolverError(
            f"graph {name!r} is no chain of blocks between separators: {why}. dp_nested "
            "plans chains only; use solver 'nested' or 'auto' with general=True."
        )

    if not order or list(graph.graph["outputs"]) != [order[-1]]:
        raise refuse("its step outputs are not exactly its last op")
    if len(nodes[order[-1]]["outputs"]) != 1:
        raise refuse("its last op does not own exactly one output")
    if not nesting_allowed(graph):
        raise refuse("it writes module state or an input in place, so regions do not nest")
    pinned, cuts = _pinned_and_cuts(graph, _storage_spans(graph), broadcast=broadcast)
    bounds = [0, *cuts, n_ops]
    units = list(itertools.pairwise(bounds))
    n = len(units)
    if n < 2:
        raise refuse("it has no separator")
    owners = storage_owners(graph)
    unit_of = {order[i]: u for u, (s, t) in enumerate(units) for i in range(s, t)}
    for v in order:
        if nodes[v]["n_saved"] > 0 and not nodes[v]["has_backward"]:
            raise refuse(f"op {v!r} saves tensors but runs no backward")
    out_sid = unit_storages(graph, cuts)
    for u, ((s, t), sid) in enumerate(zip(units, out_sid)):
        if not s <= nodes[owners[sid]]["index"] < t:
            raise refuse(f"unit {u} (op {order[s]!r}) passes on a storage made before it")
    a = [int(nodes[owners[sid]]["outputs"][sid]) for sid in out_sid]
    saved_by: list[dict[str, int]] = []  # storage -> bytes, saved by an op of each unit
    for s, t in units:
        saved_by.append(
            {x: int(b) for i in range(s, t) for x, b in nodes[order[i]]["saved"].items()}
        )
    packers = [[i for i in range(s, t) if nodes[order[i]]["n_saved"] > 0] for s, t in units]
    sin = tuple(u > 0 and out_sid[u - 1] in saved_by[u] for u in range(n))
    sout = tuple(out_sid[u] in saved_by[u] for u in range(n))
    e = tuple(
        sum(
            b
            for x, b in saved_by[u].items()
            if x != out_sid[u] and unit_of[owners[x]] == u and x not in pinned
        )
        for u in range(n)
    )
    # A replay whose last packer lies in unit u runs the unit's ops up to that packer, and
    # the packer too when it keeps a storage of its own (region_replay.replayed_ops).
    replayed = []
    for (s, _), ops in zip(units, packers):
        last = ops[-1] if ops else s
        keeps_own = any(owners.get(x) == order[last] for x in nodes[order[last]]["saved"])
        replayed.append(last - s + (1 if ops and keeps_own else 0))
    times = [float(nodes[v]["fwd_time_s"]) for v in order]
    t = tuple(sum(times[s:stop]) for s, stop in units)
    t_own = tuple(sum(times[s : s + k]) for (s, _), k in zip(units, replayed))

    keep = lower(graph, Schedule())
    kept = timeline(keep, pinned)
    runs = timeline(lower(graph, Schedule(regions=(tuple(order),))), pinned)

    def inp_alive(tl: Timeline, u: int, k: int, after: bool = False) -> int:
        return a[u - 1] if u and tl.alive(f"f:{out_sid[u - 1]}", k, after=after) else 0

    # Kept bytes before each unit, as the DP counts them (checked against the sequence).
    k_before = [0] * (n + 1)
    for u in range(n):
        held_in = u > 0 and (sout[u - 1] or sin[u])
        k_before[u + 1] = k_before[u] + (a[u - 1] if held_in else 0) + e[u]
    w: list[int] = []
    w_run: list[int] = []
    w_stop: list[int] = []
    loose: dict[int, str] = {}  # units whose windows the DP counts above the simulator
    for u, (s, t_) in enumerate(units):
        read = last_read_in(graph, order, s, t_, out_sid[u - 1]) if u else t_ - 1
        fwd = []
        for tl, base_expected, out in ((kept, k_before[u], fwd), (runs, 0, None)):
            base = (tl.after[s - 1] - inp_alive(tl, u, s - 1, True)) if s else 0
            if base != base_expected:
                raise refuse(
                    f"before unit {u} (op {order[s]!r}) {base} bytes are alive where the "
                    f"chain counts {base_expected}"
                )
            own = [tl.during[k] - base - inp_alive(tl, u, k) for k in range(s, t_)]
            if max(own[: read - s + 1]) != max(own):
                loose[u] = f"unit {u} ({order[s]!r}): {'run' if out is None else 'forward'}"
            if out is not None:
                out.extend(own)
                w.append(max(own) - a[u])
            else:
                w_run.append(max(own) - a[u])
        k_stop = replayed[u]
        w_stop.append(max(fwd[:k_stop]) - a[u] if k_stop else w[u])
        if k_stop and max(fwd[: min(k_stop, read - s + 1)]) != max(fwd[:k_stop]):
            loose[u] = f"unit {u} ({order[s]!r}): replay"

    # Backward windows of keep-all.
    window: list[list[int]] = [[] for _ in range(n)]
    for k, step in enumerate(keep):
        if step.kind in ("bwd", "accumulate"):
            window[unit_of[step.node]].append(k)
    bwd_base: list[int] = []
    bwd_post: list[int] = []
    bwd_pre: list[int] = []
    rec_base: list[int] = []
    bwd_at = {step.node: k for k, step in enumerate(keep) if step.kind == "bwd"}
    for u, (s, t_) in enumerate(units):
        ks = window[u]
        if not ks:  # nothing of it needs a gradient (position ids): no backward steps
            bwd_base.append(-INF_BYTES)
            bwd_post.append(-INF_BYTES)
            bwd_pre.append(-INF_BYTES)
            rec_base.append(0)
            continue
        if ks != list(range(ks[0], ks[-1] + 1)):
            raise refuse(f"the backward steps of unit {u} (op {order[s]!r}) are not one run")
        own = {k: kept.during[k] - k_before[u] - inp_alive(kept, u, k) for k in ks}
        out_term = a[u] if sout[u] and u < n - 1 else 0
        trigger = bwd_at[order[packers[u][-1]]] if packers[u] else ks[0]
        pre = [k for k in ks if k < trigger]
        post = [k for k in ks if k >= trigger]
        bwd_base.append(max(own.values()) - out_term)
        if u == n - 1 and sout[u]:
            # In a region, the last unit's replay saves a second copy of the step output
            # (the first stays with its gradient to the end), freed after its saver's
            # backward: the region's frame counts it on top of bwd_post.
            bwd_post.append(max([own[post[0]] + a[u], *(own[k] for k in post[1:])]) - a[u])
        else:
            bwd_post.append(max(own[k] for k in post) - out_term)
        bwd_pre.append(max(own[k] for k in pre) - e[u] if pre else -INF_BYTES)
        before = trigger - 1
        rec_base.append(
            kept.after[before]
            - k_before[u]
            - inp_alive(kept, u, before, True)
            - e[u]
            - (a[u] if u < n - 1 and kept.alive(f"f:{out_sid[u]}", before, after=True) else 0)
        )
        if u and packers[u]:
            holders = [i for i in range(s, t_) if out_sid[u - 1] in nodes[order[i]]["saved"]]
            # The input is freed after the backward of the first packer (a region's
            # checkpoint) or of the first op saving it: the windows must peak by then.
            until = min(bwd_at[order[i]] for i in [packers[u][0], *holders[:1]])
            for part in (ks, post):
                best = max(own[k] for k in part)
                if max((own[k] for k in part if k <= until), default=best - 1) != best:
                    loose[u] = f"unit {u} ({order[s]!r}): backward"
    fwd_end = n_ops - 1
    cb = kept.during[n_ops] - (kept.after[fwd_end] - a[n - 1])
    if kept.after[fwd_end] - a[n - 1] != k_before[n]:
        raise refuse("what the forward pass keeps differs from what the chain counts")
    packer = tuple(bool(ops) for ops in packers)
    fp, lp, prefix = positions(packer, t)
    # What the DP may count above the simulator at a step of a loose unit: its input, and
    # the inputs of the regions that start in the run of units without packers before it
    # (their checkpoints free those inputs at the unit's first packer's backward).
    slack = max((input_slack(a, [bool(ops) for ops in packers], u) for u in loose), default=0)
    # The broadcast storages, left out of every step's bytes above, are counted alive at
    # every step instead: at most their bytes too many where they are not.
    pinned_bytes = sum(int(nodes[owners[sid]]["outputs"][sid]) for sid in pinned)
    if loose:
        _log.debug("graph %r: dp_nested counts up to %d bytes too many at %s", name, slack, loose)
    return NestedChain(
        n=n,
        a=tuple(a),
        t=t,
        t_own=t_own,
        w=tuple(w),
        e=tuple(e),
        packer=packer,
        sin=sin,
        sout=sout,
        sown=tuple(k > 0 for k in replayed),
        ok=(True,) * (n + 1),
        fp=fp,
        lp=lp,
        bwd_base=tuple(bwd_base),
        rec_base=tuple(rec_base),
        cb=cb,
        t_prefix=prefix,
        starts=tuple(bounds),
        w_run=tuple(w_run),
        w_stop=tuple(w_stop),
        bwd_post=tuple(bwd_post),
        bwd_pre=tuple(bwd_pre),
        exact=not loose and not pinned_bytes,
        slack_bytes=slack + pinned_bytes,
        units=UNITS,
        pinned=pinned,
        pinned_bytes=pinned_bytes,
    )


def last_read_in(graph: CostGraph, order: list[str], start: int, stop: int, sid: str) -> int:
    """The position of the last op in ``start..stop-1`` that reads storage ``sid``."""
    readers = [
        i
        for i in range(start, stop)
        if any(sid in storage_refs(graph, u) for u in graph.predecessors(order[i]))
    ]
    return max(readers, default=start)
