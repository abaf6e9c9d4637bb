"""Where a staged schedule recomputes what it recomputes (:class:`Stager`).

Given the ops to recompute, each runs again just before the first backward step that needs
it: one that unpacks what it made, or the stage of another recomputation that reads it; what
it makes is kept to its last use (:mod:`chkpt_opt.memory_model.staged.sequence`: every use
takes the latest instance). Extra recomputations (:data:`Again`) run an op once more at a
later step, with the recomputed ops it reads, so that no earlier value is held for that
step. Used by the rounding of :mod:`chkpt_opt.solvers.staged.rounding`.
"""

from __future__ import annotations

from collections.abc import Iterable

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_owners, storages_read
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile
from chkpt_opt.memory_model.staged import recomputable_ops, staged_schedule
from chkpt_opt.memory_model.staged.rule import stage_ops

Again = tuple[str, int]
"""An op recomputed once more, at the backward step of this index."""


class Stager:
    """Staged schedules recomputing given ops, each at its first use in the backward pass."""

    def __init__(self, graph: CostGraph) -> None:
        self.graph = graph
        self.order = ordered_nodes(graph)
        owner = self.owner = storage_owners(graph)
        self.sizes: dict[str, int] = {}
        for n in self.order:
            a = graph.nodes[n]
            self.sizes.update(a["saved"])
            self.sizes.update(a["outputs"])
        backward = [s.node for s in lower(graph, Schedule()) if s.kind == "bwd"]
        self.backward = backward
        self.hosts = stage_ops(graph)
        self.allowed = recomputable_ops(graph)
        # first_use[o]: the first backward step (its index in ``backward``) unpacking what
        # o made; readers[o]: the ops reading a storage o made.
        self.first_use: dict[str, int] = {}
        for k, b in enumerate(backward):
            for sid in graph.nodes[b]["saved"]:
                o = owner.get(sid)
                if o is not None and o not in self.first_use:
                    self.first_use[o] = k
        self.readers: dict[str, set[str]] = {o: set() for o in self.order}
        self.inputs: dict[str, set[str]] = {o: set() for o in self.order}
        for c in self.order:
            for sid in storages_read(graph, c, owner):
                o = owner.get(sid)
                if o is not None and o != c:
                    self.readers[o].add(c)
                    self.inputs[c].add(o)
        # unpacked_at[s]: the backward steps (indices in ``backward``) unpacking storage s.
        self.unpacked_at: dict[str, list[int]] = {}
        for k, b in enumerate(backward):
            for sid in graph.nodes[b]["saved"]:
                self.unpacked_at.setdefault(sid, []).append(k)
        self.position = {b: k for k, b in enumerate(backward)}

    def schedule(self, recomputed: Iterable[str], again: Iterable[Again] = ()) -> Schedule:
        """The staged schedule recomputing ``recomputed`` (those a staged schedule may), and
        each ``(op, k)`` of ``again`` once more at the ``k``-th backward step, with the ops of
        ``recomputed`` it reads (transitively), so that no earlier value is held for it."""
        chosen = set(recomputed) & self.allowed
        stages: dict[str, list[str]] = {}
        for op, k in again:
            self._place(stages, self._closure(op, chosen), k)
        for o, k in self._first_needed(chosen).items():
            self._place(stages, {o}, k)
        return Schedule(staged=staged_schedule(self.graph, stages))

    def _closure(self, op: str, chosen: set[str]) -> set[str]:
        """``op`` (where chosen) and the chosen ops it reads, transitively: what recomputing
        it once more runs."""
        todo, seen = [op], set()
        while todo:
            o = todo.pop()
            if o in seen or o not in chosen:
                continue
            seen.add(o)
            todo.extend(self.inputs[o])
        return seen

    def _first_needed(self, chosen: set[str]) -> dict[str, int]:
        """For each op of ``chosen``, the first backward step (its index) that needs it: one
        unpacking what it made, or the step whose stage recomputes a reader of it."""
        at: dict[str, int] = {}
        for o in reversed(self.order):  # readers first: a recomputation's inputs precede it
            if o not in chosen:
                continue
            uses = [at[c] for c in self.readers[o] if c in at]
            if o in self.first_use:
                uses.append(self.first_use[o])
            if uses:
                at[o] = min(uses)
        return at

    def pulled(self, recomputed: Iterable[str]) -> list[Again]:
        """The recomputed ops that a reader's recomputation pulls to a stage before their own
        first use (held from there to it), each as ``(op, its first use)``: recomputed once
        more there (with the recomputed ops it reads), the value the reader took dies with
        it. Cheapest forward first (ranked by the whole of what recomputing it once more
        runs, the Hugging Face families came out no better: T5 at its layers' peak 135.78 ms
        against 133.04, GPT-2 halfway to its floor 164.64 against 158.70)."""
        at = self._first_needed(set(recomputed) & self.allowed)
        found = [(o, self.first_use[o]) for o, k in at.items() if k < self.first_use.get(o, k)]
        return sorted(found, key=lambda item: (self.graph.nodes[item[0]]["fwd_time_s"], item[0]))

    def _place(self, stages: dict[str, list[str]], ops: Iterable[str], k: int) -> None:
        """Recomputes ``ops`` at the ``k``-th backward step, or the last stage before it."""
        while k >= 0 and self.backward[k] not in self.hosts:
            k -= 1  # an earlier stage is still in time
        if k >= 0:
            stages.setdefault(self.backward[k], []).extend(ops)

    def held_at_peak(self, schedule: Schedule, profile: MemoryProfile) -> list[Again]:
        """Where the peak is a backward step or a recomputation in its stage: each
        recomputed value alive there that neither the step nor the stage's recomputations
        still to run read, largest first, as ``(op, the next step unpacking it)``, once each."""
        timeline = profile.timeline
        host = profile.peak_index  # the backward step whose stage (or itself) peaks
        while host < len(timeline) and timeline[host].kind == "recompute":
            host += 1
        if host == len(timeline) or timeline[host].kind != "bwd":
            return []
        host_node = timeline[host].node
        if host_node not in self.position:
            return []
        read = set(self.graph.nodes[host_node]["saved"])
        for point in timeline[profile.peak_index : host]:  # the stage's ops still to run
            read.update(storages_read(self.graph, point.node, self.owner))
        live: dict[str, int] = {}
        for k, step in enumerate(lower(self.graph, schedule)):
            if k > profile.peak_index:
                break
            live.update(step.alloc)
            if k < profile.peak_index:
                for inst in step.free:
                    live.pop(inst, None)
        here = self.position[host_node]
        found: list[tuple[int, str, int]] = []
        for inst, nbytes in live.items():
            prefix, _, sid = inst.partition(":")
            if not prefix.startswith("s") or not prefix[1:].isdigit() or sid in read:
                continue
            later = [k for k in self.unpacked_at.get(sid, []) if k > here]
            if later and sid in self.owner:
                found.append((-nbytes, self.owner[sid], min(later)))
        return list(dict.fromkeys((op, k) for _, op, k in sorted(found)))
