"""What serves the calls of one input signature, and what the attachment has done so far."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chkpt_opt.attachment.call_key import CallKey
from chkpt_opt.graphs.tracer.dynamic_dims import InputDims
from chkpt_opt.memory_model.schedule import Schedule


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
        prepare_s: seconds spent on new keys: capturing, planning and rewriting.
        solve_s: the part of ``prepare_s`` spent solving.
        largest_predicted_peak_bytes: the largest predicted step peak of any key.
    """

    calls: int = 0
    captures: int = 0
    solves: int = 0
    reuses: int = 0
    stored: int = 0
    prepare_s: float = 0.0
    solve_s: float = 0.0
    largest_predicted_peak_bytes: int = 0
