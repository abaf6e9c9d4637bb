"""The recompute bound's rows: the closures computed a block of steps at a time are those a
plain walk of the graph finds, step by step, and the bound does not depend on the block size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_owners, storage_refs
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.bounds import bound_rows, recompute_bound
from chkpt_opt.solvers.bounds.bound_rows import KeepAllRows

CORPUS = Path(__file__).resolve().parents[3] / "graphs"


def _walked(graph: CostGraph) -> dict[int, tuple[set[str], set[tuple[str, str]], set[str]]]:
    """Step -> (closure ops, reads, kept storages), by a walk from the definitions: alive
    forward storages that the step neither makes nor reads and no later forward op reads
    may be dropped; those a later backward op unpacks are kept; a recomputation reaches the
    owner of every storage an op of it reads, unless the storage is alive and not droppable."""
    owner = storage_owners(graph)
    order = ordered_nodes(graph)
    steps = lower(graph, Schedule())
    reads = {n: {s for u in graph.predecessors(n) for s in storage_refs(graph, u)} for n in order}
    fwd = {s.node: p for p, s in enumerate(steps) if s.kind == "fwd"}
    bwd = {s.node: p for p, s in enumerate(steps) if s.kind == "bwd"}
    last_read = {s: max(fwd[n] for n in order if s in reads[n]) for n in order for s in reads[n]}
    for out in graph.graph["outputs"]:
        last_read.update({s: len(steps) for s in storage_refs(graph, out)})
    unpack: dict[str, int] = {}
    for n in order:
        if graph.nodes[n]["has_backward"]:
            for s in graph.nodes[n]["saved"]:
                unpack[s] = max(unpack.get(s, -1), bwd[n])
    alive: set[str] = set()
    found = {}
    for p, step in enumerate(steps):
        made = {i[2:] for i, _ in step.alloc if i.startswith("f:")}
        alive |= made
        now = set(graph.nodes[step.node]["saved"]) if step.kind == "bwd" else set()
        droppable = {s for s in alive - made - now if last_read.get(s, -1) < p}
        kept = {s for s in droppable if unpack.get(s, -1) > p}
        ops, edges, todo = set(), set(), [owner[s] for s in kept]
        while todo:
            op = todo.pop()
            if op not in ops:
                ops.add(op)
                for t in reads[op]:
                    if t in owner and (t not in alive or t in droppable):
                        edges.add((op, t))
                        todo.append(owner[t])
        found[p] = (ops, edges, kept)
        alive -= {i[2:] for i in step.free if i.startswith("f:")}
    return found


@pytest.mark.parametrize("name", ["gpt_small", "resnet_small", "unet_small", "mobilenet_small"])
@pytest.mark.parametrize("block_steps", [1, 7, 256])
def test_block_closures_are_those_of_a_walk(
    name: str, block_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bound_rows, "BLOCK_STEPS", block_steps)
    graph = load_graph(CORPUS / f"{name}.json")
    rows = KeepAllRows(graph)
    walked = _walked(graph)
    storages, ops = rows.storages, rows.ops
    assert rows.prepare(rows.rows)
    for row in rows.rows:
        want_ops, want_reads, want_kept = walked[row.position]
        assert {storages[k] for k in row.kept} == want_kept
        got = rows.arrays(row)
        assert {ops[o] for o in got.ops} == want_ops
        names = [storages[k] for k in row.kept]
        extra = sorted({t for _, t in want_reads} - want_kept)
        names += extra
        assert len(got.sizes) == len(names)
        reads = {(ops[o], names[t]) for o, t in zip(got.read_op, got.read_storage)}
        assert reads == want_reads
        owner = storage_owners(graph)
        assert [ops[o] for o in got.read_owner] == [owner[names[t]] for t in got.read_storage]
        assert [ops[o] for o in got.kept_owner] == [owner[s] for s in names[: got.kept]]
        ordered = rows.walk_ordered(row)  # the same closure, in the order of a walk
        assert [ops[o] for o in ordered.ops] == sorted(want_ops)
        assert ordered.sizes[: got.kept].tolist() == got.sizes[: got.kept].tolist()
        assert sorted(ordered.sizes.tolist()) == sorted(got.sizes.tolist())
        pairs = [(ops[o], ops[w]) for o, w in zip(ordered.read_op, ordered.read_owner)]
        assert sorted(pairs) == sorted((o, owner[t]) for o, t in want_reads)


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_does_not_depend_on_the_block_size(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = random_dag(30, seed=seed)
    budget = int(0.6 * simulate(graph, Schedule()).peak_bytes)
    found = []
    for block_steps in (1, 5, 256):
        monkeypatch.setattr(bound_rows, "BLOCK_STEPS", block_steps)
        recompute_bound._memo.clear()
        recompute_bound._rows_memo.clear()
        found.append(recompute_bound.recompute_bound(graph, budget))
    assert all(b.complete for b in found)
    values = [b.bound_s for b in found]
    assert values[0] is not None and np.allclose(values, values[0], rtol=1e-12, atol=0)
