"""A batch of 1 served by the capture with symbolic sizes of a larger one.

torch.export specializes sizes 0 and 1: a dimension captured symbolic at an example of 2 or
more is valid from 2 up (its range starts at 2), so a loop whose last batch holds one
sample used to be captured and solved anew (a LoRA Llama in ``peft``: 4 captures and 3
solves in 4 steps). A size of 1 is special to the tracer only where the model's code
branches on it; where it does not, the program the model runs at 1 is the symbolic one.

:func:`serving_at_size_one` checks that: a call that a symbolic runner would admit but for
sizes of 1 below its ranges is captured at its own shapes (on fake tensors, not planned),
and served by that runner where the value-computing ops of both programs are the same
(:func:`~chkpt_opt.graphs.tracer.dynamic_dims.program_ops`, the rule the attachment uses
to accept a symbolic capture at all). Its prediction at the example's sizes bounds the
call's, every tensor's size growing with the sizes it is made of. Where the programs
differ, the call is captured and planned as any new shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from chkpt_opt.attachment.call_key import CallKey
from chkpt_opt.attachment.runner import AttachmentStats, Runner
from chkpt_opt.graphs.tracer import Traced
from chkpt_opt.graphs.tracer.dynamic_dims import InputDims, program_ops

log = logging.getLogger(__name__)


def admits_with_ones(dims: InputDims, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether ``dims`` would admit ``shapes`` (:meth:`InputDims.admits`) with every range
    that starts at 2 starting at 1, and some size is 1 there (else ``admits`` decides)."""
    lowered = {
        symbol: (1 if low == 2 else low, high) for symbol, (low, high) in dims.ranges.items()
    }
    ones = any(
        size == 1 and not isinstance(dim, int) and dims.ranges[dim][0] == 2
        for path, shape in shapes.items()
        for size, dim in zip(shape, dims.dims.get(path, ()))
    )
    return ones and InputDims(dims.dims, lowered, dims.example).admits(shapes)


def serving_at_size_one(
    runners: Iterable[Runner],
    key: CallKey,
    capture: Callable[[], Traced],
    stats: AttachmentStats,
) -> Runner | None:
    """The symbolic runner among ``runners`` (largest first) that serves ``key``, a call
    with sizes of 1 below its ranges, where ``capture()`` (the call captured at its own
    shapes) runs its program; None where no runner would admit it or the programs differ."""
    candidates = [
        runner
        for runner in runners
        if runner.program is not None
        and runner.input_dims is not None
        and runner.key.family == key.family
        and admits_with_ones(runner.input_dims, key.shapes)
    ]
    if not candidates:
        return None
    stats.size_one_checks += 1
    ops = tuple(program_ops(capture().captured.module))
    runner = next((r for r in candidates if r.program == ops), None)
    log.info(
        "chkpt_opt: %s %s",
        key.describe(),
        "runs the program of the capture with symbolic sizes of "
        + runner.key.describe()
        + ": served by it"
        if runner is not None
        else "runs another program at a size of 1 than the captures with symbolic sizes: "
        "captured alone",
    )
    return runner
