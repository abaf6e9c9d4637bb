"""The largest batch that fits a budget, with the best plan and without checkpointing.

Checkmate's headline measure: how much larger a batch a memory budget admits once the
schedule is optimized. Feasibility grows monotonically smaller with the batch, so the
search doubles the batch until it fails, then bisects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chkpt_opt.errors import BudgetError, InfeasibleBudgetError


@dataclass(frozen=True)
class MaxBatch:
    """Result of :func:`max_batch_size`.

    Attributes:
        budget_bytes: the whole-step budget.
        with_plan: largest batch for which the solver finds a schedule that fits (0: none).
        without_checkpointing: largest batch that fits keeping every activation (0: none).
        solver: the solver used.
        probes: batches tried, with whether each fitted ``(batch, keep_all_fits, plan_fits)``.
    """

    budget_bytes: int
    with_plan: int
    without_checkpointing: int
    solver: str
    probes: tuple[tuple[int, bool, bool], ...]

    @property
    def gain(self) -> float | None:
        """``with_plan / without_checkpointing`` (None when nothing fits without checkpointing)."""
        return self.with_plan / self.without_checkpointing if self.without_checkpointing else None


def _largest(fits: Callable[[int], bool], limit: int) -> int:
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_batch_size(
    build: Callable[[int], tuple[Any, tuple[Any, ...], dict[str, Any]]],
    budget: int | str,
    *,
    solver: str = "auto",
    optimizer: str | None = "adamw",
    max_batch: int = 1 << 14,
    time_limit_s: float | None = None,
) -> MaxBatch:
    """Searches the largest batch whose training step fits ``budget``.

    Args:
        build: ``build(batch) -> (model, args, kwargs)``.
        budget: whole-step budget.
        solver: solver for the "with plan" search.
        optimizer: optimizer whose state counts in the budget.
        max_batch: upper end of the search.
        time_limit_s: per-solve time limit.
    """
    import chkpt_opt

    cache: dict[int, tuple[bool, bool]] = {}

    def probe(batch: int) -> tuple[bool, bool]:
        if batch not in cache:
            model, args, kwargs = build(batch)
            try:
                plan = chkpt_opt.plan(
                    model,
                    args,
                    example_kwargs=kwargs,
                    budget=budget,
                    solver=solver,
                    optimizer=optimizer,
                    time_limit_s=time_limit_s,
                )
            except (InfeasibleBudgetError, BudgetError):
                cache[batch] = (False, False)
            else:
                keep_all = plan.static.resident_bytes + max(
                    chkpt_opt.simulate(plan.graph, chkpt_opt.Schedule()).peak_bytes,
                    plan.static.optimizer_phase_bytes,
                )
                cache[batch] = (keep_all <= plan.budget.total_bytes, True)
        return cache[batch]

    with_plan = _largest(lambda b: probe(b)[1], max_batch)
    without = _largest(lambda b: probe(b)[0], max_batch)
    parsed = chkpt_opt.parse_budget(budget)
    return MaxBatch(
        budget_bytes=parsed.total_bytes,
        with_plan=with_plan,
        without_checkpointing=without,
        solver=solver,
        probes=tuple((b, *cache[b]) for b in sorted(cache)),
    )
