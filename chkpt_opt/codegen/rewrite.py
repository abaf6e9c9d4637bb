"""Codegen's rewrite pass: outlines each recompute region of a captured fx module into a
body GraphModule called through :class:`~chkpt_opt.codegen.runtime.CheckpointRegion`."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from chkpt_opt.codegen.randomness import draws_random
from chkpt_opt.codegen.recursion_room import recursion_room
from chkpt_opt.codegen.runtime import (
    CheckpointRegion,
    begin_cached_op,
    end_cached_op,
    run_cached_for_compile,
)
from chkpt_opt.codegen.staged import outline_staged_scope
from chkpt_opt.codegen.state import (
    StateInfo,
    guard_stateful,
    roots_written_by,
    snapshot_roots,
    state_info,
)
from chkpt_opt.codegen.unpack import outline_unpack_scope
from chkpt_opt.codegen.wrapped_call import wrapped_call
from chkpt_opt.errors import ScheduleError
from chkpt_opt.fx_attrs import fetch_attr
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.schedule import Schedule, check_schedule, innermost_regions, region_tree

_CALLEE = "_chkpt_cached_callee_"
"""The name prefix of the attributes that hold cached ops' callees in flat bodies."""


def _region_graph(
    region: list[torch.fx.Node], params: list[torch.fx.Node], outputs: list[torch.fx.Node]
) -> torch.fx.Graph:
    """A copy of the region's nodes (inner regions as their calls), taking ``params`` and
    returning ``outputs``: what :func:`_flat_body` reads once the region's nodes have left
    the root's graph."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for arg in params:
        env[arg] = graph.placeholder(f"in_{arg.name}")
    for node in region:
        env[node] = graph.node_copy(node, lambda x: env[x])
    graph.output(tuple(env[o] for o in outputs))
    return graph


def _flat_body(
    gm: torch.fx.GraphModule,
    copied: torch.fx.Graph,
    k: int,
    cached: frozenset[str] = frozenset(),
) -> tuple[torch.fx.GraphModule, tuple[str, ...]]:
    """The region's ops (``copied``, from :func:`_region_graph`) with the ops of the regions
    nested in it inlined, at every depth, for ``torch.compile``.

    Its partitioner recomputes a region from the region's inputs and does not nest, so a
    compiled outermost region traces this flat graph instead of its body: one checkpoint,
    whatever the depth of the schedule (dynamo tracing one checkpoint per level of a deep
    multi-level schedule exceeds Python's recursion limit). No guards: under compile,
    state updates happen once. It takes the body's arguments, then the attributes of the
    nested regions (``flat_attr_targets``), read from the root at call time. The ops a
    region caches run through :func:`~chkpt_opt.codegen.runtime.run_cached_for_compile`,
    which marks their traced nodes for the plan partitioner to save. Only outermost regions
    have one, each op in it once (one per region, a prefix schedule's held every op once
    per region it is in: 470,000 node copies on a 32-layer decoder).
    """
    flat = torch.fx.Graph()
    values = [flat.placeholder(n.name) for n in copied.nodes if n.op == "placeholder"]
    extra: list[str] = []
    extra_nodes: dict[str, torch.fx.Node] = {}
    for region_module in _nested_in(gm, copied):
        for target in region_module.attr_targets:
            if target not in extra_nodes:
                extra.append(target)
                extra_nodes[target] = flat.placeholder(f"in_flat_{len(extra)}")
    callees: dict[str, Any] = {}
    returned = _inline(flat, gm, copied, values, extra_nodes, callees, k, cached)
    flat.output(tuple(returned))
    root: Any = gm
    if callees:  # the callees are attributes of the flat module: a root of named values
        named = {str(n.target) for n in flat.nodes if n.op in ("get_attr", "call_module")}
        root = {t: fetch_attr(gm, t) for t in named - set(callees)} | callees
    return torch.fx.GraphModule(root, flat, class_name=f"FlatRegion{k}"), tuple(extra)


def _nested_in(gm: torch.fx.GraphModule, copied: torch.fx.Graph) -> list[CheckpointRegion]:
    """The regions a region's graph calls, and those they call, depth first in call order."""
    found: list[CheckpointRegion] = []
    for node in copied.nodes:
        if node.op == "call_module":
            wrapper = gm.get_submodule(str(node.target))
            if isinstance(wrapper, CheckpointRegion) and wrapper.source is not None:
                found.append(wrapper)
                found += _nested_in(gm, wrapper.source[0])
    return found


def _inline(
    flat: torch.fx.Graph,
    gm: torch.fx.GraphModule,
    copied: torch.fx.Graph,
    values: list[Any],
    extra_nodes: dict[str, torch.fx.Node],
    callees: dict[str, Any],
    k: int,
    cached: frozenset[str],
) -> list[Any]:
    """Copies region ``k``'s graph into ``flat``, its placeholders standing for ``values``
    and the regions it calls inlined in turn; returns what it returns."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in copied.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, values, strict=True))
    for node in copied.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            return [env[o] for o in node.args[0]]
        wrapper = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if isinstance(wrapper, CheckpointRegion) and wrapper.source is not None:
            graph, inner_k, inner_cached = wrapper.source
            args = [env[a] for a in node.args] + [extra_nodes[t] for t in wrapper.attr_targets]
            env[node] = tuple(
                _inline(flat, gm, graph, args, extra_nodes, callees, inner_k, inner_cached)
            )
        elif (
            node.target is operator.getitem
            and node.args[0] in env
            and isinstance(env[node.args[0]], tuple)
        ):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.name in cached:
            env[node] = _cached_call(flat, node, env, callees, k)
        else:
            env[node] = flat.node_copy(node, lambda x: env[x])
    raise AssertionError("a region's graph ends with its output")


def _cached_call(
    flat: torch.fx.Graph,
    node: torch.fx.Node,
    env: dict[torch.fx.Node, Any],
    callees: dict[str, Any],
    k: int,
) -> torch.fx.Node:
    """Copies ``node`` of region ``k`` into ``flat`` as a call of ``run_cached_for_compile``
    (the callee, which fx code cannot name inline, becomes an attribute of the flat
    module, named after the region: outer regions' flat modules take it over)."""

    def store(target: Any) -> str:
        name = f"{_CALLEE}{k}_{len(callees)}"
        callees[name] = target
        return name

    return wrapped_call(flat, node, env, run_cached_for_compile, store, node.name)


def _outline(
    gm: torch.fx.GraphModule,
    region: list[torch.fx.Node],
    k: int,
    info: StateInfo,
    *,
    for_compile: bool,
    cached: frozenset[str] = frozenset(),
    nested: bool = False,
) -> list[torch.fx.Node]:
    """Outlines ``region`` into submodule ``chkpt_region_{k}``; returns the nodes that
    stand for it in ``gm`` (the call and its items). Ops named in ``cached`` are marked
    for the region's selective-checkpoint policy. A ``nested`` region (called from an
    outer region's body) takes the module state that is written in place as arguments
    (not batch-norm running statistics, which recomputation leaves as they are), not from
    the root module: it then sees what its outer region sees, the outer
    region's snapshot of that state while the outer region is recomputed."""
    inside = set(region)
    ext: list[torch.fx.Node] = []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in ext:
                ext.append(arg)
    # Values aliasing written state bypass checkpoint's saved inputs: their version
    # changes, and the recomputation must see the right value (see snapshot_roots).
    live = [
        a
        for a in ext
        if info.written_root(a) is not None
        and (a.op != "get_attr" or (nested and not for_compile and info.root[a] in info.in_place))
    ]
    attrs = [a for a in ext if a.op == "get_attr" and a not in live]
    acts = [a for a in ext if a.op != "get_attr" and a not in live]
    statics = live + attrs
    snap_roots = set() if for_compile else snapshot_roots(region, info, gm)
    snapshot = tuple(j for j, a in enumerate(statics) if info.written_root(a) in snap_roots)
    written_here = roots_written_by(region, info, gm)
    written = tuple(j for j in snapshot if info.written_root(statics[j]) in written_here)
    snapped = [info.written_root(statics[j]) for j in snapshot]
    if len(set(snapped)) != len(snapped):
        names = sorted({str(r.target) for r in snapped if r is not None and snapped.count(r) > 1})
        raise ScheduleError(
            f"region {k} ({region[0].name!r}..{region[-1].name!r}) reads {names} through two "
            "aliases, and that state is written in place later in the step: the region "
            "cannot be recomputed safely. Keep these ops out of recompute regions."
        )

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for j, arg in enumerate(acts + statics):
        placeholder = sub.placeholder(f"in_{arg.name}")
        placeholder.meta = dict(arg.meta)
        static = arg.op in ("get_attr", "placeholder") or arg in live
        # A snapshot is a private copy on recompute: writes into it need no guard.
        placeholder.meta["chkpt_opt_static"] = static and j - len(acts) not in snapshot
        env[arg] = placeholder
    name = f"chkpt_region_{k}"
    key = f"{name}@{id(gm):x}" if cached else ""
    for node in region:
        if node.name in cached:
            token = sub.call_function(begin_cached_op, (key,))
            env[node] = sub.node_copy(node, lambda x: env[x])
            sub.call_function(end_cached_op, (token,))
        else:
            env[node] = sub.node_copy(node, lambda x: env[x])
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub.output(tuple(env[o] for o in outputs))
    body = torch.fx.GraphModule(gm, sub, class_name=f"Region{k}")
    generators = tuple(
        g
        for node in region
        for g in tree_flatten((node.args, node.kwargs))[0]
        if isinstance(g, torch.Generator)
    )
    # The regions nested in it: its recomputation replays their generators too, before it
    # runs them again.
    inner = tuple(
        m
        for node in region
        if node.op == "call_module"
        for m in [gm.get_submodule(str(node.target))]
        if isinstance(m, CheckpointRegion)
    )
    copied = _region_graph(region, acts + statics, outputs)
    # Nested regions are inlined into their outermost region's flat body, which alone runs
    # under compile; a region is nested where an outer region's outline calls it. Inlining
    # recurses once per level: room on the stack for as many as the region nests.
    flat = None
    if not nested:
        with recursion_room(1 + max((m.nesting_levels for m in inner), default=0)):
            flat = _flat_body(gm, copied, k, cached)
    if not for_compile:
        guard_stateful(body, gm)

    wrapper = CheckpointRegion(
        body,
        gm,
        tuple(str(a.target) for a in attrs),
        tuple(n.name for n in region),
        n_acts=len(acts),
        snapshot=snapshot,
        written=written,
        generators=generators,
        inner=inner,
        flat=flat,
        source=(copied, k, cached) if nested else None,  # what its outer region inlines
        for_compile=for_compile,
        cache_key=key,
        replays_rng=draws_random(region, gm),
    )
    gm.add_submodule(name, wrapper)
    with gm.graph.inserting_before(region[0]):
        call = gm.graph.call_module(name, tuple(acts + live))
        items = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    # An outer region that calls this one sees it at its first op's place, writing what
    # its ops write.
    for node in (call, *items):
        info.position[node] = info.position[region[0]]
    # An outer region snapshots the state that its inner regions write in place, and
    # its recomputation replays those writes into private copies (see StateGuard).
    written_in_place = roots_written_by(region, info, gm, stats=False)
    if written_in_place:
        info.hop_writes[call] = written_in_place
    for out, item in zip(outputs, items):
        item.meta = dict(out.meta)
        if out in info.root:  # later regions see the item as the value it stands for
            info.root[item] = info.root[out]
        out.replace_all_uses_with(item)
    for node in reversed(region):
        gm.graph.erase_node(node)
    return [call, *items]


def rewrite_module(
    module: torch.fx.GraphModule, graph: CostGraph, schedule: Schedule, *, for_compile: bool = False
) -> torch.fx.GraphModule:
    """Rewrites ``module`` (a fresh capture, modified in place) to run ``schedule``.

    Args:
        module: a GraphModule whose call nodes are the nodes of ``graph``.
        graph: the cost graph of that module.
        schedule: a valid schedule of ``graph``; its unpacked ops run under saved-tensor
            hooks (:mod:`~chkpt_opt.codegen.unpack`), not on the compile path; a staged
            schedule runs under its executor (:mod:`~chkpt_opt.codegen.staged`), eagerly.
        for_compile: emit regions for ``torch.compile`` (plain non-reentrant checkpoint,
            which dynamo turns into regions its partitioner recomputes; no eager guards).

    Returns:
        ``module``, rewritten and recompiled.
    """
    check_schedule(graph, schedule)
    if schedule.staged:
        if for_compile:
            raise ScheduleError(
                "this schedule is staged: its recomputations run in hooks on backward nodes, "
                "which the torch.compile path does not run. Apply it eagerly (plan.apply())."
            )
        outline_staged_scope(module, graph, schedule)
        module.graph.lint()
        module.recompile()
        return module
    if for_compile and schedule.nested:
        raise ScheduleError(
            "this schedule nests regions; the torch.compile path runs one level of regions "
            "(its partitioner does not nest recomputations). Apply it eagerly "
            "(plan.apply()), or compile the plan's counterpart without nesting "
            "(plan.compile() and plan.apply(for_compile=True) solve it at the same budget)."
        )
    if for_compile and schedule.unpacked:
        raise ScheduleError(
            f"this schedule unpacks ops ({sorted(schedule.unpacked)[:3]}): their outputs are "
            "rebuilt by saved-tensor hooks, which the torch.compile path does not run. Apply "
            "it eagerly (plan.apply()), or compile the plan's counterpart without them "
            "(plan.compile() and plan.apply(for_compile=True) solve it at the same budget)."
        )
    by_name = {n.name: n for n in module.graph.nodes}
    missing = [n for r in schedule.regions for n in r if n not in by_name]
    if missing:
        raise ScheduleError(
            f"the schedule names ops {missing[:3]} that the module does not have; it was "
            "made for another model or another trace of it."
        )
    info = state_info(module)
    order = ordered_nodes(graph)
    tree = region_tree(graph, schedule)
    inner = innermost_regions(tree, len(order))
    # Inner regions first: an outer region's body then calls the inner regions' modules.
    stands_for: dict[str, list[torch.fx.Node]] = {}  # first op of an outlined region -> nodes
    covered: set[str] = set()
    for k in sorted(range(len(tree)), key=lambda k: (-tree[k].depth, k)):
        span = tree[k]
        nodes: list[torch.fx.Node] = []
        for i in range(span.start, span.stop):
            name = order[i]
            if name in stands_for:
                nodes += stands_for.pop(name)
            elif name not in covered:
                nodes.append(by_name[name])
        cached = (
            frozenset(order[i] for i in range(span.start, span.stop) if inner[i] == k)
            & schedule.saved
        )
        stands_for[order[span.start]] = _outline(
            module, nodes, k, info, for_compile=for_compile, cached=cached, nested=span.depth > 0
        )
        covered.update(order[span.start : span.stop])
    if schedule.unpacked:
        outline_unpack_scope(module, schedule.unpacked)
    module.graph.lint()
    module.recompile()
    return module
