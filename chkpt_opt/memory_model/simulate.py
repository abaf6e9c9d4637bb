"""The simulator: the one reference for the peak memory and compute cost of a schedule.

It walks the op sequence of :func:`chkpt_opt.memory_model.op_sequence.lower` and sums the bytes
alive at every step. The bytes are those created during the step (activations, their gradients,
parameter gradients, buffers saved by ops); parameters, module buffers, inputs and
optimizer state are resident and are added by the caller (see :mod:`chkpt_opt.step_budget.budget`).

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> from chkpt_opt.memory_model.schedule import Schedule
    >>> g = chain_graph(4, activation_bytes=100)
    >>> simulate(g, Schedule()).peak_bytes >= 400
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from chkpt_opt.graphs.costgraph import CostGraph, attributes_by_node
from chkpt_opt.memory_model.op_sequence import Step, lower
from chkpt_opt.memory_model.region_replay import schedule_overhead_s
from chkpt_opt.memory_model.schedule import Schedule, check_schedule


@dataclass(frozen=True)
class TimelinePoint:
    """Memory at one step of the op sequence.

    Attributes:
        kind: ``"fwd"``, ``"recompute"``, ``"bwd_start"``, ``"bwd"`` or ``"accumulate"``.
        node: the op of the step.
        during_bytes: bytes alive while the step runs (transients included).
        after_bytes: bytes alive once it is done.
    """

    kind: str
    node: str
    during_bytes: int
    after_bytes: int


@dataclass(frozen=True)
class MemoryProfile:
    """What a schedule costs, as predicted by the simulator.

    Attributes:
        peak_bytes: largest ``during_bytes`` over the step.
        peak_index: position of the peak in ``timeline``.
        timeline: memory at every step of the op sequence.
        compute_s: estimated time of forward, recomputation and backward.
        recompute_s: estimated time of the recomputation alone (the extra compute), with
            what the regions cost beyond their ops
            (:func:`~chkpt_opt.memory_model.region_replay.schedule_overhead_s`).
        recompute_flops: floating-point operations recomputed.
        total_flops: floating-point operations of the whole step.
    """

    peak_bytes: int
    peak_index: int
    timeline: tuple[TimelinePoint, ...]
    compute_s: float
    recompute_s: float
    recompute_flops: int
    total_flops: int

    @property
    def peak_step(self) -> TimelinePoint:
        """The step at which memory peaks."""
        return self.timeline[self.peak_index]

    @property
    def overhead(self) -> float:
        """Recompute time as a fraction of the step time without recomputation."""
        base = self.compute_s - self.recompute_s
        return self.recompute_s / base if base > 0 else 0.0


def step_bytes(steps: Iterable[Step]) -> Iterator[tuple[Step, int, int]]:
    """Each step of an op sequence with the bytes alive while it runs (transients
    included) and once it is done."""
    sizes: dict[str, int] = {}
    live = 0
    for step in steps:
        for inst, nbytes in step.alloc:
            sizes[inst] = nbytes
            live += nbytes
        during = live + step.transient_bytes
        for inst in step.free:
            live -= sizes.pop(inst)
        yield step, during, live


def simulate(graph: CostGraph, schedule: Schedule, *, check: bool = True) -> MemoryProfile:
    """Predicts the memory timeline, peak and compute cost of one step under ``schedule``.

    Args:
        graph: the cost graph.
        schedule: the schedule to evaluate.
        check: validate the schedule first (solvers that build valid schedules skip it).
    """
    if check:
        check_schedule(graph, schedule)
    nodes = attributes_by_node(graph)
    peak = 0
    peak_index = 0
    timeline: list[TimelinePoint] = []
    compute_s = recompute_s = 0.0
    recompute_flops = total_flops = 0
    for position, (step, during, live) in enumerate(step_bytes(lower(graph, schedule))):
        if during > peak:
            peak, peak_index = during, position
        timeline.append(TimelinePoint(step.kind, step.node, during, live))
        if step.kind == "bwd":
            compute_s += nodes[step.node]["bwd_time_s"]
            total_flops += nodes[step.node]["bwd_flops"]
        elif step.kind in ("fwd", "recompute"):
            attrs = nodes[step.node]
            compute_s += attrs["fwd_time_s"]
            total_flops += attrs["fwd_flops"]
            if step.kind == "recompute":
                recompute_s += attrs["fwd_time_s"]
                recompute_flops += attrs["fwd_flops"]
    overhead = schedule_overhead_s(graph, schedule)
    compute_s += overhead
    recompute_s += overhead
    return MemoryProfile(
        peak_bytes=peak,
        peak_index=peak_index,
        timeline=tuple(timeline),
        compute_s=compute_s,
        recompute_s=recompute_s,
        recompute_flops=recompute_flops,
        total_flops=total_flops,
    )
