"""The chain that :mod:`chkpt_opt.solvers.dp_nested` plans nested schedules on: per-op facts
read off the graph, the schedule-independent bytes of every step of the op sequence, and
the conversion between plans (region trees) and :class:`~chkpt_opt.schedule.Schedule`.

A *simple chain* is a graph whose op ``i > 0`` reads exactly the output of op ``i - 1`` (once)
and nothing else, whose ops each own exactly one storage (their output: no views, aliases,
in-place writes or extra buffers), save at most their input and their own output, all run a
backward that produces input gradients (no gradient aliasing), and whose one step output is
the last op. Synthetic chains and the deep linear+ReLU chain of the zoo are simple chains.
On such a chain, the op sequence of :func:`chkpt_opt.op_sequence.lower` has, at every step,
schedule-independent bytes (this module) plus the activations the schedule holds (the DP):

* forward step of op ``i``: its forward workspace;
* ``bwd_start``: the step output and its gradient (``CB``), alive to the end of the step;
* backward step of op ``j``: ``CB``, the parameter gradients of ops ``>= j``, the gradients
  of op ``j``'s output (unless it is the step output) and input, its backward workspace;
* recompute step of op ``i`` in a replay triggered before the backward of op ``L``: ``CB``,
  the parameter gradients of ops ``> L``, the gradient of op ``L``'s output, op ``i``'s
  forward workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, edge_uses, ordered_nodes
from chkpt_opt.schedule import Schedule, cut_positions, region_tree

Plan = tuple[tuple[int, int, tuple], ...]
"""A region tree: ``(start, stop, children)`` for each region at one level, by position."""


@dataclass(frozen=True)
class NestedChain:
    """Per-op facts of a simple chain (module docstring); ``a[i]`` is op ``i``'s output bytes.

    Attributes:
        n: number of ops.
        a, t: output bytes and forward time of every op.
        w: forward workspace bytes.
        packer: whether the op saves anything for its backward (``n_saved > 0``).
        sin, sout: whether it saves its input (op ``i - 1``'s output) / its own output.
        ok: ``ok[p]``: a region may begin or end at position ``p``.
        fp: ``fp[p]``: the first packer at or after ``p`` (``n`` if none).
        lp: ``lp[q]``: the last packer before ``q`` (``-1`` if none).
        bwd_base: schedule-independent bytes of the backward step of every op.
        rec_base: the same of a recompute step triggered before op ``L``'s backward,
            without the recomputed op's workspace.
        cb: the step output and its gradient (alive from ``bwd_start`` to the end).
        t_prefix: ``t_prefix[i]``: forward time of ops ``0..i-1``.
    """

    n: int
    a: tuple[int, ...]
    t: tuple[float, ...]
    w: tuple[int, ...]
    packer: tuple[bool, ...]
    sin: tuple[bool, ...]
    sout: tuple[bool, ...]
    ok: tuple[bool, ...]
    fp: tuple[int, ...]
    lp: tuple[int, ...]
    bwd_base: tuple[int, ...]
    rec_base: tuple[int, ...]
    cb: int
    t_prefix: tuple[float, ...]

    def inp(self, p: int) -> int:
        """Bytes of op ``p``'s input (0 for the first op: the graph input is resident)."""
        return self.a[p - 1] if p > 0 else 0

    def run_time_s(self, p: int, q: int) -> float:
        """Forward time of ops ``p..q-1``."""
        return self.t_prefix[q] - self.t_prefix[p]


def simple_chain(graph: CostGraph) -> NestedChain:
    """The facts of ``graph`` as a simple chain.

    Raises:
        SolverError: naming the op that makes ``graph`` no simple chain.
    """
    nodes = graph.nodes
    order = ordered_nodes(graph)
    n = len(order)
    name = graph.graph.get("name", "")
    if n == 0:
        raise SolverError(f"graph {name!r} has no ops; dp_nested needs a chain of ops.")

    def refuse(v: str, why: str) -> SolverError:
        return SolverError(
            f"graph {name!r} is not a simple chain at op {v!r}: {why}. dp_nested plans only "
            "simple chains (each op reads the previous one's output and owns one output); "
            "use solver 'nested' or 'auto' with general=True."
        )

    if list(graph.graph["outputs"]) != [order[-1]]:
        raise refuse(order[-1], "the step outputs are not exactly the last op")
    a: list[int] = []
    sin: list[bool] = []
    sout: list[bool] = []
    for i, v in enumerate(order):
        attrs = nodes[v]
        outs = dict(attrs["outputs"])
        if len(outs) != 1 or attrs["aliases"] or attrs["is_inplace"]:
            raise refuse(v, "it does not own exactly one output storage")
        ((sid, nbytes),) = outs.items()
        preds = list(graph.predecessors(v))
        if preds != ([order[i - 1]] if i else []):
            raise refuse(v, "it does not read exactly the previous op")
        if i and edge_uses(graph, order[i - 1], v) != 1:
            raise refuse(v, "it reads its input more than once")
        if not (attrs["requires_grad"] and attrs["has_backward"]) or attrs["bwd_grad_alias"]:
            raise refuse(v, "its backward is skipped or passes its gradient on as a view")
        saved = set(attrs["saved"])
        prev_sid = next(iter(nodes[order[i - 1]]["outputs"]), None) if i else None
        if saved - {sid, prev_sid}:
            raise refuse(v, "it saves a tensor other than its input and its output")
        if attrs["n_saved"] == 0 and saved:
            raise refuse(v, "it keeps tensors with n_saved == 0")
        a.append(int(nbytes))
        sin.append(prev_sid in saved)
        sout.append(sid in saved)
    grad = [int(nodes[v]["grad_bytes"]) for v in order]
    pg = [int(nodes[v]["param_grad_bytes"]) for v in order]
    bw = [int(nodes[v]["bwd_workspace_bytes"]) for v in order]
    packer = tuple(nodes[v]["n_saved"] > 0 for v in order)
    cb = a[-1] + grad[-1]
    after = [0] * (n + 1)  # after[j]: parameter gradients of ops >= j
    for j in range(n - 1, -1, -1):
        after[j] = after[j + 1] + pg[j]
    bwd_base = tuple(
        cb + after[j] + (grad[j] if j < n - 1 else 0) + (grad[j - 1] if j > 0 else 0) + bw[j]
        for j in range(n)
    )
    rec_base = tuple(cb + after[j + 1] + (grad[j] if j < n - 1 else 0) for j in range(n))
    fp = [n] * (n + 1)
    for p in range(n - 1, -1, -1):
        fp[p] = p if packer[p] else fp[p + 1]
    lp = [-1] * (n + 1)
    for q in range(1, n + 1):
        lp[q] = q - 1 if packer[q - 1] else lp[q - 1]
    times = tuple(float(nodes[v]["fwd_time_s"]) for v in order)
    prefix = [0.0]
    for x in times:
        prefix.append(prefix[-1] + x)
    return NestedChain(
        n=n,
        a=tuple(a),
        t=times,
        w=tuple(int(nodes[v]["fwd_workspace_bytes"]) for v in order),
        packer=packer,
        sin=tuple(sin),
        sout=tuple(sout),
        ok=tuple(cut_positions(graph)),
        fp=tuple(fp),
        lp=tuple(lp),
        bwd_base=bwd_base,
        rec_base=rec_base,
        cb=cb,
        t_prefix=tuple(prefix),
    )


def plan_schedule(graph: CostGraph, plan: Plan) -> Schedule:
    """The schedule of a region tree."""
    order = ordered_nodes(graph)
    nested: list[tuple[int, int]] = []

    def walk(children: Plan) -> None:
        for start, stop, inner in children:
            nested.append((start, stop))
            walk(inner)

    for _, _, inner in plan:
        walk(inner)
    return Schedule(
        regions=tuple(tuple(order[s:e]) for s, e, _ in plan),
        nested=tuple(
            tuple(order[s:e]) for s, e in sorted(set(nested), key=lambda x: (x[0], -x[1]))
        ),
    )


def schedule_plan(graph: CostGraph, schedule: Schedule) -> Plan:
    """The region tree of a schedule (cached ops are not part of a plan).

    Raises:
        SolverError: if the schedule caches ops.
    """
    if schedule.saved:
        raise SolverError("a dp_nested plan caches nothing; the schedule caches ops.")
    tree = region_tree(graph, schedule)

    def build(k: int) -> tuple[int, int, tuple]:
        span = tree[k]
        return (span.start, span.stop, tuple(build(c) for c in span.children))

    return tuple(build(k) for k, span in enumerate(tree) if span.parent < 0)
