"""The rows of the recompute bound (:mod:`~chkpt_opt.solvers.bounds.recompute_bound`): one
per step of the keep-all op sequence, with what a recomputation after the step may involve.

At step ``p`` a forward storage alive under keep-all is *fixed* (alive there under every
schedule: made by the step, read by it, or still read by a later forward op or the step's
outputs), *kept* (a later backward op unpacks it) or *free* (kept for nothing: dropped at no
cost). The *closure* of the step is the set of ops a recomputation after ``p`` may run: the
owners of its kept storages and, transitively, the owners of every storage such an op reads
that is not fixed at ``p``; its *reads* are those ``(op, storage)`` pairs.

Computing the closure of each step by a walk of the graph costs the graph's size per step,
its square in all (1.3 s of Python per round on a 32-layer decoder). Here the closures of a
block of steps are computed together: ``reach[o, j]`` (op ``o`` is in the closure of the
``j``-th step of the block) starts at the owners of the step's kept storages and flows from
each reader to the owner of each storage it reads, where that storage is not fixed at the
step; readers are visited last to first in the graph's topological order, so each flow is
a single pass over the reads, a few boolean vector operations each (repeated until nothing
changes where a read is not topological). The result is the same set of ops and reads as
the walk's, as index arrays (:class:`~chkpt_opt.solvers.bounds.row_check.RowArrays`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from chkpt_opt.graphs.costgraph import (
    CostGraph,
    ordered_nodes,
    owned_storages,
    storage_owners,
    storage_refs,
)
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.solvers.bounds.row_check import RowArrays
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline

BLOCK_STEPS = 256
"""Steps whose closures are computed together (memory: ops x this many booleans)."""

NEVER = np.iinfo(np.int64).max
"""A step index after every step (a storage never freed, never unpacked)."""

Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class StepRow:
    """One step of the keep-all sequence: its bytes, as the relaxation sees them.

    Attributes:
        position: the step's position in the keep-all sequence.
        during_bytes: bytes alive while the step runs under keep-all, those kept for free
            left out.
        fixed_bytes: of these, the bytes alive at this step under every schedule.
        kept: indices (:attr:`KeepAllRows.storages`) of the storages kept for a later
            backward, in the order of their ids.
        kept_bytes: their bytes.
    """

    position: int
    during_bytes: int
    fixed_bytes: int
    kept: Ints
    kept_bytes: Ints


class KeepAllRows:
    """The rows of every step of the keep-all op sequence of a graph, and their closures.

    Attributes:
        ops: the graph's ops in topological order (the op indices of the arrays).
        fwd_time_s: each op's forward time, by op index.
        total_fwd_s: their sum.
        storages: every forward storage id, sorted (the storage indices of the arrays).
        rows: one :class:`StepRow` per step.
        floor_bytes: the largest ``fixed_bytes``: a lower bound on every schedule's peak.
    """

    def __init__(self, graph: CostGraph, deadline: Deadline = NO_DEADLINE) -> None:
        nodes = graph.nodes
        self.ops = ordered_nodes(graph)
        op_index = {n: k for k, n in enumerate(self.ops)}
        owner = storage_owners(graph)
        self.fwd_time_s = np.array([nodes[n]["fwd_time_s"] for n in self.ops], dtype=float)
        self.total_fwd_s = sum(nodes[n]["fwd_time_s"] for n in self.ops)
        steps = lower(graph, Schedule())
        self.n_steps = len(steps)
        refs = {n: storage_refs(graph, n) for n in self.ops}
        reads = {
            n: sorted({sid for u in graph.predecessors(n) for sid in refs[u]}) for n in self.ops
        }
        forward_ids = {inst[2:] for step in steps for inst, _ in step.alloc if inst[:2] == "f:"}
        self.storages = sorted(forward_ids | set(owner))
        where = {sid: k for k, sid in enumerate(self.storages)}
        n_storages = len(self.storages)
        # Each storage's owner op (-1: none) and bytes as its owner makes it.
        self.storage_owner = np.full(n_storages, -1, dtype=np.int64)
        self.owned_bytes = np.zeros(n_storages, dtype=np.int64)
        for n in self.ops:
            for sid, nbytes in owned_storages(graph, n, owner).items():
                self.storage_owner[where[sid]] = op_index[n]
                self.owned_bytes[where[sid]] = nbytes
        # The reads through which a recomputation reaches further ops: (reader, storage),
        # readers last to first.
        pairs = [
            (op_index[n], where[sid])
            for n in reversed(self.ops)
            for sid in reads[n]
            if sid in owner
        ]
        self.read_op = np.array([o for o, _ in pairs], dtype=np.int64)
        self.read_storage = np.array([s for _, s in pairs], dtype=np.int64)
        self._topological = bool(np.all(self.storage_owner[self.read_storage] < self.read_op))
        # Lifetimes under keep-all: made at, freed after, last forward reader, last unpack.
        fwd_pos = {s.node: p for p, s in enumerate(steps) if s.kind == "fwd"}
        bwd_pos = {s.node: p for p, s in enumerate(steps) if s.kind == "bwd"}
        self.made_at = np.full(n_storages, NEVER, dtype=np.int64)
        self.freed_at = np.full(n_storages, NEVER, dtype=np.int64)
        self.forward_end = np.full(n_storages, -1, dtype=np.int64)
        last_unpack = np.full(n_storages, -1, dtype=np.int64)
        alloc_bytes = np.zeros(n_storages, dtype=np.int64)
        for n in self.ops:
            for sid in reads[n]:
                if sid in where:
                    k = where[sid]
                    self.forward_end[k] = max(self.forward_end[k], fwd_pos[n])
            if nodes[n]["has_backward"]:
                for sid in nodes[n]["saved"]:
                    last_unpack[where[sid]] = max(last_unpack[where[sid]], bwd_pos[n])
        for out in graph.graph["outputs"]:
            for sid in refs[out]:
                if sid in where:
                    self.forward_end[where[sid]] = len(steps)
        # The storages each backward step reads (fixed there).
        self.read_now: dict[int, Ints] = {}
        during = np.zeros(len(steps), dtype=np.int64)
        live_bytes = 0
        sizes: dict[str, int] = {}
        for p, step in enumerate(steps):
            if p % 256 == 0:
                deadline.check("walking the keep-all op sequence for the recompute bound")
            for inst, nbytes in step.alloc:
                sizes[inst] = nbytes
                live_bytes += nbytes
                if inst[:2] == "f:":
                    k = where[inst[2:]]
                    if self.made_at[k] != NEVER:
                        raise ValueError(
                            f"storage {inst[2:]!r} is made twice in the keep-all sequence "
                            f"(steps {self.made_at[k]} and {p}); the recompute bound reads "
                            "one lifetime per storage: check the graph's storage ids"
                        )
                    self.made_at[k] = p
                    alloc_bytes[k] = nbytes
            during[p] = live_bytes + step.transient_bytes
            if step.kind == "bwd":
                saved = [where[sid] for sid in nodes[step.node]["saved"] if sid in where]
                self.read_now[p] = np.array(sorted(saved), dtype=np.int64)
            for inst in step.free:
                live_bytes -= sizes.pop(inst)
                if inst[:2] == "f:":
                    self.freed_at[where[inst[2:]]] = p
        self._rows_of(during, alloc_bytes, last_unpack, deadline)
        # position -> the closure's ops and reads, as bits (see :meth:`_block`).
        self._closures: dict[int, tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]] = {}

    def _rows_of(
        self, during: Ints, alloc_bytes: Ints, last_unpack: Ints, deadline: Deadline
    ) -> None:
        """Sorts each step's alive forward storages into fixed, kept and free."""
        rows: list[StepRow] = []
        for p in range(self.n_steps):
            if p % 256 == 0:
                deadline.check("sorting the storages of the keep-all sequence")
            droppable = self._droppable(np.array([p]))[:, 0]
            kept_mask = droppable & (last_unpack > p)
            free_bytes = int(alloc_bytes[droppable & ~kept_mask].sum())
            kept = np.flatnonzero(kept_mask)
            kept_bytes = alloc_bytes[kept]
            during_bytes = int(during[p]) - free_bytes
            rows.append(
                StepRow(p, during_bytes, during_bytes - int(kept_bytes.sum()), kept, kept_bytes)
            )
        self.rows = rows
        self.floor_bytes = max((r.fixed_bytes for r in rows), default=0)

    def _droppable(self, positions: Ints) -> npt.NDArray[np.bool_]:
        """``[storage, j]``: the storage is alive at ``positions[j]`` under keep-all and some
        schedule may not have it there (neither made nor read by the step, nor read later in
        the forward pass)."""
        at = positions[None, :]
        made, freed = self.made_at[:, None], self.freed_at[:, None]
        out = (made < at) & (at <= freed) & (self.forward_end[:, None] < at)
        for j, p in enumerate(positions.tolist()):
            if p in self.read_now:
                out[self.read_now[p], j] = False
        return out

    def _fixed(self, positions: Ints) -> npt.NDArray[np.bool_]:
        """``[storage, j]``: the storage is alive at ``positions[j]`` under every schedule."""
        at = positions[None, :]
        alive = (self.made_at[:, None] <= at) & (at <= self.freed_at[:, None])
        return alive & ~self._droppable(positions)

    def arrays(self, row: StepRow) -> RowArrays:
        """The storages, ops and reads of ``row``'s closure, as index arrays."""
        on, ops = self._closure(row)
        read_storage = self.read_storage[on]
        is_extra = np.zeros(len(self.storages), dtype=bool)
        is_extra[read_storage] = True
        is_extra[row.kept] = False
        extra = np.flatnonzero(is_extra)
        local = np.zeros(len(self.storages), dtype=np.int64)
        local[row.kept] = np.arange(len(row.kept))
        local[extra] = len(row.kept) + np.arange(len(extra))
        return RowArrays(
            sizes=np.concatenate([row.kept_bytes, self.owned_bytes[extra]]).astype(float),
            kept=len(row.kept),
            kept_owner=self.storage_owner[row.kept],
            read_storage=local[read_storage],
            read_op=self.read_op[on],
            read_owner=self.storage_owner[read_storage],
            ops=ops,
        )

    def _closure(self, row: StepRow) -> tuple[Ints, Ints]:
        """The reads (indices in :attr:`read_op`) and the ops of ``row``'s closure."""
        if row.position not in self._closures:
            self.prepare([row])
        ops_bits, reads_bits = self._closures[row.position]
        on = np.flatnonzero(np.unpackbits(reads_bits, count=len(self.read_op)))
        return on, np.flatnonzero(np.unpackbits(ops_bits, count=len(self.ops)))

    def walk_ordered(self, row: StepRow) -> RowArrays:
        """:meth:`arrays` in the order of a depth-first walk from the owners of the kept
        storages, smallest op id first (reads in the order the walk meets them, the storages
        beside the kept ones in the order it first reads them, ops by id): the order in which
        the LP was built before the closures were computed in blocks, so that the LP solver
        meets the same program and returns the same solution (its shares round into
        schedules, and the roundings were measured on those)."""
        on, ops = self._closure(row)
        read_global = self.read_storage[on]
        op_reads: dict[int, list[tuple[int, int]]] = {}
        for e, (o, t) in enumerate(zip(self.read_op[on].tolist(), read_global.tolist())):
            op_reads.setdefault(o, []).append((t, e))
        name = self.ops
        kept = set(row.kept.tolist())
        owners = self.storage_owner[row.kept].tolist()
        stack = sorted(set(owners), key=lambda o: name[o], reverse=True)
        seen: set[int] = set()
        order: list[int] = []
        extra: dict[int, None] = {}
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for t, e in op_reads.get(op, []):
                order.append(e)
                if t not in kept:
                    extra[t] = None
                stack.append(int(self.storage_owner[t]))
        extra_ids = np.array(list(extra), dtype=np.int64)
        local = np.zeros(len(self.storages), dtype=np.int64)
        local[row.kept] = np.arange(len(row.kept))
        local[extra_ids] = len(row.kept) + np.arange(len(extra_ids))
        taken = np.array(order, dtype=np.int64)
        return RowArrays(
            sizes=np.concatenate([row.kept_bytes, self.owned_bytes[extra_ids]]).astype(float),
            kept=len(row.kept),
            kept_owner=self.storage_owner[row.kept],
            read_storage=local[read_global[taken]],
            read_op=self.read_op[on][taken],
            read_owner=self.storage_owner[read_global[taken]],
            ops=np.array(sorted(ops.tolist(), key=lambda o: name[o]), dtype=np.int64),
        )

    def prepare(self, rows: list[StepRow], deadline: Deadline = NO_DEADLINE) -> bool:
        """Computes the closures of ``rows`` (those not computed yet), a block at a time;
        False where ``deadline`` passed before every one was."""
        missing = [r for r in rows if r.position not in self._closures]
        for start in range(0, len(missing), BLOCK_STEPS):
            if deadline.expired():
                return False
            self._block(missing[start : start + BLOCK_STEPS])
        return True

    def _block(self, rows: list[StepRow]) -> None:
        """The closures of a block of rows (see the module docstring), kept as bits: the
        ops in it, and the reads through which it grows."""
        positions = np.array([r.position for r in rows], dtype=np.int64)
        open_reads = ~self._fixed(positions)[self.read_storage]  # [read, j]
        reach = np.zeros((len(self.ops), len(rows)), dtype=bool)  # [op, j]
        for j, row in enumerate(rows):
            reach[self.storage_owner[row.kept], j] = True
        targets = self.storage_owner[self.read_storage].tolist()
        readers = self.read_op.tolist()
        changed = True
        while changed:
            before = None if self._topological else reach.copy()
            for e, (reader, target) in enumerate(zip(readers, targets)):
                reach[target] |= reach[reader] & open_reads[e]
            changed = before is not None and not np.array_equal(before, reach)
        reads_bits = np.packbits((reach[self.read_op] & open_reads).T, axis=1)
        ops_bits = np.packbits(reach.T, axis=1)
        for j, row in enumerate(rows):
            self._closures[row.position] = (ops_bits[j], reads_bits[j])
