"""The torch.compile lowering, measured: what the compiled step keeps of the plan.

``plan.apply(for_compile=True)`` hands the plan to ``torch.compile`` as non-reentrant
checkpoint regions; AOTAutograd's partitioner then decides what the compiled backward
saves. Inside a region it recomputes, as planned; outside, its own rules apply (it may
recompute cheap pointwise ops into fused kernels), and with regions present it may
recompute more than the plan asks for. So this lowering is not simulated exactly: it is
measured, eager plan and compiled plan on the same ruler (the CPU allocator's events), and
the difference is reported as what the lowering changes.

Example:
    >>> report = measure_compiled(plan, args)            # doctest: +SKIP
    >>> report.measured_peak_bytes <= report.budget_dynamic_bytes  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from chkpt_opt.measure import measure_step_allocator, preserved_state, run_step

if TYPE_CHECKING:
    from chkpt_opt.api import Plan

#: Relative difference between compiled and eager peaks below which they count as equal.
EQUAL_WITHIN = 0.02


@dataclass(frozen=True)
class CompiledLowering:
    """The plan's forward+backward peak under eager and compiled execution.

    Attributes:
        planned_peak_bytes: the simulator's prediction for the eager schedule.
        eager_peak_bytes: allocator peak of one step of the eager plan module.
        compiled_peak_bytes: allocator peak of one step of the compiled plan module.
        budget_dynamic_bytes: the plan's budget less its resident bytes (what the step may use).
    """

    planned_peak_bytes: int
    eager_peak_bytes: int
    compiled_peak_bytes: int
    budget_dynamic_bytes: int

    @property
    def meets_budget(self) -> bool:
        """Whether the compiled step fits the budget."""
        return self.compiled_peak_bytes <= self.budget_dynamic_bytes

    @property
    def change(self) -> float:
        """Compiled peak relative to the eager one (-0.3: compiled holds 30% less)."""
        return self.compiled_peak_bytes / max(self.eager_peak_bytes, 1) - 1.0

    @property
    def notes(self) -> tuple[str, ...]:
        """What compilation changed, in words."""
        change = self.change
        if abs(change) <= EQUAL_WITHIN:
            return (f"the compiled step holds what the plan holds (within {EQUAL_WITHIN:.0%})",)
        if change < 0:
            return (
                f"the compiled step holds {-change:.0%} less than the eager plan: the "
                "partitioner recomputes more than the plan asks for, so the step costs more "
                "compute than the plan's estimate (time it before relying on the estimate)",
            )
        return (
            f"the compiled step holds {change:.0%} more than the eager plan: the compiled "
            "backward keeps tensors the plan drops",
        )


def measure_compiled(
    plan: Plan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    backend: str = "inductor",
) -> CompiledLowering:
    """Measures the plan eager and compiled, and says what compilation changed.

    Args:
        plan: the plan (its model's state is restored afterwards).
        args: example inputs, as for :func:`chkpt_opt.plan`.
        kwargs: example keyword inputs.
        backend: the ``torch.compile`` backend.
    """
    kwargs = kwargs or {}
    eager_module = plan.apply()
    compiled_module = torch.compile(plan.apply(for_compile=True), backend=backend)
    # The captured module shares the model's parameters and buffers: restore them after.
    with preserved_state(plan.traced.captured.module):
        torch.manual_seed(0)
        eager = measure_step_allocator(eager_module, args, kwargs)
        for _ in range(2):  # compile the forward and the backward outside the measurement
            run_step(compiled_module, args, kwargs)
        torch.manual_seed(0)
        compiled = measure_step_allocator(compiled_module, args, kwargs)
    return CompiledLowering(
        planned_peak_bytes=plan.profile.peak_bytes,
        eager_peak_bytes=eager,
        compiled_peak_bytes=compiled,
        budget_dynamic_bytes=plan.activation_budget_bytes,
    )
