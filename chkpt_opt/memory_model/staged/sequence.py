"""The op sequence of a staged schedule (:mod:`chkpt_opt.memory_model.staged`), for the simulator.

The forward ops in order, then the backward pass in reverse order (ops with a backward),
with each stage's recomputations (``"recompute"`` steps, region -1) just before its
backward op, in execution order, and the gradients of
:mod:`chkpt_opt.memory_model.sequence.gradients`.

Each storage has one instance per computation: ``f:<storage>`` from the forward, and
``s<position>:<storage>`` from the recomputation at that position. A recomputation makes
every storage the op owns; those some op saves
(:func:`~chkpt_opt.memory_model.staged.rule.recomputed_storages`: what it returns, and a buffer it
saves for its own backward, such as a max-pool's indices) are instances later uses take, the others
die with the step. Every use takes the latest instance computed before it and holds it until it
runs:

* a forward reader of the storage (the forward instance);
* a recomputation that reads it (:func:`~chkpt_opt.graphs.costgraph.storages_read`: through
  an edge, or a saved storage of another op it reads without one);
* a backward op that unpacks it (an op that saves it, at its backward; an op without a
  backward holds the forward instance to the end of the step, as autograd does);
* the step returning it (the forward instance, to the end of the step).

An instance no use holds is freed once the step that computed it is done. This is what
the executor runs (:mod:`chkpt_opt.codegen.staged`): the forward's saved tensors whose use
takes the forward instance are saved as autograd saves them; the others are handles the
stage's values fill.
"""

from __future__ import annotations

import bisect

from chkpt_opt.graphs.costgraph import (
    CostGraph,
    attributes_by_node,
    ordered_nodes,
    owned_storages,
    storage_owners,
    storage_refs,
    storages_read,
)
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.sequence.gradients import gradient_instances, gradient_sums
from chkpt_opt.memory_model.sequence.steps import Step, steps_of
from chkpt_opt.memory_model.staged.rule import recomputed_storages


def lower_staged(graph: CostGraph, schedule: Schedule) -> list[Step]:
    """The op sequence of one training step under the staged ``schedule`` (assumed valid:
    :func:`chkpt_opt.memory_model.staged.check_staged`)."""
    nodes = attributes_by_node(graph)
    order = ordered_nodes(graph)
    owner = storage_owners(graph)
    preds = {n: sorted(graph.predecessors(n), key=lambda u: nodes[u]["index"]) for n in order}
    at = dict(schedule.staged)

    # Positions of every step.
    kinds: list[tuple[str, str, int]] = [("fwd", n, -1) for n in order]
    kinds.append(("bwd_start", "", -1))
    accumulates = gradient_sums(graph, order, nodes, preds)
    bwd_pos: dict[str, int] = {}
    acc_pos: dict[str, int] = {}
    for n in reversed(order):
        if not nodes[n]["has_backward"]:
            continue
        kinds += [("recompute", op, -1) for op in at.get(n, ())]
        bwd_pos[n] = len(kinds)
        kinds.append(("bwd", n, -1))
        if accumulates[n]:
            acc_pos[n] = len(kinds)
            kinds.append(("accumulate", n, -1))
    end = len(kinds)

    alloc_at: dict[str, tuple[int, int]] = {}
    release: dict[str, int] = {}

    def hold(inst: str, position: int) -> None:
        if release.get(inst, -1) < position:
            release[inst] = position

    # Instances: the forward's, then one per recomputation of the storages the op returns.
    made_at: dict[str, list[int]] = {}  # storage -> positions of its instances, in order
    names: dict[str, list[str]] = {}
    recomputed = recomputed_storages(graph)
    for position, (kind, n, _) in enumerate(kinds):
        if kind not in ("fwd", "recompute"):
            continue
        kept = recomputed[n] if kind == "recompute" else None
        for sid, nbytes in owned_storages(graph, n, owner).items():
            inst = f"f:{sid}" if kind == "fwd" else f"s{position}:{sid}"
            alloc_at[inst] = (position, nbytes)
            if kept is None or sid in kept:  # a storage nobody saves dies with the step
                made_at.setdefault(sid, []).append(position)
                names.setdefault(sid, []).append(inst)

    def use(sid: str, position: int) -> None:
        """The latest instance of ``sid`` computed before ``position`` is held until it."""
        k = bisect.bisect_left(made_at[sid], position) - 1
        hold(names[sid][max(k, 0)], position)

    for position, (kind, n, _) in enumerate(kinds):
        if kind == "fwd":
            for u in preds[n]:
                for sid in storage_refs(graph, u):
                    hold(f"f:{sid}", position)
        elif kind == "recompute":
            for sid in storages_read(graph, n, owner):
                use(sid, position)
    for n in order:
        for sid in nodes[n]["saved"]:
            if n in bwd_pos:
                use(sid, bwd_pos[n])
            else:
                hold(f"f:{sid}", end)
    for out in graph.graph["outputs"]:
        for sid in storage_refs(graph, out):
            hold(f"f:{sid}", end)

    start_pos = len(order)
    transient = gradient_instances(
        graph, nodes, preds, kinds, accumulates, acc_pos, start_pos, alloc_at, hold
    )
    return steps_of(kinds, alloc_at, release, transient)
