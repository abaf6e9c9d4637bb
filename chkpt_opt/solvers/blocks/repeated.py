"""Repeated blocks of a graph, and the split of its memory timeline by block.

A graph such as a transformer is a chain of *segments*: a prologue, repeated blocks (found
from the ops' ``module_path``: consecutive ops under the same ``<name>.<k>`` prefix, at least
two under one parent), an epilogue. When every region stays inside one segment, the memory at
every slot of the interval model splits into

* the segment's own part, which depends only on its own regions, with peak ``P`` over its own
  slots (forward and backward slots of its ops);
* the bytes ``K`` it keeps from its forward until its backward, which every later segment
  sees at every one of its slots;

so that the peak of the whole step is ``max_j (P_j + sum_{i<j} K_i)``. :func:`split_model`
checks, storage by storage and interval by interval, that this holds exactly, and refuses the
graph otherwise. The block boundaries can be shifted by a *phase* (:func:`phase_shifts`): the
same chain cut a few ops later, so that regions may straddle the original boundaries.
"""

from __future__ import annotations

import dataclasses
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_refs
from chkpt_opt.memory_model.schedule import cut_positions
from chkpt_opt.solvers.interval.model import IntervalModel, Lifetime

_BLOCK_KEY = re.compile(r"^((?:[^.]+\.)*?\d+)(?:\.|$)")


@dataclass(frozen=True)
class Blocks:
    """A graph cut into segments.

    Attributes:
        bounds: segment boundaries ``0 = b0 < b1 < ... = n_ops``, all allowed cuts.
        names: a name per segment (the module path of its first op's block, or a label).
        kinds: a signature id per segment; segments with the same id are identical.
        phase: how many ops the repeated blocks' boundaries were shifted by.
    """

    bounds: tuple[int, ...]
    names: tuple[str, ...]
    kinds: tuple[int, ...]
    phase: int = 0

    @property
    def segments(self) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` op range of every segment."""
        return list(pairwise(self.bounds))

    @property
    def repeated(self) -> list[int]:
        """Indices of the segments of the most repeated kind."""
        kind, _ = Counter(self.kinds).most_common(1)[0]
        return [j for j, k in enumerate(self.kinds) if k == kind]


def _block_keys(graph: CostGraph) -> list[str | None]:
    return [
        (m.group(1) if (m := _BLOCK_KEY.match(graph.nodes[v]["module_path"])) else None)
        for v in ordered_nodes(graph)
    ]


def find_blocks(graph: CostGraph, *, min_repeats: int = 2) -> Blocks | None:
    """The graph's segments (see the module docstring), or None without repeated blocks.

    Every boundary that is not an allowed cut moves to the next allowed cut.
    """
    bounds = _module_bounds(graph, _block_keys(graph), min_repeats)
    if bounds is None:
        return None
    blocks = make_blocks(graph, bounds)
    return blocks if len(blocks.repeated) >= min_repeats else None


def layer_spans(graph: CostGraph) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` op ranges of the model's own layers: the segments of
    :func:`find_blocks` named after a module key ``<parent>.<k>`` whose parent names at
    least two of them, alike or not (a Llama's first decoder layer, which computes what
    the others read, beside the others; T5's encoder and decoder blocks, whose first
    blocks differ from the rest): the regions of a model's own checkpointing. Empty where
    the graph has none."""
    keys = _block_keys(graph)
    bounds = _module_bounds(graph, keys, 2)
    if bounds is None:
        return []
    named = [(lo, hi, key) for lo, hi in pairwise(bounds) if (key := keys[lo]) is not None]
    parents = Counter(key.rsplit(".", 1)[0] for _, _, key in named)
    return [(lo, hi) for lo, hi, key in named if parents[key.rsplit(".", 1)[0]] > 1]


def _module_bounds(graph: CostGraph, keys: list[str | None], min_repeats: int) -> list[int] | None:
    """Segment boundaries where the ops' block ``keys`` change (:func:`_block_keys`), each
    moved to the next allowed cut; None where no parent module holds ``min_repeats``
    blocks."""
    n = len(keys)
    parents = Counter(k.rsplit(".", 1)[0] for k in dict.fromkeys(k for k in keys if k))
    if not parents or max(parents.values()) < min_repeats:
        return None
    ok = cut_positions(graph)
    bounds: list[int] = [0]
    for p in range(1, n):
        if keys[p] != keys[p - 1]:
            while p < n and not ok[p]:
                p += 1
            if p < n and p > bounds[-1]:
                bounds.append(p)
    return [*bounds, n]


def make_blocks(graph: CostGraph, bounds: Sequence[int], *, phase: int = 0) -> Blocks:
    """Segments with the given boundaries, named and grouped by signature (identical ops,
    sizes, times, flags and in-segment wiring)."""
    order = ordered_nodes(graph)
    keys = _block_keys(graph)
    index = {v: i for i, v in enumerate(order)}
    names, kinds = [], []
    signatures: dict[tuple, int] = {}
    shared = _shared_producers(graph, order, bounds)
    previous_lo = 0
    for lo, hi in pairwise(bounds):
        names.append(keys[lo] or ("prologue" if lo == 0 else f"ops {lo}..{hi - 1}"))
        signature = tuple(
            (
                a["op"],
                a["n_saved"],
                a["has_backward"],
                a["output_bytes"],
                a["saved_bytes"],
                a["fwd_workspace_bytes"],
                a["bwd_workspace_bytes"],
                a["grad_bytes"],
                a["cut_after_ok"],
                a["fwd_time_s"],
                tuple(
                    ("shared", u) if u in shared else _wire(u, index[u], i, lo, previous_lo)
                    for u in sorted(graph.predecessors(v), key=index.get)
                ),
            )
            for i, v in enumerate(order[lo:hi], start=lo)
            for a in (graph.nodes[v],)
        )
        kinds.append(signatures.setdefault(signature, len(signatures)))
        previous_lo = lo
    return Blocks(tuple(bounds), tuple(names), tuple(kinds), phase)


def _shared_producers(graph: CostGraph, order: list[str], bounds: Sequence[int]) -> set[str]:
    """Ops read by more than one later segment (a position bias the first block computes
    and every block reads): blocks read them by name, wherever they are."""
    segment = {v: bisect_right(bounds, i) - 1 for i, v in enumerate(order)}
    return {u for u in order if len({segment[w] for w in graph.successors(u)} - {segment[u]}) > 1}


def _wire(producer: str, at: int, consumer_at: int, lo: int, previous_lo: int) -> Any:
    """How an op reads one input, alike in identical blocks: by offset from the reader
    inside the segment and the previous one (the chain), by name from further back (a
    tensor every block reads, such as rotary embeddings or an attention mask)."""
    return at - consumer_at if at >= previous_lo else ("shared", producer)


def phase_shifts(graph: CostGraph, blocks: Blocks, *, max_phases: int) -> list[Blocks]:
    """Up to ``max_phases`` cuttings of the chain with the repeated blocks' boundaries shifted
    by ``d`` ops (``0 < d <`` block length), for the shifts where every boundary is an allowed
    cut; spread evenly over the valid shifts."""
    repeated = blocks.repeated
    segs = blocks.segments
    lengths = {segs[j][1] - segs[j][0] for j in repeated}
    if len(lengths) != 1 or max_phases <= 0:
        return []
    length = lengths.pop()
    ok = cut_positions(graph)
    n = len(ok) - 1
    first = segs[repeated[0]][0]
    holders = _holders(graph)
    valid: list[tuple[int, list[int]]] = []
    for d in range(1, length):
        inner = [segs[j][0] + d for j in repeated]
        if all(p < n and ok[p] for p in inner):
            outer = [b for b in blocks.bounds if b <= first or b > inner[-1]]
            bounds = sorted({0, n, *outer, *inner})
            if _holders_split(bounds, holders):
                valid.append((d, bounds))
    if len(valid) > max_phases:
        step = len(valid) / max_phases
        valid = [valid[int(k * step)] for k in range(max_phases)]
    return [make_blocks(graph, bounds, phase=d) for d, bounds in valid]


def _holders(graph: CostGraph) -> list[list[int]]:
    """For every storage that may outlive the forward pass, the ops that may hold it (its
    readers and savers)."""
    order = ordered_nodes(graph)
    index = {v: i for i, v in enumerate(order)}
    outputs = {sid for out in graph.graph["outputs"] for sid in storage_refs(graph, out)}
    held: dict[str, set[int]] = {}
    for v in order:
        i = index[v]
        for u in graph.predecessors(v):
            for sid in storage_refs(graph, u):
                held.setdefault(sid, set()).add(i)
        for sid in graph.nodes[v]["saved"]:
            held.setdefault(sid, set()).add(i)
    return [sorted(ops) for sid, ops in sorted(held.items()) if sid not in outputs]


def _holders_split(bounds: Sequence[int], holders: list[list[int]]) -> bool:
    """Whether every storage's holders lie in one segment (a necessary condition for
    :func:`split_model`, cheap to test before building a model)."""
    return all(bisect_right(bounds, ops[0]) == bisect_right(bounds, ops[-1]) for ops in holders)


@dataclass
class Segment:
    """One segment's share of the interval model.

    Attributes:
        lo: first op.
        hi: one past its last op.
        slots: the slots it owns (its ops' forward and backward slots).
        intervals: candidate intervals inside it.
        lifetimes: lifetimes whose holders all lie inside it.
        kept_end: for each of those lifetimes, the index of the first end that keeps it
            alive through every later segment (None: it never is).
    """

    lo: int
    hi: int
    slots: list[int] = field(default_factory=list)
    intervals: list[int] = field(default_factory=list)
    lifetimes: list[int] = field(default_factory=list)
    kept_end: list[int | None] = field(default_factory=list)


def fold_shared_lifetimes(model: IntervalModel, blocks: Blocks) -> tuple[IntervalModel, int]:
    """The model with every storage held by ops of several segments made schedule-free:
    alive until the latest end any schedule gives it (its bytes join ``base_bytes``).

    Such a storage is one that every block reads from the prologue (a model's rotary
    embeddings, an attention mask). The folded model never under-states the memory, so a
    schedule it accepts fits; it may over-state by those bytes at some slots, so it proves
    nothing about optimality. Returns the model and the number of storages folded.
    """
    seg_of_op = [0] * model.n_ops
    for j, (lo, hi) in enumerate(blocks.segments):
        for i in range(lo, hi):
            seg_of_op[i] = j
    base = list(model.base_bytes)
    kept: list[Lifetime] = []
    folded = 0
    for life in model.lifetimes:
        if len({seg_of_op[h.node] for h in life.holders}) <= 1:
            kept.append(life)
            continue
        last = min(max(life.ends, default=life.fixed_end), model.end_slot - 1)
        for slot in range(life.fixed_end + 1, last + 1):
            base[slot] += life.size_bytes
        folded += 1
    if not folded:
        return model, 0
    return dataclasses.replace(model, lifetimes=tuple(kept), base_bytes=tuple(base)), folded


def split_model(model: IntervalModel, blocks: Blocks) -> list[Segment]:
    """Assigns slots, intervals and lifetimes to segments, checking that the memory splits.

    Raises:
        SolverError: if some storage's life depends on two segments, or reaches a later
            segment only in part, or an interval holds memory outside its segment (then the
            peak is not ``max_j (P_j + sum_{i<j} K_i)``).
    """
    segments = [Segment(lo, hi) for lo, hi in blocks.segments]
    seg_of_op = [0] * model.n_ops
    for j, seg in enumerate(segments):
        for i in range(seg.lo, seg.hi):
            seg_of_op[i] = j
    index = {v: i for i, v in enumerate(model.nodes)}
    seg_of_slot = []
    for s, (kind, v) in enumerate(model.slots):
        j = len(segments) - 1 if kind == "bwd_start" else seg_of_op[index[v]]
        seg_of_slot.append(j)
        segments[j].slots.append(s)
    last = model.end_slot - 1
    for k, iv in enumerate(model.intervals):
        j = seg_of_op[iv.start]
        if seg_of_op[iv.stop - 1] != j:
            raise SolverError(f"interval {iv.start}..{iv.stop} crosses a block boundary.")
        segments[j].intervals.append(k)
        touched = [iv.replay_slot] if iv.replay_slot is not None else []
        touched += [min(e, last) for e, _ in iv.held_after_replay]
        if any(seg_of_slot[t] != j for t in touched):
            raise SolverError(f"interval {iv.start}..{iv.stop} holds memory outside its block.")
    later: list[set[int]] = [set() for _ in segments]
    for j in range(len(segments) - 2, -1, -1):
        later[j] = later[j + 1] | set(segments[j + 1].slots)
    for lt, life in enumerate(model.lifetimes):
        owners = {seg_of_op[h.node] for h in life.holders}
        if len(owners) != 1:
            raise SolverError(
                f"storage {life.storage!r} is held by ops of several blocks {sorted(owners)}; "
                "the memory does not split by block."
            )
        j = owners.pop()
        segments[j].lifetimes.append(lt)
        segments[j].kept_end.append(_kept_end(life, j, seg_of_slot, later[j], last))
    return segments


def _kept_end(
    life: Lifetime, j: int, seg_of_slot: list[int], later: set[int], last: int
) -> int | None:
    """Index of the first end at which ``life`` covers every later segment's slots."""
    first = None
    for k, end in enumerate(life.ends):
        alive = range(life.fixed_end + 1, min(end, last) + 1)
        outside = [s for s in alive if seg_of_slot[s] != j]
        if any(seg_of_slot[s] < j for s in outside):
            raise SolverError(f"storage {life.storage!r} outlives the backward of its block.")
        covered = bool(later) and later.issubset(alive)
        if outside and not covered:
            raise SolverError(f"storage {life.storage!r} reaches a later block only in part.")
        if covered and first is None:
            first = k
    return first


def evaluate(model: IntervalModel, seg: Segment, chosen: Sequence[int]) -> tuple[int, int, float]:
    """``(P, K, cost)`` of the chosen intervals, all inside ``seg``, computed exactly."""
    containing = model.containing(chosen)
    own = {s: model.base_bytes[s] for s in seg.slots}
    kept = 0
    last = model.end_slot - 1
    for lt, kept_k in zip(seg.lifetimes, seg.kept_end):
        life = model.lifetimes[lt]
        end = life.end_under(containing)
        for s in range(life.fixed_end + 1, min(end, last) + 1):
            if s in own:
                own[s] += life.size_bytes
        if kept_k is not None and end >= life.ends[kept_k]:
            kept += life.size_bytes
    for k in chosen:
        iv = model.intervals[k]
        if iv.replay_slot is None:
            continue
        own[iv.replay_slot] += iv.replay_peak_bytes
        for end, nbytes in iv.held_after_replay:
            for s in range(iv.replay_slot + 1, min(end, last) + 1):
                own[s] += nbytes
    return max(own.values(), default=0), kept, sum(model.intervals[k].cost_s for k in chosen)
