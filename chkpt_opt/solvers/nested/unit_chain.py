"""The chain that :mod:`chkpt_opt.solvers.nested.dp_nested` plans nested schedules on: per-op facts
read off the graph, the schedule-independent bytes of every step of the op sequence, and
the conversion between plans (region trees) and :class:`~chkpt_opt.memory_model.schedule.Schedule`.

A *simple chain* is a chain of *units*, each an op that owns one output storage, followed
by the view ops that alias that output (``flatten`` before a classifier head). The first op
of unit ``i > 0`` reads exactly the last op of unit ``i - 1`` (once) and nothing else; the
owning op saves at most its input, its own output and buffers of its own that no other op
reads (max-pooling's indices, a loss's statistics); the views save nothing, pass their
gradient on as a view and have no workspace; every op runs a backward that produces input
gradients, and the one step output is the last op (which owns it). Regions begin and end
at unit boundaries. Synthetic chains, the deep linear+ReLU chain and the VGG-like conv nets
of the zoo are simple chains. On such a chain, the op sequence of
:func:`chkpt_opt.memory_model.op_sequence.lower` has, at every step, schedule-independent bytes
(this module) plus the activations the schedule holds (the DP):

* forward step of unit ``i``: its forward workspace and the buffers it allocates (``w``);
* ``bwd_start``: the step output and its gradient (``CB``), alive to the end of the step;
* backward step of unit ``j``: ``CB``, the parameter gradients of units ``>= j``, the
  gradients of unit ``j``'s output (unless it is the step output) and input, its backward
  workspace, its own saved buffers;
* recompute step of unit ``i`` in a replay triggered before the backward of unit ``L``:
  ``CB``, the parameter gradients of units ``> L``, the gradient of unit ``L``'s output,
  unit ``i``'s forward workspace and buffers.

A unit's views allocate nothing and their steps come right after its owner's forward step
and right before its owner's backward step, with no fewer bytes alive at those, so they
never raise the peak: the unit is counted as one op. A replay whose last op saving anything
is a unit's owner stops there, before the views (``t_own``).
"""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, edge_uses, ordered_nodes, storage_owners
from chkpt_opt.memory_model.schedule import Schedule, cut_positions, region_tree
from chkpt_opt.solvers.base import INF_BYTES

Plan = tuple[tuple, ...]
"""A region tree: ``(start, stop, children)`` for each region at one level, by position,
and ``(unit, k)`` for each plain unit there that runs its option ``k``
(:attr:`NestedChain.options`)."""


@dataclass(frozen=True)
class UnitOption:
    """A keep-set schedule inside one unit that runs in no region over units (see
    :mod:`~chkpt_opt.solvers.nested.unit_options`), with its bytes in the roles of the unit's
    own facts in :class:`NestedChain`.

    Attributes:
        spans: ``[start, stop)`` op positions (in the graph's execution order) of its
            regions.
        cost_s: their recompute time, with the chain's ``region_s`` for each of them.
        w: bytes its forward step peaks at beyond its output (its input counted apart).
        w_run: the same when it runs inside a checkpoint (its regions nested there).
        e: bytes it keeps from its forward to its backward besides its input and output.
        sin, sout: whether it holds its input / its output until its backward.
        bwd: bytes its backward (with its replays) peaks at, its input not counted, its
            output counted where ``sout`` says (as ``NestedChain.bwd_base``).
        slack_bytes: how many bytes the DP may count above the simulator at its steps
            (0: exact).
    """

    spans: tuple[tuple[int, int], ...]
    cost_s: float
    w: int
    w_run: int
    e: int
    sin: bool
    sout: bool
    bwd: int
    slack_bytes: int = 0


@dataclass(frozen=True)
class NestedChain:
    """Per-unit facts of a simple chain (module docstring); ``a[i]`` is unit ``i``'s output
    bytes. Positions (``ok``, ``fp``, ``lp``, plans) count units.

    Attributes:
        n: number of units.
        a, t: output bytes and forward time of every unit (its owner and views).
        t_own: forward time of its owner alone (a replay stopping at the unit runs it).
        w: bytes a forward step of the unit allocates beyond its output: the owner's
            forward workspace and its own saved buffers.
        e: the owner's own saved buffers, kept from its forward (or replay) to its
            backward.
        packer: whether the owner saves anything for its backward (``n_saved > 0``).
        sin, sout: whether it saves its input (unit ``i - 1``'s output) / its own output.
        sown: whether it saves a storage of its own (output or buffer): a replay that
            stops at it runs it.
        ok: ``ok[p]``: a region may begin or end at position ``p``.
        fp: ``fp[p]``: the first packer at or after ``p`` (``n`` if none).
        lp: ``lp[q]``: the last packer before ``q`` (``-1`` if none).
        bwd_base: schedule-independent bytes of the backward step of every unit.
        rec_base: the same of a recompute step triggered before unit ``L``'s backward,
            without the recomputed unit's ``w``.
        cb: the step output and its gradient (alive from ``bwd_start`` to the end).
        t_prefix: ``t_prefix[i]``: forward time of units ``0..i-1``.
        starts: ``starts[i]``: the position of unit ``i``'s owner in the graph's execution
            order (``starts[n]``: the number of ops).
        w_run: like ``w`` for the unit running inside a checkpoint (saving nothing).
        w_stop: like ``w`` for a replay that stops at the unit's last packer.
        bwd_post: like ``bwd_base`` for the backward steps from the unit's last packer on
            (those after the replay when the unit holds a region's last packer).
        bwd_pre: the bytes of the backward steps before it, which then run before the
            replay with nothing of the region alive (``-INF_BYTES``: none).
        exact: whether the DP counts every plan's steps exactly as the simulator does
            (always for a simple chain; see :mod:`~chkpt_opt.solvers.nested.separator_chain`);
            otherwise it counts no step below the simulator, and at most
            ``slack_bytes`` above it.
        units: what a unit is, for messages and stats.
        options: per unit, the keep-set schedules inside it that a frame may run it
            with instead of plain (empty: none; :mod:`~chkpt_opt.solvers.nested.unit_options`).
        region_s: seconds every region costs beyond recomputing its ops, at any level
            (the graph's ``region_overhead_s``, charged once per region as
            :func:`~chkpt_opt.memory_model.simulate.simulate` charges it).
        pinned: storages left out of the units' bytes and counted alive at every step
            instead (:func:`~chkpt_opt.solvers.nested.separator_chain.broadcast_storages`).
        pinned_bytes: their bytes, which every count of the DP includes
            (:func:`~chkpt_opt.solvers.nested.top_frame.top_plan` adds them).
    """

    n: int
    a: tuple[int, ...]
    t: tuple[float, ...]
    t_own: tuple[float, ...]
    w: tuple[int, ...]
    e: tuple[int, ...]
    packer: tuple[bool, ...]
    sin: tuple[bool, ...]
    sout: tuple[bool, ...]
    sown: tuple[bool, ...]
    ok: tuple[bool, ...]
    fp: tuple[int, ...]
    lp: tuple[int, ...]
    bwd_base: tuple[int, ...]
    rec_base: tuple[int, ...]
    cb: int
    t_prefix: tuple[float, ...]
    starts: tuple[int, ...]
    w_run: tuple[int, ...]
    w_stop: tuple[int, ...]
    bwd_post: tuple[int, ...]
    bwd_pre: tuple[int, ...]
    exact: bool = True
    slack_bytes: int = 0
    units: str = "ops with the views of their outputs"
    options: tuple[tuple[UnitOption, ...], ...] = ()
    region_s: float = 0.0
    pinned: frozenset[str] = frozenset()
    pinned_bytes: int = 0

    def options_of(self, p: int) -> tuple[UnitOption, ...]:
        """The options of unit ``p`` (none where the chain has none)."""
        return self.options[p] if self.options else ()

    def inp(self, p: int) -> int:
        """Bytes of unit ``p``'s input (0 for the first: the graph input is resident)."""
        return self.a[p - 1] if p > 0 else 0

    def run_time_s(self, p: int, q: int) -> float:
        """Forward time of units ``p..q-1``."""
        return self.t_prefix[q] - self.t_prefix[p]

    def replay_time_s(self, p: int, last: int) -> float:
        """Forward time of a replay from unit ``p`` that stops at its last packer ``last``
        (module docstring: it runs that unit's owner only if it saves a storage of its own)."""
        return self.run_time_s(p, last) + (self.t_own[last] if self.sown[last] else 0.0)


def _folds_as_view(graph: CostGraph, order: list[str], i: int, unit_sid: str | None) -> bool:
    """Whether op ``i`` is a view of the output ``unit_sid`` of the unit before it that the
    chain counts inside that unit (module docstring)."""
    attrs = graph.nodes[order[i]]
    return (
        i > 0
        and unit_sid is not None
        and not attrs["outputs"]
        and list(attrs["aliases"]) == [unit_sid]
        and not attrs["is_inplace"]
        and list(graph.predecessors(order[i])) == [order[i - 1]]
        and edge_uses(graph, order[i - 1], order[i]) == 1
        and attrs["n_saved"] == 0
        and not attrs["saved"]
        and attrs["requires_grad"]
        and attrs["has_backward"]
        and attrs["bwd_grad_alias"]
        and attrs["fwd_workspace_bytes"] == 0
        and attrs["bwd_workspace_bytes"] == 0
        and attrs["param_grad_bytes"] == 0
        and attrs["grad_bytes"] == graph.nodes[order[i - 1]]["grad_bytes"]
    )


def simple_chain(graph: CostGraph) -> NestedChain:
    """The facts of ``graph`` as a simple chain.

    Raises:
        SolverError: naming the op that makes ``graph`` no simple chain.
    """
    nodes = graph.nodes
    order = ordered_nodes(graph)
    name = graph.graph.get("name", "")
    if not order:
        raise SolverError(f"graph {name!r} has no ops; dp_nested needs a chain of ops.")

    def refuse(v: str, why: str) -> SolverError:
        return SolverError(
            f"graph {name!r} is not a simple chain at op {v!r}: {why}. dp_nested plans only "
            "simple chains (each op reads the previous one's output and owns one output, "
            "views of it aside); use solver 'nested' or 'auto' with general=True."
        )

    if list(graph.graph["outputs"]) != [order[-1]]:
        raise refuse(order[-1], "the step outputs are not exactly the last op")
    owners = storage_owners(graph)
    units: list[list[int]] = []  # op positions of each unit: its owner, then its views
    unit_sids: list[str] = []
    a: list[int] = []
    e: list[int] = []
    sin: list[bool] = []
    sout: list[bool] = []
    for i, v in enumerate(order):
        if units and _folds_as_view(graph, order, i, unit_sids[-1]):
            units[-1].append(i)
            continue
        attrs = nodes[v]
        outs = dict(attrs["outputs"])
        if attrs["is_inplace"]:
            raise refuse(v, "it writes a tensor in place")
        if len(outs) != 1 or attrs["aliases"]:
            raise refuse(v, "it does not own exactly one output storage")
        ((sid, nbytes),) = outs.items()
        preds = list(graph.predecessors(v))
        before = order[units[-1][-1]] if units else None
        if preds != ([before] if before else []):
            raise refuse(v, "it does not read exactly the previous op")
        if before and edge_uses(graph, before, v) != 1:
            raise refuse(v, "it reads its input more than once")
        if not (attrs["requires_grad"] and attrs["has_backward"]) or attrs["bwd_grad_alias"]:
            raise refuse(v, "its backward is skipped or passes its gradient on as a view")
        saved = set(attrs["saved"])
        prev_sid = unit_sids[-1] if units else None
        buffers = {s for s in saved - {sid, prev_sid} if owners.get(s) == v}
        if saved - {sid, prev_sid} - buffers:
            raise refuse(v, "it saves a tensor other than its input, its output and buffers")
        if attrs["n_saved"] == 0 and saved:
            raise refuse(v, "it keeps tensors with n_saved == 0")
        units.append([i])
        unit_sids.append(sid)
        a.append(int(nbytes))
        e.append(sum(int(attrs["saved"][s]) for s in buffers))
        sin.append(prev_sid in saved)
        sout.append(sid in saved)
    if len(units[-1]) > 1:
        raise refuse(order[-1], "the step output is a view")
    owner = [order[u[0]] for u in units]
    last_op = [order[u[-1]] for u in units]
    n = len(units)
    grad = [int(nodes[v]["grad_bytes"]) for v in last_op]
    pg = [int(nodes[v]["param_grad_bytes"]) for v in owner]
    bw = [int(nodes[v]["bwd_workspace_bytes"]) for v in owner]
    packer = tuple(nodes[v]["n_saved"] > 0 for v in owner)
    cb = a[-1] + grad[-1]
    after = [0] * (n + 1)  # after[j]: parameter gradients of units >= j
    for j in range(n - 1, -1, -1):
        after[j] = after[j + 1] + pg[j]
    bwd_base = tuple(
        cb + after[j] + (grad[j] if j < n - 1 else 0) + (grad[j - 1] if j > 0 else 0) + bw[j] + e[j]
        for j in range(n)
    )
    rec_base = tuple(cb + after[j + 1] + (grad[j] if j < n - 1 else 0) for j in range(n))
    times = tuple(sum(float(nodes[order[k]]["fwd_time_s"]) for k in u) for u in units)
    fp, lp, prefix = positions(packer, times)
    op_ok = cut_positions(graph)
    starts = (*(u[0] for u in units), len(order))
    w = tuple(int(nodes[v]["fwd_workspace_bytes"]) + e[k] for k, v in enumerate(owner))
    return NestedChain(
        n=n,
        a=tuple(a),
        t=times,
        t_own=tuple(float(nodes[v]["fwd_time_s"]) for v in owner),
        w=w,
        e=tuple(e),
        packer=packer,
        sin=tuple(sin),
        sout=tuple(sout),
        sown=tuple(o or b > 0 for o, b in zip(sout, e)),
        ok=tuple(op_ok[s] for s in starts),
        fp=fp,
        lp=lp,
        bwd_base=bwd_base,
        rec_base=rec_base,
        cb=cb,
        t_prefix=prefix,
        starts=starts,
        w_run=w,
        w_stop=w,
        bwd_post=bwd_base,
        bwd_pre=(-INF_BYTES,) * n,
    )


def positions(
    packer: tuple[bool, ...], times: tuple[float, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """A chain's ``fp``, ``lp`` and ``t_prefix`` (see :class:`NestedChain`) from whether
    each unit is a packer and its forward time."""
    n = len(packer)
    fp = [n] * (n + 1)
    for p in range(n - 1, -1, -1):
        fp[p] = p if packer[p] else fp[p + 1]
    lp = [-1] * (n + 1)
    for q in range(1, n + 1):
        lp[q] = q - 1 if packer[q - 1] else lp[q - 1]
    prefix = [0.0]
    for x in times:
        prefix.append(prefix[-1] + x)
    return tuple(fp), tuple(lp), tuple(prefix)


def plan_schedule(graph: CostGraph, chain: NestedChain, plan: Plan) -> Schedule:
    """The schedule of a region tree (positions count ``chain``'s units), with the regions
    of the unit options it runs."""
    order = ordered_nodes(graph)
    at = chain.starts
    nested: list[tuple[int, int]] = []

    def walk(children: Plan) -> None:
        for piece in children:
            if len(piece) == 2:
                nested.extend(chain.options[piece[0]][piece[1]].spans)
                continue
            start, stop, inner = piece
            nested.append((at[start], at[stop]))
            walk(inner)

    outer: list[tuple[int, int]] = []
    for piece in plan:
        if len(piece) == 2:
            outer.extend(chain.options[piece[0]][piece[1]].spans)
        else:
            outer.append((at[piece[0]], at[piece[1]]))
            walk(piece[2])
    return Schedule(
        regions=tuple(tuple(order[s:e]) for s, e in sorted(outer)),
        nested=tuple(
            tuple(order[s:e]) for s, e in sorted(set(nested), key=lambda x: (x[0], -x[1]))
        ),
    )


def schedule_plan(graph: CostGraph, chain: NestedChain, schedule: Schedule) -> Plan:
    """The region tree of a schedule, in ``chain``'s units (cached ops are not part of a
    plan).

    Raises:
        SolverError: if the schedule caches ops, or a region begins or ends inside a unit
            (between an op and a view of its output).
    """
    if schedule.saved:
        raise SolverError("a dp_nested plan caches nothing; the schedule caches ops.")
    tree = region_tree(graph, schedule)
    unit_at = {s: k for k, s in enumerate(chain.starts)}

    def unit(position: int) -> int:
        if position not in unit_at:
            raise SolverError(
                f"a region boundary at op position {position} lies inside a unit of the "
                f"chain ({chain.units}): outside dp_nested's space."
            )
        return unit_at[position]

    def build(k: int) -> tuple[int, int, tuple]:
        span = tree[k]
        return (unit(span.start), unit(span.stop), tuple(build(c) for c in span.children))

    return tuple(build(k) for k, span in enumerate(tree) if span.parent < 0)


def lowest_peak_floor_bytes(chain: NestedChain) -> int:
    """Bytes below every plan's peak (a floor under the lowest peak): the largest of the
    steps' schedule-independent bytes (a unit's backward, whole or split at a replay; its
    forward or run with its input and output; ``bwd_start``'s)."""
    c = chain
    forward = max(
        min([c.w[i], c.w_run[i], *(o.w for o in c.options_of(i))]) + c.a[i] + c.inp(i)
        for i in range(c.n)
    )
    backward = max(
        min([max(c.bwd_post[i], c.bwd_pre[i]), *(o.bwd for o in c.options_of(i))])
        for i in range(c.n)
    )
    return max(backward, forward, c.cb) + c.pinned_bytes
