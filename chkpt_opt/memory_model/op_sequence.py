"""The op sequence a training step really executes under a schedule (``lower``).

The sequence is what the simulator reads: forward ops in order, then the backward pass in
reverse order, with each recompute region replayed just before the first backward op that
unpacks one of its saved tensors. Every step lists the storages it allocates, the storages
freed once it is done, and its transient bytes.

The rules follow what PyTorch does (they are checked against measured runs in the tests):

* a forward output lives until its last forward reader has run, and longer if it is kept;
* an op outside every region keeps its saved storages until its backward has run (until the
  end of the step if autograd never runs that backward);
* inside a region nothing is kept in the forward pass; the region's inputs are kept until
  the last backward op of the region that unpacks a saved tensor has run;
* non-reentrant checkpoint recomputes the region from its first op up to its last op that
  saves anything, and stops there as soon as that op has packed its last saved tensor.
  Autograd packs an op's inputs before the op runs and its outputs after, so that last op
  runs only if it saves one of its own storages. The recomputed saved storages are kept
  until the backward op that unpacks them has run;
* values that the recomputation computes and that an op after its stop (or outside the
  region) reads are held by the region's code until the recomputation ends;
* the gradient of an op's output is created by the backward of its last reader (or at the
  start of the backward pass for a step output the step differentiates: the loss alone
  where the graph's ``grad_outputs`` says so) and is freed once the op's own backward
  has run; views pass gradients on without copying; a parameter gradient lives to the end
  of the step;
* when another reader's backward produces a gradient for a tensor that already has one,
  autograd adds the two once that backward has released its inputs; the sum is modelled
  out of place (old, new and sum alive together), which is what the engine does when
  neither buffer can be reused and an upper bound otherwise. An op that reads a tensor
  several times (``x * x``) returns one gradient per read; fresh ones are summed in place.

Nested regions and cached ops (see :mod:`chkpt_opt.memory_model.schedule`) follow the rules of
nested non-reentrant checkpoint and selective-checkpoint policies:

* a saved tensor belongs to the innermost region around the op that saves it; an inner
  region's inputs are saved tensors of its parent (the parent's frame holds them, so in
  the forward pass they are kept only if the outermost region keeps them as its inputs);
* the code that calls a nested region holds its inputs until the region returns: in the
  forward pass, and in every replay that runs it, an inner region's inputs live at least
  until its last op has run (or until the replay ends, where it stops inside the region);
* a region is recomputed just before the first backward op that unpacks one of its own
  saved tensors, or just before an inner region's recomputation needs its inputs (outer
  regions first). The recomputation runs the region's ops from its first one up to its
  last own saved tensor (an op, or an inner region's inputs, packed when that region
  starts); inner regions met on the way run again as checkpoints, keeping nothing;
* a cached op that runs in the recomputation of an outer region is cached by its own
  region's checkpoint there, until that recomputation ends;
* a cached op's outputs live from the forward pass to the recomputation of its region,
  which takes them instead of running the op (or to its end if it stops before the op;
  to the region's last backward op if the region is never recomputed).

Unpacked ops (recompute on unpack, :mod:`chkpt_opt.memory_model.unpack`):

* where an op outside every region saves an output storage of an unpacked op (the
  unpacked op's own save included, a view of it alike), it keeps the unpacked op's input
  storages instead (the recipe's references), until its backward has run (and the
  forward's registry of recipes holds them to the end of the forward pass); saves inside
  regions are the checkpoint's and keep what they keep above, and a region keeps its
  inputs as above;
* just before the first backward step that unpacks one of those storages (after the
  region recomputations that step triggers), a ``"recompute"`` step (region -1) runs the
  unpacked op: its own storages are allocated (instances ``u:<storage>``), those that no
  saver saves are freed at once, the others once the last backward step that unpacks
  them has run;
* an unpacked op's input that an earlier unpacked op rebuilds is held by its recipe as a
  handle on that op's recipe (so its savers keep that op's inputs instead); its rebuild
  runs that op's rebuild first, unless it is held, and holds that output until then.
"""

from __future__ import annotations

import bisect

from chkpt_opt.graphs.costgraph import (
    CostGraph,
    attributes_by_node,
    ordered_nodes,
    owned_storages,
    storage_owners,
    storage_refs,
)
from chkpt_opt.memory_model.region_replay import region_replays
from chkpt_opt.memory_model.schedule import Schedule, innermost_regions, region_tree
from chkpt_opt.memory_model.sequence.gradients import gradient_instances, gradient_sums
from chkpt_opt.memory_model.sequence.steps import Step, steps_of
from chkpt_opt.memory_model.staged.sequence import lower_staged
from chkpt_opt.memory_model.unpack import UnpackPlan, unpack_plans

__all__ = ["Step", "lower"]


def lower(graph: CostGraph, schedule: Schedule) -> list[Step]:
    """Returns the op sequence of one training step under ``schedule``.

    The schedule is assumed valid (see :func:`chkpt_opt.memory_model.schedule.check_schedule`). A
    staged schedule lowers by its own rule (:mod:`chkpt_opt.memory_model.staged.sequence`).
    """
    if schedule.staged:
        return lower_staged(graph, schedule)
    nodes = attributes_by_node(graph)
    order = ordered_nodes(graph)
    index = {n: i for i, n in enumerate(order)}
    owner = storage_owners(graph)
    refs = {n: storage_refs(graph, n) for n in order}
    preds = {n: sorted(graph.predecessors(n), key=lambda u: nodes[u]["index"]) for n in order}
    tree = region_tree(graph, schedule)
    inner = innermost_regions(tree, len(order))
    replays = region_replays(graph, order, tree, inner, schedule.saved, owner)
    by_trigger: dict[str, list[int]] = {}
    for k in sorted(range(len(tree)), key=lambda k: tree[k].depth):  # outer regions first
        if replays[k].trigger:
            by_trigger.setdefault(replays[k].trigger, []).append(k)
    plans = unpack_plans(graph, order, inner, schedule.unpacked, owner)
    rebuilt_by = {sid: plan for plan in plans for sid in plan.savers}
    unpack_at: dict[str, list[UnpackPlan]] = {}
    for plan in plans:
        if plan.trigger:
            unpack_at.setdefault(plan.trigger, []).append(plan)
    unpack_pos: dict[str, int] = {}  # unpacked op -> position of its rebuild
    by_node = {plan.node: plan for plan in plans}

    def rebuild(plan: UnpackPlan) -> None:
        """Its rebuild, after those of the recipes it holds handles on (once each)."""
        if plan.node not in unpack_pos:
            for _, v in plan.needs:
                rebuild(by_node[v])
            unpack_pos[plan.node] = len(kinds)
            kinds.append(("recompute", plan.node, -1))

    # Positions of every step.
    kinds: list[tuple[str, str, int]] = [("fwd", n, -1) for n in order]
    fwd_pos = {n: i for i, n in enumerate(order)}
    kinds.append(("bwd_start", "", -1))
    rec_pos: dict[tuple[int, int], int] = {}  # (region, op index) -> position
    replay_start: dict[int, int] = {}  # region -> first position of its recomputation
    replay_end: dict[int, int] = {}  # region -> last position of its recomputation
    bwd_pos: dict[str, int] = {}
    acc_pos: dict[str, int] = {}
    accumulates = gradient_sums(graph, order, nodes, preds)
    for n in reversed(order):
        if not nodes[n]["has_backward"]:
            continue
        for k in by_trigger.get(n, ()):
            replay_start[k] = len(kinds)
            for i in replays[k].computed:
                rec_pos[k, i] = len(kinds)
                kinds.append(("recompute", order[i], k))
            replay_end[k] = len(kinds) - 1  # an empty one ends before the trigger runs
        for plan in unpack_at.get(n, ()):
            rebuild(plan)
        bwd_pos[n] = len(kinds)
        kinds.append(("bwd", n, -1))
        if accumulates[n]:
            acc_pos[n] = len(kinds)
            kinds.append(("accumulate", n, -1))
    end = len(kinds)  # "held to the end of the step"

    alloc_at: dict[str, tuple[int, int]] = {}  # instance -> (position, bytes)
    release: dict[str, int] = {}

    def hold(inst: str, position: int) -> None:
        if release.get(inst, -1) < position:
            release[inst] = position

    def kept_until(node: str) -> int:
        return bwd_pos.get(node, end)

    def own_storages(node: str) -> dict[str, int]:
        return owned_storages(graph, node, owner)

    def inside(k: int, sid: str) -> bool:
        return tree[k].start <= index[owner[sid]] < tree[k].stop

    prefixes = [set(r.prefix) for r in replays]
    descendants: list[list[int]] = [[] for _ in tree]
    for d, span in enumerate(tree):
        k = span.parent
        while k >= 0:
            descendants[k].append(d)
            k = tree[k].parent

    def value(sid: str, k: int) -> str:
        """The instance that holds storage ``sid`` as the recomputation of region ``k``
        sees it."""
        i = index[owner[sid]]
        while k >= 0:
            if tree[k].start <= i < tree[k].stop:
                if i not in prefixes[k]:
                    break
                if inner[i] == k and order[i] in schedule.saved:
                    return f"f:{sid}"
                return f"r{k}:{sid}"
            k = tree[k].parent
        return f"f:{sid}"

    inputs_of: dict[int, frozenset[str]] = {}  # region -> its inputs, found once

    def region_inputs(k: int) -> frozenset[str]:
        if k not in inputs_of:
            span = tree[k]
            found: set[str] = set()
            for i in range(span.start, span.stop):
                n = order[i]
                for sid in [s for u in preds[n] for s in refs[u]] + list(nodes[n]["saved"]):
                    if not inside(k, sid):
                        found.add(sid)
            inputs_of[k] = frozenset(found)
        return inputs_of[k]

    def frame_release(k: int) -> int:
        span = tree[k]
        packers = [order[i] for i in range(span.start, span.stop) if nodes[order[i]]["n_saved"]]
        return max((kept_until(p) for p in packers), default=span.stop - 1)

    # Forward instances and their forward readers.
    for n in order:
        for sid, nbytes in own_storages(n).items():
            alloc_at[f"f:{sid}"] = (fwd_pos[n], nbytes)
        for u in preds[n]:
            for sid in refs[u]:
                hold(f"f:{sid}", fwd_pos[n])
    for out in graph.graph["outputs"]:
        for sid in refs[out]:
            hold(f"f:{sid}", end)

    # What the forward pass keeps: saved tensors outside regions, the outermost regions'
    # inputs, and the outputs of cached ops.
    # An unpacked op's output saved outside regions: the saver keeps its recipe's inputs.
    for n in order:
        if inner[index[n]] < 0:
            for sid in nodes[n]["saved"]:
                rebuilt = rebuilt_by.get(sid)
                for kept in rebuilt.inputs if rebuilt else (sid,):
                    hold(f"f:{kept}", kept_until(n))
    life: dict[str, int] = {}  # unpacked op -> last step its recipe is held

    def recipe_life(plan: UnpackPlan) -> int:
        """Held by the forward's registry, its savers' packs, and later recipes' handles."""
        if plan.node not in life:
            users = [by_node[u] for names in plan.held_by.values() for u in names]
            life[plan.node] = max(
                [fwd_pos[order[-1]]]
                + [kept_until(saver) for names in plan.savers.values() for saver in names]
                + [recipe_life(user) for user in users]
            )
        return life[plan.node]

    for plan in plans:  # the forward's registry holds every recipe to the forward's end
        for kept in plan.inputs:
            hold(f"f:{kept}", fwd_pos[order[-1]])
        if plan.node in unpack_pos:
            for sid, nbytes in own_storages(plan.node).items():
                alloc_at[f"u:{sid}"] = (unpack_pos[plan.node], nbytes)
                for saver in plan.savers.get(sid, ()):
                    hold(f"u:{sid}", kept_until(saver))
                for user in plan.held_by.get(sid, ()):  # until that recipe's rebuild
                    hold(f"u:{sid}", unpack_pos.get(user, recipe_life(by_node[user])))
    for k, span in enumerate(tree):
        if span.parent < 0:
            for sid in region_inputs(k):
                hold(f"f:{sid}", frame_release(k))
        else:  # the parent's code holds a nested region's inputs while the region runs
            for sid in region_inputs(k):
                hold(f"f:{sid}", fwd_pos[order[span.stop - 1]])
    for n in sorted(schedule.saved, key=lambda n: index[n]):
        k, i = inner[index[n]], index[n]
        if k in replay_start and i in prefixes[k]:  # the recomputation takes it here
            before = [rec_pos[k, j] for j in replays[k].computed if j < i]
            until = max(before, default=replay_start[k] - 1)
        elif k in replay_start:  # the cache goes with the recomputation's context
            until = replay_end[k]
        else:
            until = frame_release(k)
        for sid in own_storages(n):
            hold(f"f:{sid}", until)

    # Recomputations: fresh storages, readers, packed tensors and inner regions' inputs.
    for k, span in enumerate(tree):
        if k not in replay_end:
            continue
        for i in replays[k].computed:
            n = order[i]
            position = rec_pos[k, i]
            for sid, nbytes in own_storages(n).items():
                alloc_at[f"r{k}:{sid}"] = (position, nbytes)
            for u in preds[n]:
                for sid in refs[u]:
                    hold(value(sid, k), position)
            # A value read after the recomputation stops (or outside the region) is held
            # by the region's code until the recomputation ends.
            later = [v for v in graph.successors(n) if index[v] not in prefixes[k]]
            if later or n in graph.graph["outputs"]:
                for sid in refs[n]:
                    hold(value(sid, k), replay_end[k])
            # An op that an inner region caches is cached again by that region's checkpoint
            # running inside this recomputation, until the recomputation ends.
            if inner[i] != k and n in schedule.saved:
                for sid in own_storages(n):
                    hold(f"r{k}:{sid}", replay_end[k])
        for i in range(span.start, span.stop):
            if inner[i] == k:
                for sid in nodes[order[i]]["saved"]:
                    hold(value(sid, k), kept_until(order[i]))
        for c in span.children:
            if tree[c].start > replays[k].last_event or not replays[c].holds:
                continue
            for sid in region_inputs(c):
                hold(value(sid, k), replay_end.get(c, frame_release(k)))
        # Regions inside run as checkpoints again; their callers hold their inputs while
        # they run: up to their last op, or to the end where the replay stops inside them.
        reached = replays[k].prefix
        for d in descendants[k]:
            if not reached or tree[d].start > reached[-1]:
                continue  # the replay stops before this region
            if tree[d].stop - 1 > reached[-1]:
                until = replay_end[k]
            else:
                # the last op it recomputes before the region ends (``computed`` ascends,
                # and so do their positions)
                computed = replays[k].computed
                j = bisect.bisect_left(computed, tree[d].stop)
                until = rec_pos[k, computed[j - 1]] if j else replay_start[k]
            for sid in region_inputs(d):
                hold(value(sid, k), until)

    # Gradients.
    start_pos = fwd_pos[order[-1]] + 1 if order else 0
    transient = gradient_instances(
        graph, nodes, preds, kinds, accumulates, acc_pos, start_pos, alloc_at, hold
    )

    return steps_of(kinds, alloc_at, release, transient)
