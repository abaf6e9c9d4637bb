"""Recompute on unpack: which ops may be unpacked, and what the rule adds to the op sequence.

An *unpacked* op lies outside every recompute region. Where an op outside every region
saves one of its output storages for backward (the unpacked op's own save included), a
saved-tensor hook (``torch.autograd.graph.saved_tensors_hooks``) stores a *recipe* instead:
the op and strong references to its inputs. The first backward step that unpacks one of
those storages runs the op again; the rebuilt storages live until the last backward step
that unpacks them has run. Codegen runs it so (:mod:`chkpt_opt.codegen.unpack`), and
:func:`chkpt_opt.memory_model.op_sequence.lower` reads the rule from :func:`unpack_plans`.

The memory rules (those of :mod:`chkpt_opt.memory_model.op_sequence`, one model):

* an unpacked op's output storages are not kept by saves of ops outside every region;
  each such saver keeps the op's *input storages* instead (the storages of the values it
  reads, and the storages it saves without owning them, which it reads without an edge),
  until the saver's backward has run (to the end of the step if it never runs). The
  forward's registry of recipes holds every unpacked op's input storages to the end of the
  forward pass, saved or not (a later saver may still pack the output);
* the outputs die after their last forward reader unless something else holds them: a
  region that takes them as its input (checkpoint keeps its inputs; codegen saves them
  plainly), an op inside a region that saves them (the checkpoint's own hooks take
  precedence there), or the step returning them;
* just before the first backward step that unpacks one of them, a ``"recompute"`` step
  runs the op (all its own storages allocated, its forward workspace, its forward time
  counted as recompute time); the storages no saver saves are freed at once, the others
  after the last backward step that unpacks them (to the end of the step where a saver
  never runs its backward);
* chains: where an unpacked op reads a storage that an earlier unpacked op rebuilds (a
  concat of an upsample), its recipe holds a handle on that op's recipe instead of the
  tensor, so the storage dies after its last forward reader too; the later op's rebuild
  runs the earlier one's first (unless its output is held already), which holds that
  output until then (:attr:`UnpackPlan.needs`, :attr:`UnpackPlan.held_by`).

Every save of an output storage is replaced, also a save of a view of it (codegen matches
saved tensors by storage and rebuilds the view's geometry): the graph does not say whether
a saver reads the output itself or a view of it, and both are rebuilt alike. The storages
rebuilt are those the op returns (:func:`rebuilt_storages`): its ``outputs``, and a buffer
it owns that another op saves (only a returned value can reach another op: the pool's
indices that an unpool reads in the layer-level graphs). Buffers that only the op itself
saves (a norm's statistics inside a composite op) are internal to it and kept as before.

An op may be unpacked where it owns all the storages it returns (not a view, not in place),
no later op writes them in place, it draws no random numbers, updates no module state, the
step does not return it, and no later op writes in place a tensor it reads (the recipe holds
that tensor, which would have changed by the rebuild) (:func:`unpackable_ops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chkpt_opt.errors import ScheduleError, short
from chkpt_opt.graphs.costgraph import (
    CostGraph,
    attributes_by_node,
    storage_owners,
    storage_refs,
    storages_read,
)
from chkpt_opt.graphs.frozen import graph_fact


@graph_fact
def written_storages(graph: CostGraph) -> frozenset[str]:
    """The storages that some op writes in place."""
    return frozenset(
        sid for n, a in graph.nodes(data=True) if a["is_inplace"] for sid in storage_refs(graph, n)
    )


@graph_fact
def later_write_readers(graph: CostGraph) -> frozenset[str]:
    """The ops that read (:func:`~chkpt_opt.graphs.costgraph.storages_read`) a storage some
    later op writes in place: running one again later would read the changed value."""
    last: dict[str, int] = {}  # storage -> index of the last op writing it in place
    for n, a in graph.nodes(data=True):
        if a["is_inplace"]:
            for sid in storage_refs(graph, n):
                last[sid] = max(last.get(sid, -1), a["index"])
    owner = storage_owners(graph)
    return frozenset(
        n
        for n, a in graph.nodes(data=True)
        if any(last.get(sid, -1) > a["index"] for sid in storages_read(graph, n, owner))
    )


def unpack_problem(graph: CostGraph, node: str) -> str:
    """Why ``node`` cannot be unpacked ("" where it can), as a phrase naming the problem."""
    attrs = graph.nodes[node]
    if node in graph.graph["outputs"]:
        return "is a step output (the step returns it, so it is kept anyway)"
    if not attrs["outputs"] or attrs["aliases"]:
        return "returns a view or writes in place (it does not own the storage it returns)"
    if attrs["is_inplace"]:
        return "writes a tensor in place"
    if attrs["is_random"]:
        return "draws random numbers (a rebuild would draw other ones)"
    if attrs["is_stateful"]:
        return "updates module state (a rebuild would update it twice)"
    written = written_storages(graph)
    if any(sid in written for sid in attrs["outputs"]):
        return "has its output written in place by a later op (a rebuild would miss the write)"
    if node in later_write_readers(graph):
        return "reads a tensor that a later op writes in place (a rebuild would read the new value)"
    return ""


def self_contained_ops(graph: CostGraph, *, draws_ok: bool = False) -> frozenset[str]:
    """Ops that own every storage they return (no view, not in place), whose outputs no op
    writes in place later, and that draw no random numbers (``draws_ok``: or do): what a
    cache can hold or a recipe remake (:func:`chkpt_opt.memory_model.schedule.cacheable_ops`,
    :func:`unpackable_ops`)."""
    written = {
        sid for n, a in graph.nodes(data=True) if a["is_inplace"] for sid in storage_refs(graph, n)
    }
    return frozenset(
        n
        for n, a in graph.nodes(data=True)
        if a["outputs"]
        and not a["aliases"]
        and not a["is_inplace"]
        and (draws_ok or not a["is_random"])
        and not any(sid in written for sid in a["outputs"])
    )


def unpackable_ops(graph: CostGraph, *, draws_ok: bool = False) -> frozenset[str]:
    """The ops a schedule may unpack where they lie outside every region (see the module
    docstring): the self-contained ones that are not stateful nor a step output and read
    nothing a later op writes in place. ``draws_ok``: random ops too, for an executor that
    replays the generators' state (a staged recomputation,
    :func:`chkpt_opt.memory_model.staged.recomputable_ops`)."""
    left_out = set(graph.graph["outputs"]) | later_write_readers(graph)
    return frozenset(
        n
        for n in self_contained_ops(graph, draws_ok=draws_ok)
        if not graph.nodes[n]["is_stateful"] and n not in left_out
    )


def check_unpacked(graph: CostGraph, unpacked: frozenset[str], inner: Sequence[int]) -> None:
    """Checks the unpacked ops of a schedule (``inner``: each op's innermost region, -1
    outside every region).

    Raises:
        ScheduleError: naming the op, the problem and the fix.
    """
    for name in sorted(unpacked):
        if name not in graph:
            raise ScheduleError(
                f"unpacked op {short(name)} is not in graph {graph.graph.get('name', '')!r}; "
                "was the schedule made for another model? Drop it from 'unpacked'."
            )
    for name in sorted(unpacked, key=lambda n: graph.nodes[n]["index"]):
        if inner[graph.nodes[name]["index"]] >= 0:
            raise ScheduleError(
                f"unpacked op {short(name)} lies in a recompute region, whose checkpoint "
                "already decides what it keeps; only ops outside every region can be "
                "unpacked. Drop it from 'unpacked' or take it out of the region."
            )
        problem = unpack_problem(graph, name)
        if problem:
            raise ScheduleError(
                f"unpacked op {short(name)} {problem}; it cannot be rebuilt on unpack. "
                "Drop it from 'unpacked'."
            )


@graph_fact
def rebuilt_storages(graph: CostGraph) -> dict[str, frozenset[str]]:
    """For every op, the storages that unpacking it rebuilds: its outputs, and the buffers
    it owns that another op saves (see the module docstring)."""
    owner = storage_owners(graph)
    savers: dict[str, set[str]] = {}
    for n, attrs in graph.nodes(data=True):
        for sid in attrs["saved"]:
            savers.setdefault(sid, set()).add(n)
    return {
        n: frozenset(attrs["outputs"])
        | frozenset(sid for sid in attrs["saved"] if owner[sid] == n and savers[sid] - {n})
        for n, attrs in graph.nodes(data=True)
    }


def unpack_candidates(
    graph: CostGraph, in_regions: frozenset[str], unpacked: frozenset[str] = frozenset()
) -> list[str]:
    """The ops worth unpacking under a schedule whose regions hold ``in_regions`` and that
    unpacks ``unpacked``: ops that may be unpacked, outside every region, with a rebuilt
    storage that an op outside every region saves or an unpacked op reads (its recipe
    then holds a handle on this op's recipe instead). In execution order."""
    allowed = unpackable_ops(graph)
    rebuilt = rebuilt_storages(graph)
    saved_outside = {
        sid for n, a in graph.nodes(data=True) if n not in in_regions for sid in a["saved"]
    }
    saved_outside |= {
        sid
        for u in unpacked
        if u in graph
        for p in graph.predecessors(u)
        for sid in storage_refs(graph, p)
    }
    found = [
        n
        for n in allowed
        if n not in in_regions and any(sid in saved_outside for sid in rebuilt[n])
    ]
    return sorted(found, key=lambda n: graph.nodes[n]["index"])


@dataclass(frozen=True)
class UnpackPlan:
    """What the rule does for one unpacked op (see the module docstring).

    Attributes:
        node: the unpacked op.
        inputs: the storages its recipe holds: its input storages, where one is rebuilt by
            an earlier unpacked op, that op's recipe's instead (a handle on it).
        savers: for each output storage saved outside every region, the ops outside every
            region that save it, in execution order.
        trigger: the saver whose backward runs first and unpacks one of them (the rebuild
            runs just before it), or "" where no saver runs its backward.
        needs: ``(storage, op)`` for each of its input storages that the unpacked ``op``
            rebuilds: its recipe holds a handle on ``op``'s recipe, unpacked when it is
            rebuilt.
        held_by: for each of its rebuilt storages, the later unpacked ops whose recipes
            hold a handle on it.
    """

    node: str
    inputs: tuple[str, ...]
    savers: dict[str, tuple[str, ...]]
    trigger: str
    needs: tuple[tuple[str, str], ...] = ()
    held_by: dict[str, tuple[str, ...]] = field(default_factory=dict)


def unpack_plans(
    graph: CostGraph,
    order: Sequence[str],
    inner: Sequence[int],
    unpacked: frozenset[str],
    owner: dict[str, str],
) -> list[UnpackPlan]:
    """The plan of every unpacked op, in execution order (``inner`` as in
    :func:`check_unpacked`; ``owner`` from :func:`~chkpt_opt.graphs.costgraph.storage_owners`)."""
    nodes = attributes_by_node(graph)
    if not unpacked:
        return []
    rebuilt = rebuilt_storages(graph)
    ordered = sorted(unpacked, key=lambda n: nodes[n]["index"])
    maker = {sid: u for u in ordered for sid in rebuilt[u]}
    flat: dict[str, list[str]] = {}  # unpacked op -> the storages its recipe holds
    needs: dict[str, list[tuple[str, str]]] = {}
    held_by: dict[str, dict[str, list[str]]] = {u: {} for u in ordered}
    for u in ordered:
        flat[u], needs[u] = [], []
        for sid in storages_read(graph, u, owner):
            v = maker.get(sid, u)
            if v == u:
                flat[u].append(sid)
            else:  # a handle on v's recipe, which holds v's inputs
                needs[u].append((sid, v))
                held_by[v].setdefault(sid, []).append(u)
                flat[u] += flat[v]
    plans = []
    saved_outside: dict[str, list[str]] = {}  # storage -> the ops outside regions saving it
    for i, n in enumerate(order):
        if inner[i] < 0:
            for sid in nodes[n]["saved"]:
                saved_outside.setdefault(sid, []).append(n)
    for u in ordered:
        outputs = rebuilt[u]
        savers = {sid: names for sid, names in saved_outside.items() if sid in outputs}
        unpacking = [n for names in savers.values() for n in names if nodes[n]["has_backward"]]
        trigger = max(unpacking, key=lambda n: nodes[n]["index"], default="")
        plans.append(
            UnpackPlan(
                u,
                tuple(dict.fromkeys(flat[u])),
                {sid: tuple(names) for sid, names in savers.items()},
                trigger,
                tuple(needs[u]),
                {sid: tuple(users) for sid, users in held_by[u].items()},
            )
        )
    return plans
