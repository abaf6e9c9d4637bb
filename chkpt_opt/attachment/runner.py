"""What serves the calls of one input signature, and what the attachment has done so far."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from chkpt_opt.attachment.call_key import CallKey
from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer.dynamic_dims import InputDims
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.deadline import add_seconds
from chkpt_opt.step_budget.budget import format_bytes


@dataclass(frozen=True)
class Runner:
    """The rewritten module that serves one call key.

    Attributes:
        key: the call key.
        module: the rewritten module (shares the model's parameters and buffers).
        schedule: the schedule it runs.
        predicted_peak_bytes: the predicted peak of the whole step at this key's shapes.
        resident_bytes: the part of it that lives through the whole step (parameters,
            buffers, inputs, optimizer state).
        source: ``"solved"``, ``"reused"`` (a family member's schedule) or ``"stored"``.
        input_dims: for a capture with symbolic sizes, the input shapes it serves beside
            its own key's (any no larger, see :class:`~chkpt_opt.graphs.tracer.
            dynamic_dims.InputDims`); None for a capture of fixed shapes.
        drops_outputs: whether the schedule was made for a loop that drops those before
            the backward pass (as observed); else they count as held to its end.
        watched: the flat output positions whose storages tell whether the loop holds
            the outputs (:func:`~chkpt_opt.attachment.held_outputs.watched_positions`).
        program: for a capture with symbolic sizes, the value-computing ops of its program
            (:func:`~chkpt_opt.graphs.tracer.dynamic_dims.program_ops`), which a call with
            sizes of 1 must run too to be served by it (:mod:`.size_one`); else None.
        held_batch_bytes: the bytes of other batches its plan counts resident beside the
            call's own (:mod:`.held_batches`, :mod:`.fetched_batches`).
        fetched_batch_bytes: the part of them for batches fetched during the step.
    """

    key: CallKey
    module: torch.nn.Module
    schedule: Schedule
    predicted_peak_bytes: int
    resident_bytes: int
    source: str
    input_dims: InputDims | None = None
    drops_outputs: bool = False
    watched: tuple[int, ...] = ()
    program: tuple[str, ...] | None = None
    held_batch_bytes: int = 0
    fetched_batch_bytes: int = 0

    @property
    def droppable(self) -> bool:
        """Whether the step returns outputs it does not differentiate that autograd does
        not keep (logits beside the loss, see :mod:`~chkpt_opt.attachment.held_outputs`)."""
        return bool(self.watched)

    def serves(self, key: CallKey) -> bool:
        """Whether this runner runs ``key``'s calls within its prediction."""
        if key == self.key:
            return True
        dims = self.input_dims
        return dims is not None and key.family == self.key.family and dims.admits(key.shapes)


@dataclass
class AttachmentStats:
    """What the attachment has done so far.

    Attributes:
        calls: training calls served.
        captures: calls captured (the first of each input signature no runner serves).
        solves, reuses, stored: where those captures' schedules came from.
        size_one_checks: calls with sizes of 1 captured (not planned) to check that a
            capture with symbolic sizes of a larger call runs their program
            (:mod:`~chkpt_opt.attachment.size_one`).
        prepare_s: seconds spent on new keys: capturing, planning and rewriting.
        solve_s: the part of ``prepare_s`` spent solving.
        planning_s: seconds by planning stage over all new keys (``"capture"``,
            ``"op timing"``, ``"solve"``, ``"timed choice"``), each bounded together by
            ``time_limit_s`` per key.
        largest_predicted_peak_bytes: the largest predicted step peak of any key.
    """

    calls: int = 0
    captures: int = 0
    solves: int = 0
    reuses: int = 0
    stored: int = 0
    size_one_checks: int = 0
    prepare_s: float = 0.0
    solve_s: float = 0.0
    largest_predicted_peak_bytes: int = 0
    planning_s: dict[str, float] = field(default_factory=dict)

    def count_capture(
        self, source: str, seconds: float, peak_bytes: int, stage_s: Mapping[str, float]
    ) -> None:
        """Counts a captured call whose schedule was ``source`` (``"solved"``, ``"reused"``,
        ``"stored"``), prepared in ``seconds``, ``stage_s`` of them by planning stage."""
        self.captures += 1
        self.solves += source == "solved"
        self.reuses += source == "reused"
        self.stored += source == "stored"
        self.prepare_s += seconds
        add_seconds(self.planning_s, stage_s)
        self.largest_predicted_peak_bytes = max(self.largest_predicted_peak_bytes, peak_bytes)


def served_keys(runners: Mapping[CallKey, Runner]) -> list[tuple[Runner, list[CallKey]]]:
    """Each distinct runner of ``runners`` (the attachment's keys, least recently used
    first) once, with the keys it served: a capture with symbolic sizes serves every
    smaller shape under one plan. Ordered by each runner's latest key, so the last is the
    one of the latest call."""
    keys: dict[int, list[CallKey]] = {}
    by_id: dict[int, Runner] = {}
    for key, runner in runners.items():
        keys.setdefault(id(runner), []).append(key)
        by_id[id(runner)] = runner
    latest = {id(runner): i for i, runner in enumerate(runners.values())}
    order = sorted(by_id, key=latest.__getitem__)
    return [(by_id[i], keys[i]) for i in order]


def plans_summary(runners: Mapping[CallKey, Runner], stats: AttachmentStats) -> str:
    """The distinct plans kept, with the shapes each served, and what the attachment has
    done (captures, solves): one line per plan."""
    served = served_keys(runners)
    lines = [
        f"{len(served)} plan(s) kept; {stats.calls} training calls, {stats.captures} "
        f"captures, {stats.solves} solves, {stats.reuses} reused, {stats.stored} stored"
    ]
    for i, (runner, keys) in enumerate(served, 1):
        capture = "symbolic sizes" if runner.input_dims is not None else "fixed shapes"
        lines.append(
            f"plan {i} ({runner.source}, {capture}, {len(runner.schedule.regions)} recompute "
            f"regions, predicted step peak {format_bytes(runner.predicted_peak_bytes)}"
            f"{', outputs dropped' if runner.drops_outputs else ''}): served "
            + "; ".join(key.describe() for key in keys)
        )
    return "\n".join(lines)


def reusable_schedule(
    key: CallKey, made: list[tuple[int, Schedule]], graph: CostGraph, budget_bytes: int
) -> Schedule | None:
    """A schedule ``made`` for a call of ``key``'s family (with its input elements) that
    fits ``graph`` (``key``'s capture) within ``budget_bytes``: those of the nearest larger
    calls first, then of the nearest smaller ones (a plan made at a shorter length may
    leave room at a longer one); None where none fits."""
    elements = key.input_elements
    larger = sorted((item for item in made if item[0] >= elements), key=lambda i: i[0])
    smaller = sorted((item for item in made if item[0] < elements), key=lambda i: -i[0])
    for _, schedule in [*larger, *smaller]:
        try:
            peak = simulate(graph, schedule).peak_bytes
        except ScheduleError:  # the program differs at this shape
            continue
        if peak <= budget_bytes:
            return schedule
    return None
