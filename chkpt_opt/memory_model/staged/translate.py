"""Any schedule as a staged schedule: the ops its op sequence recomputes before each
backward op (:func:`as_staged`).

A schedule of regions, cached or unpacked ops recomputes some forward ops just before some
backward ops (:func:`chkpt_opt.memory_model.op_sequence.lower`); the staged schedule that recomputes
the same ops before the same backward ops (each once per stage) does the same work and keeps each
value only to its last use, so it keeps at most as much where each stage recomputes an op
once and recomputes only what it returns (``tests/memory_model/staged/test_sequence.py`` checks it
on one-level regions with cached and unpacked ops). Solvers of staged schedules start from it
(:mod:`chkpt_opt.solvers.staged`).

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> from chkpt_opt.memory_model.schedule import Schedule
    >>> g = chain_graph(4, activation_bytes=100)
    >>> as_staged(g, Schedule(regions=(("n1", "n2"),))).staged
    (('n2', ('n1',)),)
"""

from __future__ import annotations

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.staged.rule import recomputable_ops, stage_ops, staged_schedule


def as_staged(graph: CostGraph, schedule: Schedule) -> Schedule:
    """The staged schedule recomputing what ``schedule``'s op sequence recomputes, stage by
    stage (ops a staged schedule cannot recompute, :func:`recomputable_ops`, left out: where
    one is, the result keeps it instead and may need more memory; what runs before the
    backward of an op that is no stage, :func:`stage_ops`, runs at the stage before it)."""
    if schedule.staged:
        return schedule
    allowed = recomputable_ops(graph)
    hosts = stage_ops(graph)
    stages: dict[str, list[str]] = {}
    waiting: list[str] = []
    last = ""  # the stage op whose backward ran last: recomputing earlier is still in time
    for step in lower(graph, schedule):
        if step.kind == "recompute":
            waiting.append(step.node)
        elif step.kind == "bwd":
            host = step.node if step.node in hosts else last
            if waiting and host:
                stages.setdefault(host, []).extend(n for n in waiting if n in allowed)
            waiting = []
            if step.node in hosts:
                last = step.node
    return Schedule(staged=staged_schedule(graph, stages))
