"""How ``auto`` times its keep-set stages that run beside the searches beyond keep-set.

A keep-set stage either can prove its result optimal (the pruned search's exact phase) or
cannot (a block search: ``hierarchical``, and the pruned search where its program is too
large to build). One that cannot is one heuristic among others, and the cached-op searches
after it are the ones that find what it misses: on Hugging Face graphs at their layer
checkpointing's peak, with the keep-set stage at 90% of a 20 s limit, ``auto`` returned
146.30 ms of recompute on a padded Llama of 345 ops (``cached`` alone: 119.03) and 544.88
ms on a padded T5 of 632 ops (``cached`` alone: 522.65); with that stage at half the limit,
123.09 and 529.99 (docs/limits.md, "`auto`'s time limit"). So such a stage ends at
:data:`UNPROVEN_SHARE` of ``auto``'s limit.
"""

from __future__ import annotations

from chkpt_opt.solvers.base import Solver
from chkpt_opt.solvers.deadline import Deadline

UNPROVEN_SHARE = 0.5
"""The share of ``auto``'s limit at which a keep-set stage that proves nothing ends."""


def proves_optimum(solver: Solver) -> bool:
    """Whether ``solver`` may prove its result optimal over keep-set schedules (a solver
    says it cannot with a false ``proves_optimum`` attribute)."""
    return bool(getattr(solver, "proves_optimum", True))


def stage_limit_s(solver: Solver, deadline: Deadline, whole: Deadline | None) -> float | None:
    """The time limit of a keep-set stage run with ``solver`` that ends at ``deadline``
    (``whole``: ``auto``'s own deadline, where the searches beyond keep-set follow): to
    :data:`UNPROVEN_SHARE` of ``whole`` where the solver proves nothing."""
    left_s = deadline.remaining_s()
    if whole is None or proves_optimum(solver):
        return left_s
    unproven_s = whole.share(UNPROVEN_SHARE).remaining_s()
    return unproven_s if left_s is None or unproven_s is None else min(left_s, unproven_s)


def pruned_shares(
    deadline: Deadline, whole: Deadline, alone_share: float
) -> dict[str, float | bool]:
    """The pruned search's settings when it runs to ``whole`` (auto's limit): its block
    search first, for as long as it has alone (``alone_share``, its ``incumbent_share``, of
    auto's limit, counted from the pruned search's start), whether or not its exact
    program can be built in time (where it cannot, the search proves nothing: the module
    docstring); its exact phase ends at ``deadline`` (the keep-set stages')."""
    keep_s, whole_s, limit_s = deadline.remaining_s(), whole.remaining_s(), whole.limit_s
    if keep_s is None or whole_s is None or limit_s is None or whole_s <= 0.0:
        return {"blocks_first": True}
    alone = min(1.0, alone_share * limit_s / whole_s)
    return {
        "exact_share": min(1.0, keep_s / whole_s),
        "incumbent_share": alone,
        "skipped_blocks_share": alone,
        "blocks_first": True,
    }
