"""What a staged schedule may recompute, and its check.

An op may be recomputed at a stage where a recomputation gives the same values and the
executor can hold them: where it may be unpacked, random ops included
(:func:`chkpt_opt.memory_model.unpack.unpackable_ops` with ``draws_ok``: it owns the storages
it returns, updates no state, is not a step output, no op writes its outputs in place, and no
later op writes in place what it reads). A random op (dropout, attention) is recomputed under
the generators' state its forward call found, which the executor copies then and keeps until
its last recomputation, so that it draws the same numbers. Those copies are not counted, as
checkpoint's copies for a region that replays them are not: on CUDA they live on the host
(a generator's seed and offset), on the CPU they are 5056 bytes each that no ATen op makes
(the dispatcher-level measurement does not see them either). A recomputation re-creates
every storage the op owns that some op saves (:func:`recomputed_storages`): those it
returns, and a buffer it saves for its own backward (a max-pool's indices, a layer norm's
statistics), which the executor captures by running the op with autograd recording, as
checkpoint's recomputation does.

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> g = chain_graph(3, activation_bytes=1000)
    >>> order = sorted(g.nodes, key=lambda n: g.nodes[n]["index"])
    >>> s = staged_schedule(g, {order[2]: [order[0]]})
    >>> s == ((order[2], (order[0],)),)
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from chkpt_opt.errors import ScheduleError, short
from chkpt_opt.graphs.costgraph import CostGraph, storage_owners
from chkpt_opt.graphs.frozen import graph_fact
from chkpt_opt.memory_model.unpack.rule import unpackable_ops

Staged = tuple[tuple[str, tuple[str, ...]], ...]


@graph_fact
def recomputed_storages(graph: CostGraph) -> dict[str, frozenset[str]]:
    """For every op, the storages a recomputation of it re-creates for later uses: those it
    returns and those it owns that some op saves."""
    owner = storage_owners(graph)
    saved_owned: dict[str, set[str]] = {}  # op -> the storages it owns that some op saves
    for _, a in graph.nodes(data=True):
        for sid in a["saved"]:
            saved_owned.setdefault(owner[sid], set()).add(sid)
    return {
        n: frozenset(a["outputs"]) | frozenset(saved_owned.get(n, ()))
        for n, a in graph.nodes(data=True)
    }


def stage_ops(graph: CostGraph) -> frozenset[str]:
    """The ops a stage may be at: those with a backward that make a storage of their own.
    Their output's autograd node is their own; an op that returns a tensor of an earlier op
    (``getitem`` of a tuple, a ``to`` that changes nothing) runs its backward in that op's
    node, where the executor could not tell its stage apart."""
    return frozenset(n for n, a in graph.nodes(data=True) if a["has_backward"] and a["outputs"])


def recomputable_ops(graph: CostGraph) -> frozenset[str]:
    """The ops a staged schedule may recompute (see the module docstring)."""
    return unpackable_ops(graph, draws_ok=True)


def staged_schedule(graph: CostGraph, stages: Mapping[str, Iterable[str]]) -> Staged:
    """The ``staged`` field for recomputing ``stages[b]`` before the backward of ``b``: in
    the backward pass's order, each stage's ops in execution order, empty stages dropped."""
    index = {n: graph.nodes[n]["index"] for n in graph.nodes}
    return tuple(
        (b, tuple(sorted(set(ops), key=index.__getitem__)))
        for b, ops in sorted(
            ((b, list(ops)) for b, ops in stages.items()), key=lambda item: -index[item[0]]
        )
        if ops
    )


def check_staged(graph: CostGraph, staged: Staged) -> None:
    """Checks a staged schedule's stages against ``graph``.

    Raises:
        ScheduleError: naming the stage or op, the problem and the fix.
    """
    allowed = recomputable_ops(graph)
    stages = stage_ops(graph)
    last = None
    for b, ops in staged:
        if b not in graph:
            raise ScheduleError(
                f"staged schedule: stage {short(b)} is not an op of graph "
                f"{graph.graph.get('name', '')!r}; was it made for another model?"
            )
        if not graph.nodes[b]["has_backward"]:
            raise ScheduleError(
                f"staged schedule: op {short(b)} runs no backward, so nothing can be "
                "recomputed before it; move its ops to the stage of an op that does."
            )
        if b not in stages:
            raise ScheduleError(
                f"staged schedule: op {short(b)} makes no storage of its own, so it has no "
                "autograd node of its own to recompute before; move its ops to the stage "
                "of the op whose backward runs just before it."
            )
        position = graph.nodes[b]["index"]
        if last is not None and position >= last:
            raise ScheduleError(
                f"staged schedule: stage {short(b)} is out of order or repeated; list stages "
                "once each, in the order the backward pass runs (latest forward op first)."
            )
        last = position
        if not ops:
            raise ScheduleError(f"staged schedule: stage {short(b)} recomputes nothing; drop it.")
        indices = [graph.nodes[n]["index"] if n in graph else -1 for n in ops]
        for n, i in zip(ops, indices, strict=True):
            if i < 0:
                raise ScheduleError(
                    f"staged schedule: stage {short(b)} recomputes {short(n)}, which is not "
                    "an op of the graph."
                )
            if n not in allowed:
                raise ScheduleError(
                    f"staged schedule: op {short(n)} cannot be recomputed (it returns a view, "
                    "writes or reads a tensor written in place, updates state or is a step "
                    "output); drop it from stage "
                    f"{short(b)}."
                )
        if indices != sorted(set(indices)):
            raise ScheduleError(
                f"staged schedule: the ops of stage {short(b)} must be listed once each, in "
                "execution order."
            )


def staged_from_json(data: Mapping[str, Any]) -> Staged:
    """The ``staged`` field from a schedule file's ``{"kind": "staged", "recompute": ...}``.

    Raises:
        ScheduleError: for malformed data.
    """
    unknown = sorted(set(data) - {"kind", "recompute"})
    if unknown:
        raise ScheduleError(
            f"schedule of kind 'staged' has unknown keys {unknown}; allowed: ['kind', 'recompute']."
        )
    value = data.get("recompute")
    shape_ok = isinstance(value, list) and all(
        isinstance(item, list)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], list)
        and item[1]
        and all(isinstance(n, str) for n in item[1])
        for item in value
    )
    if not shape_ok or not value:
        raise ScheduleError(
            "a staged schedule's 'recompute' must be a non-empty list of "
            '[backward op, [forward ops]] pairs, e.g. [["conv2", ["relu1"]]].'
        )
    return tuple((b, tuple(ops)) for b, ops in value)
