"""The largest batch that fits a budget, with the best plan and without checkpointing.

Checkmate's headline measure: how much larger a batch a memory budget admits once the
schedule is optimized. Feasibility grows monotonically smaller with the batch, so each
search doubles the batch until it fails, then bisects.

Each batch is traced once (on fake tensors, op times estimated: no model run) and what it
needs is asked in order of cost: whether keeping every activation fits (a simulation, no
solve), then, only where it does not, whether the solver finds a schedule that fits (one
solve, at most ``time_limit_s``). Keep-all fitting means a plan fits too, so the search
without checkpointing runs first and the search with a plan starts from its answer; a batch
the first search settled is never solved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chkpt_opt.errors import BudgetError

FEASIBILITY_GAP = 0.99
"""``auto``'s gap in the search with a plan: a batch asks whether any schedule fits, not
the cheapest, so ``auto`` returns the first fitting schedule its roundings of the recompute
bound's LP find (and at once where that bound proves nothing fits) rather than searching
on for a proof of cost."""


@dataclass(frozen=True)
class MaxBatch:
    """Result of :func:`max_batch_size`.

    Attributes:
        budget_bytes: the whole-step budget.
        with_plan: largest batch for which a schedule fits: keep-all, or the one the solver
            finds (0: none).
        without_checkpointing: largest batch that fits keeping every activation (0: none).
        solver: the solver used.
        probes: batches tried, with whether each fitted ``(batch, keep_all_fits, plan_fits)``;
            ``plan_fits`` is True where keep-all fits, the solver's answer where it ran
            (``solved``), and else what monotonicity gives (a batch at most ``with_plan``).
        solved: the batches the solver ran on.
        proven_infeasible: the batches proven to fit no schedule: by the solver, or by the
            resident memory alone above the budget (the other batches that fit no plan may
            fit a schedule the solver did not find in its time).
    """

    budget_bytes: int
    with_plan: int
    without_checkpointing: int
    solver: str
    probes: tuple[tuple[int, bool, bool], ...]
    solved: tuple[int, ...] = ()
    proven_infeasible: tuple[int, ...] = ()

    @property
    def next_batch(self) -> tuple[int, bool] | None:
        """The smallest batch above ``with_plan`` the search asked about, and whether no
        schedule is proven to fit it (False: none was found in the time limit); None where
        no larger batch was asked."""
        larger = [b for b, _, _ in self.probes if b > self.with_plan]
        if not larger:
            return None
        return min(larger), min(larger) in self.proven_infeasible

    @property
    def gain(self) -> float | None:
        """``with_plan / without_checkpointing`` (None when nothing fits without checkpointing)."""
        return self.with_plan / self.without_checkpointing if self.without_checkpointing else None


def largest(fits: Callable[[int], bool], limit: int, start: int = 1) -> int:
    """The largest ``n <= limit`` with ``fits(n)``, for a ``fits`` true up to some point and
    false beyond: doubling from ``start`` (known to fit where ``start > 1``; ``1`` is asked)
    until it fails, then bisection; 0 where not even 1 fits."""
    lo, hi = (start, start * 2) if start > 1 else (0, 1)
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
    outputs_held: bool = True,
) -> MaxBatch:
    """Searches the largest batch whose training step fits ``budget``.

    Args:
        build: ``build(batch) -> (model, args, kwargs)``.
        budget: whole-step budget.
        solver: solver for the "with plan" search (``auto`` asked for any schedule that
            fits: :data:`FEASIBILITY_GAP`).
        optimizer: optimizer whose state counts in the budget.
        max_batch: upper end of the search.
        time_limit_s: time limit of each solve (None: the solver's default).
        outputs_held: whether the loop holds the outputs beside the loss (the logits)
            through the backward pass, as :func:`chkpt_opt.plan` takes it; False for
            ``model(**batch).loss.backward()`` and ``Trainer``.
    """
    import chkpt_opt
    from chkpt_opt.attachment.held_outputs import droppable, dropping_outputs

    keep_fits: dict[int, bool] = {}
    plan_fits: dict[int, bool] = {}
    graphs: dict[int, Any] = {}

    def graph_of(batch: int) -> Any:
        if batch not in graphs:
            model, args, kwargs = build(batch)
            graph = chkpt_opt.trace(model, args, kwargs)
            if not outputs_held and droppable(graph):
                graph = dropping_outputs(graph)
            graphs[batch] = graph
        return graphs[batch]

    def keeps(batch: int) -> bool:
        if batch not in keep_fits:
            graph = graph_of(batch)
            try:
                parsed, static, _ = chkpt_opt.activation_budget(graph, budget, optimizer=optimizer)
            except BudgetError:  # the resident memory alone exceeds the budget
                keep_fits[batch] = plan_fits[batch] = False
                proven.append(batch)
                return False
            keep_all = chkpt_opt.simulate(graph, chkpt_opt.Schedule()).peak_bytes
            keep_fits[batch] = static.step_peak_bytes(keep_all) <= parsed.total_bytes
        return keep_fits[batch]

    def plans(batch: int) -> bool:
        if batch not in plan_fits:
            if keeps(batch):
                plan_fits[batch] = True
                graphs.pop(batch, None)
            else:
                graph = graph_of(batch)
                result = chkpt_opt.solve(
                    graph,
                    budget,
                    solver=solver,
                    optimizer=optimizer,
                    time_limit_s=time_limit_s,
                    **({"gap": FEASIBILITY_GAP} if solver == "auto" else {}),
                )
                plan_fits[batch] = result.feasible
                solved.append(batch)
                if result.proves_infeasible:
                    proven.append(batch)
                graphs.pop(batch, None)  # settled: its graph is not needed again
        return plan_fits[batch]

    solved: list[int] = []
    proven: list[int] = []
    without = largest(keeps, max_batch)
    with_plan = largest(plans, max_batch, start=without)
    parsed = chkpt_opt.parse_budget(budget)
    return MaxBatch(
        budget_bytes=parsed.total_bytes,
        with_plan=with_plan,
        without_checkpointing=without,
        solver=solver,
        probes=tuple(
            (b, keep_fits[b], plan_fits.get(b, keep_fits[b] or b <= with_plan))
            for b in sorted(keep_fits)
        ),
        solved=tuple(solved),
        proven_infeasible=tuple(sorted(proven)),
    )
