"""What a schedule recomputes, in seconds, without walking its memory.

The op sequence (:func:`chkpt_opt.memory_model.op_sequence.lower`) replays every region that has a
trigger (its replay's computed ops, :func:`~chkpt_opt.memory_model.region_replay.region_replays`)
and rebuilds every unpacked op that a backward op unpacks, with the recipes those hold handles
on (:func:`~chkpt_opt.memory_model.unpack.unpack_plans`). :func:`recompute_s` sums the forward times
of the same ops and the schedule's overheads
(:func:`~chkpt_opt.memory_model.region_replay.schedule_overhead_s`): what
:func:`~chkpt_opt.memory_model.simulate.simulate` reports as ``recompute_s``, at a fraction of its
cost (the memory walk is most of a simulation), so that a search can pass over the
neighbours that cannot be cheaper than what it has
(:mod:`chkpt_opt.solvers.cached.local_search`). ``tests/memory_model/test_replay_cost.py`` checks it
against the simulator on random general schedules, with unpacked ops.

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> from chkpt_opt.memory_model.schedule import Schedule
    >>> g = chain_graph(6, activation_bytes=1000)
    >>> recompute_s(g, Schedule()) == 0.0
    True
"""

from __future__ import annotations

from chkpt_opt.graphs.costgraph import CostGraph, attributes_by_node, ordered_nodes, storage_owners
from chkpt_opt.memory_model.region_replay import region_replays, schedule_overhead_s
from chkpt_opt.memory_model.schedule import Schedule, innermost_regions, region_tree
from chkpt_opt.memory_model.unpack import unpack_plans


def recomputed_ops(graph: CostGraph, schedule: Schedule) -> list[str]:
    """The ops ``schedule`` runs again in a step, once per run (a multi-level schedule's
    list can be quadratic in the graph's ops; its length is what lowering and simulating
    the schedule take time in proportion to). The schedule is assumed valid."""
    if schedule.staged:  # each stage's ops, once each
        return [n for _, ops in schedule.staged for n in ops]
    nodes = attributes_by_node(graph)
    order = ordered_nodes(graph)
    owner = storage_owners(graph)
    tree = region_tree(graph, schedule)
    inner = innermost_regions(tree, len(order))
    ran: list[str] = []
    for replay in region_replays(graph, order, tree, inner, schedule.saved, owner):
        if replay.trigger:  # always an op with a backward: lower() replays it there
            ran += [order[i] for i in replay.computed]
    if schedule.unpacked:
        plans = {p.node: p for p in unpack_plans(graph, order, inner, schedule.unpacked, owner)}
        # Rebuilt before a backward op that unpacks them, with the recipes they need.
        waiting = [
            name for name, p in plans.items() if p.trigger and nodes[p.trigger]["has_backward"]
        ]
        rebuilt: set[str] = set()
        while waiting:
            name = waiting.pop()
            if name not in rebuilt:
                rebuilt.add(name)
                waiting += [op for _, op in plans[name].needs]
        ran += sorted(rebuilt)
    return ran


def recompute_s(graph: CostGraph, schedule: Schedule) -> float:
    """Seconds of forward work ``schedule`` runs again in a step, overheads included
    (``simulate(graph, schedule).recompute_s`` up to float rounding; the schedule is
    assumed valid)."""
    nodes = attributes_by_node(graph)
    ran = sum(nodes[n]["fwd_time_s"] for n in recomputed_ops(graph, schedule))
    return ran + schedule_overhead_s(graph, schedule)
