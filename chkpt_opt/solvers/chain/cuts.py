"""Where dp_chain may cut a graph: the forward storages whose lives a schedule can extend,
and the largest set of allowed cut positions where each of them spans at most two adjacent
segments (see :mod:`chkpt_opt.solvers.chain.dp_chain`)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_owners, storage_refs
from chkpt_opt.memory_model.schedule import cut_positions


@dataclass(frozen=True)
class Storages:
    """The forward storages of a graph and the ops that read and save them.

    Attributes:
        owner_idx: storage -> index of the op that allocates it.
        size: bytes of every output and own saved buffer.
        births: per op, the storages it allocates.
        reads: per op, the storages its inputs refer to.
        readers: storage -> ops reading it; savers: storage -> ops saving it.
        step_outputs: storages the step returns (alive to the end under every schedule).
        spans: ``(owner, last reader or saver, storage)`` of every storage whose life a
            schedule can extend, by owner.
    """

    owner_idx: dict[str, int]
    size: dict[str, int]
    births: list[list[tuple[str, int]]]
    reads: list[set[str]]
    readers: dict[str, list[int]]
    savers: dict[str, list[int]]
    step_outputs: set[str]
    spans: list[tuple[int, int, str]]


def scan_storages(graph: CostGraph, order: list[str]) -> Storages:
    nodes = graph.nodes
    index = {v: i for i, v in enumerate(order)}
    owner_idx = {sid: index[o] for sid, o in storage_owners(graph).items()}
    refs = {v: storage_refs(graph, v) for v in order}
    size: dict[str, int] = {}
    births: list[list[tuple[str, int]]] = [[] for _ in order]
    reads: list[set[str]] = [set() for _ in order]
    readers: dict[str, list[int]] = {}
    savers: dict[str, list[int]] = {}
    for i, v in enumerate(order):
        attrs = nodes[v]
        for sid, nbytes in attrs["outputs"].items():
            size[sid] = nbytes
            births[i].append((sid, nbytes))
        for sid, nbytes in attrs["saved"].items():
            if owner_idx[sid] == i and sid not in attrs["outputs"]:
                size[sid] = nbytes
                births[i].append((sid, nbytes))
            savers.setdefault(sid, []).append(i)
        for u in graph.predecessors(v):
            for sid in refs[u]:
                reads[i].add(sid)
                readers.setdefault(sid, []).append(i)
    step_outputs = {sid for out in graph.graph["outputs"] for sid in refs[out]}
    spans = []
    for sid in sorted(size, key=lambda s: (owner_idx[s], s)):
        holders = set(readers.get(sid, ())) | set(savers.get(sid, ()))
        if holders and sid not in step_outputs:
            o = owner_idx[sid]
            spans.append((o, max(holders | {o}), sid))
    return Storages(owner_idx, size, births, reads, readers, savers, step_outputs, spans)


def cut_set(
    graph: CostGraph, n: int, spans: list[tuple[int, int, str]]
) -> tuple[list[int], list[int]]:
    """The allowed cut positions, and the largest subset the DP can use (see
    :func:`max_cuts`)."""
    ok = cut_positions(graph)
    allowed = [p for p in range(n + 1) if ok[p]]
    return allowed, max_cuts(allowed, [(lo, hi) for lo, hi, _ in spans if hi > lo])


def chain_cuts(graph: CostGraph) -> tuple[tuple[int, ...], bool]:
    """The cut positions dp_chain uses on ``graph``, and whether they are all its allowed cut
    positions (then dp_chain is exact over the whole schedule model). Cheap: no slots and no
    region data are built.

    Raises:
        SolverError: for a graph dp_chain does not model (see the module docstring).
    """
    order = ordered_nodes(graph)
    check_supported(graph, order)
    allowed, cuts = cut_set(graph, len(order), scan_storages(graph, order).spans)
    return tuple(cuts), len(cuts) == len(allowed)


def is_chain(graph: CostGraph) -> bool:
    """Whether dp_chain is exact over the whole schedule model of ``graph`` (every allowed
    cut is a boundary of its chain of segments)."""
    try:
        return chain_cuts(graph)[1]
    except SolverError:
        return False


def check_supported(graph: CostGraph, order: list[str]) -> None:
    for v in order:
        attrs = graph.nodes[v]
        keeps = attrs["n_saved"] > 0 or bool(attrs["saved"])
        if keeps and not (attrs["has_backward"] and attrs["n_saved"] > 0):
            raise SolverError(
                f"op {v!r} keeps tensors for a backward that never runs (or keeps activations "
                "with n_saved == 0); its tensors live to the end of the step across every "
                "piece of the chain, which dp_chain does not model; use solver 'cpsat'."
            )


def max_cuts(allowed: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """The largest subset of ``allowed`` (0 and n always kept) with at most one cut in every
    ``(lo, hi]`` of ``spans`` (ties: the earliest cuts); all of ``allowed`` when it qualifies.
    """
    if not allowed:
        return []
    n = allowed[-1]
    # reach[p]: the furthest hi of the spans containing position p (lo < p <= hi).
    reach = list(range(n + 1))
    starts: dict[int, int] = {}
    for lo, hi in spans:
        starts[lo + 1] = max(starts.get(lo + 1, 0), hi)
    furthest = -1
    for p in range(n + 1):
        furthest = max(furthest, starts.get(p, -1))
        reach[p] = max(p, furthest)
    interior = allowed[1:-1]
    if all(reach[a] < b for a, b in pairwise(interior)):
        return allowed
    # Longest chain of interior cuts where each next cut lies beyond the previous one's reach.
    best = [1] * len(interior)
    prev = [-1] * len(interior)
    for k, b in enumerate(interior):
        for j in range(k):
            if reach[interior[j]] < b and best[j] + 1 > best[k]:
                best[k], prev[k] = best[j] + 1, j
    if not interior:
        return allowed
    k = max(range(len(interior)), key=lambda t: (best[t], -t))
    chosen = []
    while k >= 0:
        chosen.append(interior[k])
        k = prev[k]
    return [0, *sorted(chosen), n]
