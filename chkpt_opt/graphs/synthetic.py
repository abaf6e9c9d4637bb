"""Synthetic cost graphs: chains and random DAGs, for solver tests and benchmarks.

They follow the same memory semantics as traced graphs: each op owns one output storage,
saves its input(s), its output, or nothing, and its gradient has the size of its output.
Everything is deterministic for a given seed.

Example:
    >>> g = random_dag(10, seed=0)
    >>> g.number_of_nodes(), g.graph["outputs"]
    (10, ['n9'])
"""

from __future__ import annotations

import random

from chkpt_opt.graphs.costgraph import CostGraph, new_graph, node_attrs


def _add_op(
    graph: CostGraph,
    index: int,
    inputs: list[str],
    *,
    out_bytes: int,
    saves: str,
    fwd_time_s: float,
    fwd_flops: int,
) -> str:
    name = f"n{index}"
    saved: dict[str, int] = {}
    if saves == "input":
        for u in inputs:
            saved.update(graph.nodes[u]["outputs"])
    elif saves == "output":
        saved[name] = out_bytes
    graph.add_node(
        name,
        **node_attrs(
            index=index,
            op=f"synthetic.{saves}",
            outputs={name: out_bytes},
            saved=saved,
            grad_bytes=out_bytes,
            fwd_flops=fwd_flops,
            bwd_flops=2 * fwd_flops,
            fwd_time_s=fwd_time_s,
            bwd_time_s=2 * fwd_time_s,
        ),
    )
    for u in inputs:
        graph.add_edge(u, name)
    return name


def chain_graph(
    length: int,
    *,
    activation_bytes: int | list[int] = 1 << 20,
    fwd_time_s: float | list[float] = 1e-3,
    saves: str = "input",
    name: str = "",
) -> CostGraph:
    """A chain of ``length`` ops, each reading the previous one.

    Args:
        length: number of ops.
        activation_bytes: output size of every op, or one size per op (heterogeneous chain).
        fwd_time_s: forward time of every op, or one per op.
        saves: what each op's backward keeps: ``"input"``, ``"output"`` or ``"none"``.
        name: graph name (default ``chain<length>``).
    """
    sizes = activation_bytes if isinstance(activation_bytes, list) else [activation_bytes] * length
    times = fwd_time_s if isinstance(fwd_time_s, list) else [fwd_time_s] * length
    if len(sizes) != length or len(times) != length:
        raise ValueError("per-op lists must have one entry per op")
    graph = new_graph(name or f"chain{length}")
    previous: list[str] = []
    for i in range(length):
        node = _add_op(
            graph,
            i,
            previous,
            out_bytes=sizes[i],
            saves=saves if previous or saves != "input" else "none",
            fwd_time_s=times[i],
            fwd_flops=int(times[i] * 1e9),
        )
        previous = [node]
    graph.graph["outputs"] = previous
    return graph


def random_dag(
    n_ops: int,
    *,
    seed: int,
    max_inputs: int = 2,
    skip_prob: float = 0.3,
    min_bytes: int = 1 << 10,
    max_bytes: int = 1 << 20,
    name: str = "",
) -> CostGraph:
    """A random DAG of ``n_ops`` ops with one output, every op on a path to it.

    Each op reads its predecessor in order and, with probability ``skip_prob``, up to
    ``max_inputs - 1`` earlier ops (skip connections); sizes and times are random.
    """
    rng = random.Random(seed)
    graph = new_graph(name or f"random{n_ops}_s{seed}")
    names: list[str] = []
    for i in range(n_ops):
        inputs: list[str] = []
        if names:
            inputs.append(names[-1])
            if len(names) > 1 and rng.random() < skip_prob:
                extra = rng.sample(names[:-1], k=min(max_inputs - 1, len(names) - 1))
                inputs.extend(x for x in extra if x not in inputs)
        out_bytes = rng.randint(min_bytes // 256, max_bytes // 256) * 256
        saves = (
            rng.choice(["input", "output", "none"]) if inputs else rng.choice(["output", "none"])
        )
        fwd_time = rng.uniform(1e-4, 5e-3)
        names.append(
            _add_op(
                graph,
                i,
                inputs,
                out_bytes=out_bytes,
                saves=saves,
                fwd_time_s=fwd_time,
                fwd_flops=int(fwd_time * 1e9),
            )
        )
    graph.graph["outputs"] = names[-1:]
    return graph
