"""Keep-set schedules inside the blocks of a separator chain, as options of the frames of
:mod:`~chkpt_opt.solvers.nested.dp_nested`: the hierarchical solver's block options lifted into
the nested DP.

Over blocks (:mod:`~chkpt_opt.solvers.nested.separator_chain`) the DP's regions begin and end at
separators. A block that is a plain piece of a frame (of the forward pass, or of a region's
replay, there neither its first block nor the one holding its last packer) may instead run
a keep-set schedule of its own (regions inside it, as the hierarchical solver's blocks do,
nested in the region around it): it then keeps less from its forward to its backward and
recomputes a little. Such a block still touches the rest of the step only through its
input and output, so a frame can weigh, per block, plain against each option, beside the
regions over blocks. Where the block runs inside a checkpoint, its regions nest there too
and hold their inputs while they run (``UnitOption.w_run``).

**Candidates** are the hierarchical solver's: one CP-SAT program per distinct block
(:class:`~chkpt_opt.solvers.blocks.options.OptionPool`; identical repeated blocks are solved
once), swept over caps on the block's own peak and kept bytes. Their worth in the DP is not
taken from that program's model: **every option's bytes are read off the op sequence** of
:func:`chkpt_opt.memory_model.op_sequence.lower`, one lowering per round, with the round's option in
every block that has one. A block's own bytes do not depend on what the other blocks run
(only its input crosses into it), and what each block before it keeps is checked against
what the DP counts, as :func:`~chkpt_opt.solvers.nested.separator_chain.separator_chain` does for
plain blocks.

**Exactness.** The DP counts a block's input alive at every step of its forward and, where
something holds it, of its backward. An option that holds its input itself (an op outside
its regions saving it, or a region reading it) frees it inside its backward; where its
steps peak after that, or after the input's last reader in the forward or a run, the
option counts up to the input's bytes too many (bounded as the chain's loose blocks are).
Its bytes are read with its regions outermost, where a checkpoint holds its inputs until
its first packer's backward; nested inside a region they are freed when their replay
ends, earlier, so there the DP may count up to the bytes of those inputs too many. The
option's ``slack_bytes`` covers both, and a chain with options is exact only where no
option's regions hold anything (a scratch check found the over-count on a random DAG:
``tests/solvers/nested/test_unit_options.py`` counts random plans with options against the
simulator).
"""

from __future__ import annotations

import dataclasses
import logging

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import (
    CostGraph,
    ordered_nodes,
    region_overhead_s,
    storage_owners,
    storage_refs,
)
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.solvers.blocks.options import OptionPool
from chkpt_opt.solvers.blocks.repeated import fold_shared_lifetimes, make_blocks, split_model
from chkpt_opt.solvers.deadline import Deadline, DeadlineExceeded
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.nested.separator_chain import (
    UNITS,
    input_slack,
    last_read_in,
    separators_apart_from,
    unit_storages,
)
from chkpt_opt.solvers.nested.step_timeline import Timeline, timeline
from chkpt_opt.solvers.nested.unit_chain import NestedChain, UnitOption

_log = logging.getLogger(__name__)

Spans = tuple[tuple[int, int], ...]


def with_options(
    graph: CostGraph,
    chain: NestedChain,
    *,
    deadline: Deadline,
    seed: int = 0,
    peak_levels: int = 3,
    n_kept: int = 4,
) -> NestedChain:
    """``chain`` (a separator chain of ``graph``) with the options of its blocks (module
    docstring): those found and read by ``deadline`` (the round under way finishes)."""
    if chain.units != UNITS:
        raise SolverError("unit options are read for chains of blocks only; a bug.")
    cuts = separators_apart_from(graph, chain.pinned)
    if tuple([0, *cuts, graph.number_of_nodes()]) != chain.starts:
        raise SolverError("the chain's units are not the graph's blocks; a bug.")
    candidates = _candidates(graph, chain, deadline, seed, peak_levels, n_kept)
    found: list[list[UnitOption]] = [[] for _ in range(chain.n)]
    for r in range(max(map(len, candidates), default=0)):
        if deadline.expired():
            _log.debug("block options: %d rounds read by the deadline", r)
            break
        picks = {u: spans[r] for u, spans in enumerate(candidates) if r < len(spans)}
        for u, option in _read_round(graph, chain, cuts, picks).items():
            found[u].append(option)
    slack = max((o.slack_bytes for row in found for o in row), default=0)
    return dataclasses.replace(
        chain,
        options=tuple(tuple(x) for x in found),
        exact=chain.exact and not slack,
        slack_bytes=max(chain.slack_bytes, chain.pinned_bytes + slack),
    )


def _candidates(
    graph: CostGraph,
    chain: NestedChain,
    deadline: Deadline,
    seed: int,
    peak_levels: int,
    n_kept: int,
) -> list[list[Spans]]:
    """Per unit, the region spans of its keep-set options (none where the interval model
    does not split at the separators)."""
    none: list[list[Spans]] = [[] for _ in range(chain.n)]
    blocks = make_blocks(graph, chain.starts)
    try:
        exact = build_interval_model(graph, segments=chain.starts, deadline=deadline)
        model, _ = fold_shared_lifetimes(exact, blocks)
        segments = split_model(model, blocks)
    except (SolverError, DeadlineExceeded) as err:
        _log.debug("no block options for graph %r: %s", graph.graph.get("name", ""), err)
        return none
    pools: dict[int, OptionPool] = {}
    for u, (seg, kind) in enumerate(zip(segments, blocks.kinds)):
        if kind in pools or not chain.packer[u] or deadline.expired():
            continue
        try:
            pools[kind] = OptionPool(model, seg, seed=seed, deadline=deadline)
        except DeadlineExceeded as err:  # the pools built so far are read
            _log.debug("block options cut short: %s", err)
            break
        pools[kind].sweep_levels(peak_levels, n_kept=n_kept)
    found = []
    for u, (seg, kind) in enumerate(zip(segments, blocks.kinds)):
        pool = pools.get(kind) if chain.packer[u] else None
        spans = [] if pool is None else [s for s in pool.found if s]
        found.append([tuple((a + seg.lo, b + seg.lo) for a, b in s) for s in spans])
    return found


def _read_round(
    graph: CostGraph, chain: NestedChain, cuts: dict[int, str], picks: dict[int, Spans]
) -> dict[int, UnitOption]:
    """The options ``picks`` (one per unit at most), read off one lowering with all of
    them; an option whose bytes the chain cannot count is left out (logged)."""
    c = chain
    nodes = graph.nodes
    order = ordered_nodes(graph)
    out_sid = unit_storages(graph, cuts)
    schedule = Schedule(
        regions=tuple(tuple(order[i:j]) for u in sorted(picks) for i, j in picks[u])
    )
    steps = lower(graph, schedule)
    tl = timeline(steps, c.pinned)
    # The same options inside one region over the whole graph: their runs.
    runs = timeline(
        lower(graph, Schedule(regions=(tuple(order),), nested=schedule.regions)), c.pinned
    )
    unit_of = {order[i]: u for u in range(c.n) for i in range(c.starts[u], c.starts[u + 1])}
    window: list[list[int]] = [[] for _ in range(c.n)]
    for k, step in enumerate(steps):
        if step.kind in ("bwd", "accumulate", "recompute"):
            window[unit_of[step.node]].append(k)

    def inp_alive(u: int, k: int, after: bool = False, seq: Timeline = tl) -> int:
        return c.a[u - 1] if u and seq.alive(f"f:{out_sid[u - 1]}", k, after=after) else 0

    read: dict[int, UnitOption] = {}
    k_before = 0  # what the units before each one keep, as the DP counts it
    holds_out = False  # whether the unit before holds its output until its backward
    for u in range(c.n):
        s, t = c.starts[u], c.starts[u + 1]
        before_holds = holds_out
        base = tl.after[s - 1] - inp_alive(u, s - 1, True) if s else 0
        run_base = runs.after[s - 1] - inp_alive(u, s - 1, True, runs) if s else 0
        if base != k_before or run_base:
            _log.debug("block options: unit %d keeps %d B before it, not %d", u, base, k_before)
            return {}
        if u not in picks:
            held_in = u > 0 and (holds_out or c.sin[u])
            k_before += (c.a[u - 1] if held_in else 0) + c.e[u]
            holds_out = c.sout[u]
            continue
        spans = picks[u]
        inside = {i for start, stop in spans for i in range(start, stop)}
        sin = u > 0 and _holds_input(graph, order, s, t, spans, inside, out_sid[u - 1])
        sout = any(out_sid[u] in nodes[order[i]]["saved"] for i in range(s, t) if i not in inside)
        held_in = u > 0 and (before_holds or sin)
        in_bytes = c.a[u - 1] if held_in else 0
        e = tl.after[t - 1] - base - inp_alive(u, t - 1, True) - c.a[u]
        k_before += in_bytes + e
        holds_out = sout
        if bool(inp_alive(u, t - 1, True)) != held_in or not window[u]:
            _log.debug("block options: unit %d's input is held unlike the chain counts", u)
            continue
        ks = window[u]
        if ks != list(range(ks[0], ks[-1] + 1)):
            continue
        fwd = [tl.during[k] - base - inp_alive(u, k) for k in range(s, t)]
        run = [runs.during[k] - inp_alive(u, k, False, runs) for k in range(s, t)]
        if max(run) < c.w_run[u] + c.a[u]:  # the DP counts a run at least at plain's
            _log.debug("block options: unit %d runs below its plain run", u)
            continue
        last = last_read_in(graph, order, s, t, out_sid[u - 1]) if u else t - 1
        own = [tl.during[k] - base - inp_alive(u, k) for k in ks]
        out_term = c.a[u] if sout and u < c.n - 1 else 0
        loose = any(max(x[: last - s + 1]) != max(x) for x in (fwd, run))
        if sin:
            # Held by the unit alone (not the unit before), the input is freed inside the
            # backward: the DP counts it at every step. The round shows when it is freed
            # only where the unit before does not hold it.
            real = max(tl.during[k] - base for k in ks)
            loose = loose or before_holds or real != max(own) + c.a[u - 1]
        read[u] = UnitOption(
            spans=spans,
            cost_s=sum(
                float(nodes[steps[k].node]["fwd_time_s"])
                for k in ks
                if steps[k].kind == "recompute"
            )
            + len(spans) * region_overhead_s(graph),
            w=max(fwd) - c.a[u],
            w_run=max(run) - c.a[u],
            e=e,
            sin=sin,
            sout=sout,
            bwd=max(own) - out_term,
            slack_bytes=max(
                input_slack(c.a, c.packer, u) if loose else 0, _nested_slack(graph, order, spans)
            ),
        )
    return read


def _nested_slack(graph: CostGraph, order: list[str], spans: Spans) -> int:
    """What the DP may count above the simulator where the option runs inside a region: its
    regions, nested there, free their inputs when their replay ends, and the bytes read off
    the op sequence (with them outermost) hold them until their first packer's backward.
    At most the bytes of those inputs (the block's own input among them)."""
    nodes = graph.nodes
    owners = storage_owners(graph)
    index = {v: i for i, v in enumerate(order)}
    held: set[str] = set()
    for start, stop in spans:
        for k in range(start, stop):
            for p in graph.predecessors(order[k]):
                if index[p] < start:
                    held.update(storage_refs(graph, p))
    return sum(int(nodes[owners[sid]]["outputs"][sid]) for sid in held if sid in owners)


def _holds_input(
    graph: CostGraph,
    order: list[str],
    start: int,
    stop: int,
    spans: Spans,
    inside: set[int],
    sid: str,
) -> bool:
    """Whether ops ``start..stop-1`` with regions ``spans`` hold storage ``sid`` until their
    backward: an op outside the regions saves it, or a region reads it (its checkpoint
    keeps its inputs)."""
    nodes = graph.nodes
    index = {order[i]: i for i in range(start, stop)}
    if any(sid in nodes[order[i]]["saved"] for i in range(start, stop) if i not in inside):
        return True
    return any(
        sid in storage_refs(graph, p)
        for i, j in spans
        for k in range(i, j)
        for p in graph.predecessors(order[k])
        if index.get(p, -1) < i
    )
