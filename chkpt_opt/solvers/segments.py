"""Where a graph can be cut into segments, and how much crosses each cut.

Chen et al.'s heuristics ("Training Deep Nets with Sublinear Memory Cost", 2016) cut a
network at its articulation points and recompute the segments between the cuts. On a
general DAG the analogue of an articulation point is a position of the execution order
where few bytes cross: few storages produced before it are still read after it.
"""

from __future__ import annotations

import itertools

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_refs
from chkpt_opt.memory_model.schedule import cut_positions


def last_reads(graph: CostGraph) -> dict[str, int]:
    """The index of the last op that reads each storage (``n`` for the step outputs')."""
    nodes = graph.nodes
    last_read: dict[str, int] = {}
    for node in ordered_nodes(graph):
        i = nodes[node]["index"]
        for pred in graph.predecessors(node):
            for sid in storage_refs(graph, pred):
                last_read[sid] = max(last_read.get(sid, -1), i)
    for out in graph.graph["outputs"]:
        for sid in storage_refs(graph, out):
            last_read[sid] = graph.number_of_nodes()
    return last_read


def crossing_bytes(graph: CostGraph) -> list[int]:
    """Bytes of forward storages alive across each position.

    ``crossing[p]`` (for ``p`` in ``0..n``) counts the storages produced by ops before
    index ``p`` and read by an op at index ``p`` or later (graph outputs are read at ``n``).
    """
    nodes = graph.nodes
    order = ordered_nodes(graph)
    n = len(order)
    produced: dict[str, tuple[int, int]] = {}
    for node in order:
        for sid, nbytes in nodes[node]["outputs"].items():
            produced[sid] = (nodes[node]["index"], nbytes)
    last_read = last_reads(graph)
    delta = [0] * (n + 2)
    for sid, (i, nbytes) in produced.items():
        last = last_read.get(sid, -1)
        if last > i:
            delta[i + 1] += nbytes
            delta[last + 1] -= nbytes
    crossing = []
    running = 0
    for p in range(n + 1):
        running += delta[p]
        crossing.append(running)
    return crossing


def candidate_cuts(graph: CostGraph, *, window: int = 3) -> list[int]:
    """Valid interior cut positions that are local minima of the crossing bytes.

    A position qualifies when no valid position within ``window`` steps on either side
    has fewer crossing bytes. The result is sorted; it is never empty for a graph with
    at least one valid interior position.
    """
    ok = cut_positions(graph)
    crossing = crossing_bytes(graph)
    n = len(crossing) - 1
    valid = [p for p in range(1, n) if ok[p]]
    chosen = []
    for k, p in enumerate(valid):
        lo, hi = max(0, k - window), min(len(valid), k + window + 1)
        if all(crossing[p] <= crossing[q] for q in valid[lo:hi]):
            chosen.append(p)
    return chosen or valid


def spans_between(cuts: list[int], n: int, *, skip_last: bool = False) -> list[tuple[int, int]]:
    """The ``[start, stop)`` spans between consecutive cuts (0 and ``n`` implied)."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < n)), n]
    spans = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    return spans[:-1] if skip_last else spans
