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
* the gradient of an op's output is created by the backward of its last reader (or at the
  start of the backward pass for a step output) and is freed once the op's own backward
  has run; views pass gradients on without copying; a parameter gradient lives to the end
  of the step;
* when another reader's backward produces a gradient for a tensor that already has one,
  autograd adds the two once that backward has released its inputs; the sum is modelled
  out of place (old, new and sum alive together), which is what the engine does when
  neither buffer can be reused and an upper bound otherwise. An op that reads a tensor
  several times (``x * x``) returns one gradient per read; fresh ones are summed in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import (
    CostGraph,
    edge_uses,
    ordered_nodes,
    storage_owners,
    storage_refs,
)
from chkpt_opt.schedule import Schedule


@dataclass(frozen=True)
class Step:
    """One step of the op sequence.

    Attributes:
        kind: ``"fwd"``, ``"recompute"``, ``"bwd_start"`` (output gradients appear), ``"bwd"``,
            or ``"accumulate"`` (a gradient is added to an existing one).
        node: the op (empty for ``bwd_start``).
        alloc: ``(instance id, bytes)`` of the storages this step creates.
        free: instance ids released once this step is done.
        transient_bytes: extra bytes alive only while the step runs.
    """

    kind: str
    node: str
    alloc: tuple[tuple[str, int], ...]
    free: tuple[str, ...]
    transient_bytes: int


def _saves_own_storage(graph: CostGraph, node: str, owner: dict[str, str]) -> bool:
    """Whether the op keeps one of its own outputs or buffers (packed after it runs)."""
    return any(owner.get(sid) == node for sid in graph.nodes[node]["saved"])


def replayed_ops(graph: CostGraph, region: tuple[str, ...], owner: dict[str, str]) -> list[str]:
    """The ops of a region that its recomputation runs (see the module docstring)."""
    packers = [n for n in region if graph.nodes[n]["n_saved"] > 0]
    if not any(graph.nodes[n]["has_backward"] for n in packers):
        return []
    last = packers[-1]
    return list(region[: region.index(last) + (1 if _saves_own_storage(graph, last, owner) else 0)])


def lower(graph: CostGraph, schedule: Schedule) -> list[Step]:
    """Returns the op sequence of one training step under ``schedule``.

    The schedule is assumed valid (see :func:`chkpt_opt.schedule.check_schedule`).
    """
    nodes = graph.nodes
    order = ordered_nodes(graph)
    owner = storage_owners(graph)
    refs = {n: storage_refs(graph, n) for n in order}
    preds = {n: sorted(graph.predecessors(n), key=lambda u: nodes[u]["index"]) for n in order}
    region_of: dict[str, int] = {n: k for k, r in enumerate(schedule.regions) for n in r}

    # Positions of every step.
    kinds: list[tuple[str, str]] = [("fwd", n) for n in order]
    fwd_pos = {n: i for i, n in enumerate(order)}
    replay: dict[str, tuple[int, list[str]]] = {}  # trigger node -> (region, replayed ops)
    for k, region in enumerate(schedule.regions):
        packers = [n for n in region if nodes[n]["n_saved"] > 0]
        triggers = [n for n in packers if nodes[n]["has_backward"]]
        if triggers:
            replay[triggers[-1]] = (k, replayed_ops(graph, region, owner))
    kinds.append(("bwd_start", ""))
    rec_pos: dict[str, int] = {}
    bwd_pos: dict[str, int] = {}
    acc_pos: dict[str, int] = {}
    # op -> (input, summed in place, summed into a new buffer that replaces the caller's seed)
    accumulates: dict[str, list[tuple[str, bool, bool]]] = {}
    has_grad = {o for o in graph.graph["outputs"] if nodes[o]["has_backward"]}
    seeded = set(has_grad)  # outputs whose gradient is still the seed the caller holds
    replayed_regions: set[int] = set()
    for n in reversed(order):
        if not nodes[n]["has_backward"]:
            continue
        if n in replay:
            k, ops = replay[n]
            replayed_regions.add(k)
            for u in ops:
                rec_pos[u] = len(kinds)
                kinds.append(("recompute", u))
        bwd_pos[n] = len(kinds)
        kinds.append(("bwd", n))
        targets = [u for u in preds[n] if nodes[u]["requires_grad"]]
        # One incoming gradient per use; all but the first of a tensor without a gradient
        # yet are sums (a view's backward passes its gradient on instead, once).
        accumulates[n] = []
        for u in targets:
            uses = edge_uses(graph, u, n)
            alias = nodes[n]["bwd_grad_alias"]
            if alias and uses == 1:
                continue
            # A sum with an older gradient, or of views, is modelled out of place (it costs
            # one more gradient while it runs); fresh gradients of the same backward call
            # are summed in place into one of them.
            in_place = not alias
            if u in seeded:
                # The caller keeps its seed; autograd sums into the fresh incoming gradient,
                # which then stands as the output's gradient until its backward.
                accumulates[n].append((u, True, True))
                seeded.discard(u)
            elif u in has_grad:
                accumulates[n].append((u, False, False))
            accumulates[n] += [(u, in_place, False)] * (uses - 1)
        if accumulates[n]:
            acc_pos[n] = len(kinds)
            kinds.append(("accumulate", n))
        has_grad.update(targets)
    end = len(kinds)  # "held to the end of the step"

    alloc_at: dict[str, tuple[int, int]] = {}  # instance -> (position, bytes)
    release: dict[str, int] = {}

    def hold(inst: str, position: int) -> None:
        if release.get(inst, -1) < position:
            release[inst] = position

    def kept_until(node: str) -> int:
        return bwd_pos.get(node, end)

    # Forward instances and their forward readers.
    region_inputs: dict[int, set[str]] = {k: set() for k in range(len(schedule.regions))}
    for n in order:
        attrs = nodes[n]
        for sid, nbytes in attrs["outputs"].items():
            alloc_at[f"f:{sid}"] = (fwd_pos[n], nbytes)
        for sid, nbytes in attrs["saved"].items():
            if owner[sid] == n and sid not in attrs["outputs"]:
                alloc_at[f"f:{sid}"] = (fwd_pos[n], nbytes)
        k = region_of.get(n)
        for u in preds[n]:
            for sid in refs[u]:
                hold(f"f:{sid}", fwd_pos[n])
                if k is not None and region_of.get(owner[sid]) != k:
                    region_inputs[k].add(sid)
    for out in graph.graph["outputs"]:
        for sid in refs[out]:
            hold(f"f:{sid}", end)

    # What the backward pass keeps, outside and inside regions.
    for n in order:
        k = region_of.get(n)
        for sid in nodes[n]["saved"]:
            if k is None:
                hold(f"f:{sid}", kept_until(n))
            elif region_of.get(owner[sid]) != k:
                region_inputs[k].add(sid)
            elif k in replayed_regions:
                hold(f"r:{sid}", kept_until(n))
    for k, region in enumerate(schedule.regions):
        packers = [n for n in region if nodes[n]["n_saved"] > 0]
        frame_release = max((kept_until(p) for p in packers), default=fwd_pos[region[-1]])
        for sid in region_inputs[k]:
            hold(f"f:{sid}", frame_release)

    # Replayed ops: their fresh storages and the readers inside the replay.
    for _, (k, ops) in replay.items():
        if k not in replayed_regions:
            continue
        inside = set(ops)
        for n in ops:
            attrs = nodes[n]
            for sid, nbytes in attrs["outputs"].items():
                alloc_at[f"r:{sid}"] = (rec_pos[n], nbytes)
            for sid, nbytes in attrs["saved"].items():
                if owner[sid] == n and sid not in attrs["outputs"]:
                    alloc_at[f"r:{sid}"] = (rec_pos[n], nbytes)
            for u in preds[n]:
                for sid in refs[u]:
                    if owner[sid] in inside:
                        hold(f"r:{sid}", rec_pos[n])

    # Gradients.
    transient = [0] * end
    grads: dict[str, list[str]] = {}
    outputs_with_grad = [o for o in graph.graph["outputs"] if nodes[o]["has_backward"]]
    start_pos = fwd_pos[order[-1]] + 1 if order else 0
    for out in sorted(set(outputs_with_grad), key=lambda o: nodes[o]["index"]):
        inst = f"g:{out}"
        alloc_at[inst] = (start_pos, nodes[out]["grad_bytes"])
        grads[out] = [inst]
        hold(inst, end)  # the caller holds the output gradients through the backward call
    for position, (kind, n) in enumerate(kinds):
        if kind in ("fwd", "recompute"):
            transient[position] = nodes[n]["fwd_workspace_bytes"]
            continue
        if kind == "accumulate":
            transient[position] = sum(
                nodes[u]["grad_bytes"] for u, in_place, _ in accumulates[n] if not in_place
            )
            continue
        if kind != "bwd":
            continue
        attrs = nodes[n]
        for j, (u, _, into_seed) in enumerate(accumulates.get(n, ())):
            inst = f"g:{u}@{n}#{j}"  # an incoming gradient, summed into the existing one
            alloc_at[inst] = (position, nodes[u]["grad_bytes"])
            if into_seed:
                grads[u] = [inst]
                hold(inst, kept_until(u))
            else:
                hold(inst, acc_pos[n])
        for u in preds[n]:
            if not nodes[u]["requires_grad"] or grads.get(u):
                continue
            if attrs["bwd_grad_alias"]:
                grads[u] = list(grads.get(n, []))
            else:
                inst = f"g:{u}"
                alloc_at[inst] = (position, nodes[u]["grad_bytes"])
                grads[u] = [inst]
            for inst in grads[u]:
                hold(inst, kept_until(u))
        if attrs["param_grad_bytes"]:
            inst = f"p:{n}"
            alloc_at[inst] = (position, attrs["param_grad_bytes"])
            hold(inst, end)
        transient[position] = attrs["bwd_workspace_bytes"]

    allocs: list[list[tuple[str, int]]] = [[] for _ in range(end)]
    frees: list[list[str]] = [[] for _ in range(end)]
    for inst, (position, nbytes) in alloc_at.items():
        allocs[position].append((inst, nbytes))
        last = max(release.get(inst, position), position)
        if last < end:
            frees[last].append(inst)
    return [
        Step(kind, n, tuple(sorted(allocs[p])), tuple(sorted(frees[p])), transient[p])
        for p, (kind, n) in enumerate(kinds)
    ]
