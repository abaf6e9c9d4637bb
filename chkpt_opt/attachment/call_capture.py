"""How the attachment captures a training call: at its own shapes, with symbolic sizes
where that graph computes the same program, and at sizes rounded up for a family that
keeps growing.

A capture runs the model as it was before the plan was attached (torch.export reads its
forward's code): :meth:`CallCapture.own_forward_while_capturing` restores that forward for
the span of a capture, and :attr:`CallCapture.capturing` tells the attached forward to call
the model's own meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from chkpt_opt.attachment.buckets import grown_inputs
from chkpt_opt.attachment.call_key import CallKey, call_key
from chkpt_opt.errors import TraceError
from chkpt_opt.graphs.tracer import Traced, build_traced, capture_model, trace_model
from chkpt_opt.graphs.tracer.capture import Captured
from chkpt_opt.graphs.tracer.dynamic_dims import program_ops
from chkpt_opt.measurement import measure_traced, trace_and_measure
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline

log = logging.getLogger(__name__)

Capture = tuple[Captured, tuple[Any, ...], dict[str, Any]]
"""A capture and the inputs as captured (:func:`~chkpt_opt.graphs.tracer.capture_model`)."""

SYMBOLIC_TIME_FACTOR = 3.0
"""What a capture with symbolic sizes takes against the capture at fixed shapes, about (a
32-layer Llama of width 256: 14 s against 5.5 s)."""

SYMBOLIC_OVERRUN_S = 2.0
"""The symbolic capture is skipped where its estimate (:data:`SYMBOLIC_TIME_FACTOR` times the
fixed capture's time) exceeds the time left of the limit by more than this: it would end
past the limit (a 32-layer Llama given 10 s: 13.5 s estimated, 5.5 s left), while a small
model's (a second or two) pays for itself at the next shape it serves."""


@dataclass
class CallCapture:
    """The capture rules of one attached model.

    Attributes:
        model: the model.
        own_forward: its forward as it was before the plan was attached, where that was
            not its class's (a wrapper's); None: the class's.
        tracer: the tracer of fixed-shape captures (``trace_model``'s ``method``).
        capturing: a capture is running (the attached forward calls the model's own).
    """

    model: torch.nn.Module
    own_forward: Callable[..., Any] | None
    tracer: str
    capturing: bool = False
    # families whose symbolic capture computed another program: captured per shape
    _fixed_only: set[tuple[object, ...]] = field(default_factory=set, repr=False)

    @contextlib.contextmanager
    def own_forward_while_capturing(self) -> Iterator[None]:
        """The model as it was before the plan was attached, for the span of a capture."""
        attrs = self.model.__dict__
        attached = attrs.pop("forward", None)
        if self.own_forward is not None:
            attrs["forward"] = self.own_forward
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False
            attrs.pop("forward", None)
            if attached is not None:
                attrs["forward"] = attached

    def fixed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Traced:
        """The call captured at its own shapes (not measured)."""
        with self.own_forward_while_capturing():
            return trace_model(self.model, args, kwargs, method=self.tracer)

    def measured(
        self,
        key: CallKey,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        deadline: Deadline = NO_DEADLINE,
    ) -> Traced:
        """The call captured with symbolic sizes (one graph for every smaller batch and
        shorter length) where torch.export allows, the deadline leaves the time
        (:data:`SYMBOLIC_OVERRUN_S`), and that graph computes what the capture at this
        call's own shapes computes (the model's eager program); else at its own shapes.
        One cost graph is built, the kept capture's, and measured."""
        name = type(self.model).__name__
        with self.own_forward_while_capturing():
            start_s = time.perf_counter()
            kept = fixed = capture_model(self.model, args, kwargs, method=self.tracer)
            fixed_s = time.perf_counter() - start_s
            if fixed[0].method == "export" and key.family not in self._fixed_only:
                kept = self._symbolic(key, args, kwargs, fixed, fixed_s, deadline) or fixed
            return measure_traced(build_traced(*kept, name=name), profile_times=False)

    def _symbolic(
        self,
        key: CallKey,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fixed: Capture,
        fixed_s: float,
        deadline: Deadline,
    ) -> Capture | None:
        """The symbolic capture, where it is kept (see :meth:`measured`)."""
        left_s = deadline.remaining_s()
        estimate_s = SYMBOLIC_TIME_FACTOR * fixed_s
        if left_s is not None and estimate_s > left_s + SYMBOLIC_OVERRUN_S:
            log.info(
                "chkpt_opt: no capture with symbolic sizes: %.1f s left of the time limit, "
                "and it takes about %.0f times the %.1f s of the capture at fixed shapes; "
                "each shape of %s is captured alone",
                left_s,
                SYMBOLIC_TIME_FACTOR,
                fixed_s,
                key.describe(),
            )
            return None
        self._fixed_only.add(key.family)  # until a symbolic capture is kept below
        try:
            symbolic = capture_model(self.model, args, kwargs, method="export", dynamic=True)
        except TraceError as err:
            log.info("chkpt_opt: no capture with symbolic sizes (%s)", err)
            return None
        dims = symbolic[0].input_dims
        if dims is None or not dims.symbolic:
            return None
        if program_ops(symbolic[0].module) != program_ops(fixed[0].module):
            log.info(
                "chkpt_opt: with symbolic sizes %s runs another program than at fixed "
                "shapes (branches on sizes or values); each shape of %s is captured alone",
                type(self.model).__name__,
                key.describe(),
            )
            return None
        self._fixed_only.discard(key.family)
        return symbolic

    def grown(
        self, key: CallKey, traced: Traced, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[CallKey, Traced] | None:
        """The call's key and capture at sizes rounded up (:mod:`.buckets`), for a family
        planned before that ``traced`` (its symbolic capture) serves, so the lengths that
        follow need no plan of their own; None where that does not apply."""
        dims = traced.captured.input_dims
        if dims is None or not dims.symbolic:
            return None
        grown = grown_inputs(dims, args, kwargs)
        if grown is None:
            return None
        with self.own_forward_while_capturing():
            try:
                bigger = trace_and_measure(self.model, *grown, method="export", dynamic=True)
            except TraceError as err:
                log.info("chkpt_opt: no capture at rounded-up sizes (%s)", err)
                return None
        ops = program_ops(traced.captured.module)
        if program_ops(bigger.captured.module) != ops or bigger.captured.input_dims is None:
            return None
        grown_key = call_key(self.model, *grown)
        log.info(
            "chkpt_opt: %s is planned again for its family: at %s (rounded up), which "
            "serves the calls up to that size",
            key.describe(),
            grown_key.describe(),
        )
        return grown_key, bigger

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["capturing"] = False
        return state
