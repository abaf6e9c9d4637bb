"""The torch.compile lowering, measured: what the compiled step keeps of the plan.

``plan.apply(for_compile=True)`` hands the plan to ``torch.compile`` as non-reentrant
checkpoint regions, and :func:`~chkpt_opt.export.partitioner.compile_module` makes the
partitioner keep and recompute what the plan keeps and recomputes. The decisions are then
the plan's; the memory around them is not exactly: compiled kernels materialise fewer
intermediates, free buffers at other points and some decompositions save other tensors
than eager autograd. So this lowering is measured, not simulated: the bytes the compiled
forward saves beside the bytes the plan keeps (the decisions), and the step's peak eager
and compiled on the same ruler (the CPU allocator's events).

Example:
    >>> report = measure_compiled(plan, args)            # doctest: +SKIP
    >>> report.measured_peak_bytes <= report.budget_dynamic_bytes  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from chkpt_opt.export.partitioner import PlanPartitioner, compile_module
from chkpt_opt.measurement.module_state import preserved_state
from chkpt_opt.measurement.step import measure_step_allocator, run_step

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
        planned_saved_bytes: activations the plan keeps from forward to backward (bytes
            alive when the forward pass ends).
        compiled_saved_bytes: activations the compiled forward saves for the backward (None
            when the compiled graphs came from PyTorch's caches and were not partitioned).
    """

    planned_peak_bytes: int
    eager_peak_bytes: int
    compiled_peak_bytes: int
    budget_dynamic_bytes: int
    planned_saved_bytes: int
    compiled_saved_bytes: int | None

    @property
    def meets_budget(self) -> bool:
        """Whether the compiled step fits the budget."""
        return self.compiled_peak_bytes <= self.budget_dynamic_bytes

    @property
    def change(self) -> float:
        """Compiled peak relative to the eager one (-0.3: compiled holds 30% less)."""
        return self.compiled_peak_bytes / max(self.eager_peak_bytes, 1) - 1.0

    @property
    def saved_change(self) -> float | None:
        """Compiled saved bytes relative to the plan's kept bytes (None when not recorded)."""
        if self.compiled_saved_bytes is None:
            return None
        return self.compiled_saved_bytes / max(self.planned_saved_bytes, 1) - 1.0

    @property
    def notes(self) -> tuple[str, ...]:
        """What compilation changed, in words: the decisions first, then the peak."""
        notes = []
        saved = self.saved_change
        if saved is not None:
            notes.append(
                f"the compiled forward saves {self.compiled_saved_bytes:,} bytes for the "
                f"backward, the plan keeps {self.planned_saved_bytes:,} ({saved:+.1%})"
            )
        change = self.change
        if abs(change) <= EQUAL_WITHIN:
            notes.append(f"the compiled step holds what the plan holds (within {EQUAL_WITHIN:.0%})")
        elif change < 0:
            notes.append(
                f"the compiled step holds {-change:.0%} less than the eager plan: compiled "
                "kernels materialise fewer intermediates than eager ops"
            )
        else:
            notes.append(
                f"the compiled step holds {change:.0%} more than the eager plan: compiled "
                "kernels keep buffers or save tensors that eager ops do not"
                + ("" if self.meets_budget else ", and it misses the budget the plan meets")
            )
        return tuple(notes)


def planned_saved_bytes(plan: Plan) -> int:
    """Bytes the plan keeps alive when the forward pass ends (outputs included), read from
    its simulated timeline."""
    return next(p.after_bytes for p in reversed(plan.profile.timeline) if p.kind == "fwd")


def measure_compiled(
    plan: Plan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> CompiledLowering:
    """Measures the plan eager and compiled (with the plan partitioner), and says what
    compilation changed.

    Args:
        plan: the plan (its model's state is restored afterwards). A plan whose schedule
            nests regions is measured as the compiled step runs it: its plan without
            nesting at the same budget (:meth:`~chkpt_opt.api.Plan.for_compile`), eager and
            compiled, against that plan's prediction.
        args: example inputs, as for :func:`chkpt_opt.plan`.
        kwargs: example keyword inputs.
    """
    kwargs = kwargs or {}
    plan = plan.for_compile()
    eager_module = plan.apply()
    partitioner = PlanPartitioner()
    compiled_module = compile_module(plan.apply(for_compile=True), partitioner=partitioner)
    # The captured module shares the model's parameters and buffers: restore them after.
    with preserved_state(plan.traced.captured.module):
        torch.manual_seed(0)
        eager = measure_step_allocator(eager_module, args, kwargs)
        # Compile the forward and the backward outside the measurement; bypass the compile
        # cache so that the partitioner runs and records what it saves.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            for _ in range(2):
                run_step(compiled_module, args, kwargs)
        torch.manual_seed(0)
        compiled = measure_step_allocator(compiled_module, args, kwargs)
    return CompiledLowering(
        planned_peak_bytes=plan.profile.peak_bytes,
        eager_peak_bytes=eager,
        compiled_peak_bytes=compiled,
        budget_dynamic_bytes=plan.activation_budget_bytes,
        planned_saved_bytes=planned_saved_bytes(plan),
        compiled_saved_bytes=(
            sum(r.saved_bytes for r in partitioner.records) if partitioner.records else None
        ),
    )
