"""What the executor of a staged schedule (:mod:`chkpt_opt.codegen.staged`) reads, worked out
from the graph and the schedule before anything runs: which instance of each storage every
use takes, by the rule of :func:`chkpt_opt.memory_model.staged.sequence.lower_staged` (the latest
instance computed before the use).

An instance is ``(storage, j)``: made by recomputation step ``j`` (the steps of all stages,
in the order they run), or ``j = -1`` for the forward's. A recomputation makes the storages
its op returns and the buffers the op saves for its own backward without returning them
(``<op>:buf<k>``: a max-pool's indices, a layer norm's statistics), which its backward then
unpacks like any other instance. The uses the executor serves are a recomputation step
reading a storage (:func:`~chkpt_opt.graphs.costgraph.storages_read`) and a backward op
unpacking a storage it saved; forward readers, savers whose use takes the forward instance
and the step's outputs hold the forward's tensors as eager PyTorch does.

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> from chkpt_opt.memory_model.schedule import Schedule
    >>> from chkpt_opt.memory_model.staged import staged_schedule
    >>> g = chain_graph(3, activation_bytes=1000)  # n0 -> n1 -> n2, each saving its input
    >>> plan = staged_plan(g, Schedule(staged=staged_schedule(g, {"n2": ["n0", "n1"]})))
    >>> plan.steps, plan.stages, plan.reads[1]
    (('n0', 'n1'), {'n2': (0, 1)}, {'n0': ('n0', 0)})
    >>> sorted(plan.handles.items())  # each backward unpacks what the stage recomputed
    [(('n1', 'n0'), ('n0', 0)), (('n2', 'n1'), ('n1', 1))]
    >>> plan.buffers  # no op saves a buffer of its own here
    {}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from chkpt_opt.errors import ScheduleError, short
from chkpt_opt.graphs.costgraph import CostGraph, storage_owners, storages_read
from chkpt_opt.graphs.frozen import frozen
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.staged.rule import recomputed_storages
from chkpt_opt.memory_model.unpack.rule import rebuilt_storages

Key = tuple[str, int]
"""An instance of a storage: ``(storage, j)``, made by recomputation step ``j`` (``-1``: the
forward's)."""


@dataclass(frozen=True)
class StagedPlan:
    """What the executor of a staged schedule reads (see the module docstring).

    Attributes:
        steps: the op of each recomputation step, in the order they run.
        stages: each stage's op -> its recomputation steps.
        reads: per step, the instance each storage it reads is taken from.
        handles: ``(saver, storage)`` -> the recomputed instance the saver's backward
            unpacks (absent: the forward's, which autograd saves as it is).
        planned: instance -> how many recomputation steps read it.
        outputs: the storages with bytes that each op the executor follows returns, in the
            order of its outputs.
        backward: the ops that run a backward.
        recomputed: the ops some stage recomputes.
        buffers: each recomputed op that saves buffers of its own -> those buffers
            (``<op>:buf<k>``, in the order of ``k``) with their bytes; the op is recomputed
            with autograd recording to capture them.
        output_bytes: each op of ``buffers`` -> the bytes of its outputs as traced (a call
            whose outputs are smaller is a smaller shape that a symbolic capture serves,
            where its buffers are no larger than traced).
        replayed: each recomputed random op -> its last recomputation step: it is
            recomputed under the generators' state its forward call found, kept until then.
    """

    steps: tuple[str, ...]
    stages: dict[str, tuple[int, ...]]
    reads: tuple[dict[str, Key], ...]
    handles: dict[tuple[str, str], Key]
    planned: dict[Key, int]
    outputs: dict[str, tuple[str, ...]]
    backward: frozenset[str]
    recomputed: frozenset[str]
    buffers: dict[str, tuple[tuple[str, int], ...]]
    replayed: dict[str, int]
    output_bytes: dict[str, int]


def own_buffers(graph: CostGraph, op: str) -> tuple[tuple[str, int], ...]:
    """The buffers ``op`` saves for its own backward without returning them, with their
    bytes: ``<op>:buf<k>`` for ``k = 0, 1, ...``, in the order it packs them (the tracer's
    names).

    Raises:
        ScheduleError: a storage ``op`` owns and some op saves that it neither returns nor
            saves under the tracer's name for a buffer of its own, which a recomputation of
            ``op`` cannot re-create.
    """
    nodes = graph.nodes
    outputs = set(nodes[op]["outputs"])
    own = recomputed_storages(graph)[op] - outputs
    named = [f"{op}:buf{k}" for k in range(len(own))]
    # a buffer another op saves too could not be handed to that op (it is no output)
    hidden = sorted((rebuilt_storages(graph)[op] - outputs) | (own - set(named)))
    if hidden:
        raise ScheduleError(
            f"staged schedule: op {short(op)} owns storages {hidden[:3]} that some op saves "
            f"but that {short(op)} neither returns nor saves as a buffer of its own "
            f"({short(op)}:buf<k>), so its recomputation cannot re-create them; drop "
            f"{short(op)} from the stages."
        )
    return tuple((sid, int(nodes[op]["saved"][sid])) for sid in named)


def staged_plan(graph: CostGraph, schedule: Schedule) -> StagedPlan:
    """The plan of ``schedule``, a checked staged schedule of ``graph``.

    Raises:
        ScheduleError: a recomputed op that would have to re-create a storage it neither
            returns nor saves as a buffer of its own (:func:`own_buffers`).
    """
    nodes = graph.nodes
    steps = tuple(r for _, ops in schedule.staged for r in ops)
    stage_of = [b for b, ops in schedule.staged for _ in ops]
    with frozen(graph):  # its facts once, not per op: 13.7 s -> 0.67 s at 2,221 ops, 308 staged
        buffers = {r: found for r in dict.fromkeys(steps) if (found := own_buffers(graph, r))}
    made: dict[str, list[int]] = {}
    for j, r in enumerate(steps):
        for sid in [*nodes[r]["outputs"], *(sid for sid, _ in buffers.get(r, ()))]:
            made.setdefault(sid, []).append(j)

    def latest(sid: str, before: int) -> Key:
        found = [j for j in made.get(sid, ()) if j < before]
        return (sid, found[-1] if found else -1)

    owner = storage_owners(graph)
    reads = tuple(
        {sid: latest(sid, j) for sid in storages_read(graph, r, owner)} for j, r in enumerate(steps)
    )
    backward = frozenset(n for n in graph.nodes if nodes[n]["has_backward"])
    handles: dict[tuple[str, str], Key] = {}
    for n in backward:
        # the backward of n runs after the steps of the stages at n and before it
        before = sum(1 for b in stage_of if nodes[b]["index"] >= nodes[n]["index"])
        for sid in nodes[n]["saved"]:
            key = latest(sid, before)
            if key[1] >= 0:
                handles[(n, sid)] = key
    planned = Counter(key for step in reads for key in step.values())
    followed = set(steps) | {owner[sid] for sid, _ in planned}
    return StagedPlan(
        steps=steps,
        stages={b: tuple(j for j, s in enumerate(stage_of) if s == b) for b, _ in schedule.staged},
        reads=reads,
        handles=handles,
        planned=dict(planned),
        outputs={n: tuple(s for s, size in nodes[n]["outputs"].items() if size) for n in followed},
        backward=backward,
        recomputed=frozenset(steps),
        buffers=buffers,
        replayed={r: j for j, r in enumerate(steps) if nodes[r]["is_random"]},
        output_bytes={n: sum(nodes[n]["outputs"].values()) for n in buffers},
    )
