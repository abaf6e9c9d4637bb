"""auto's time split: a keep-set stage that proves nothing ends at half of auto's limit."""

from __future__ import annotations

from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.time_split import UNPROVEN_SHARE, proves_optimum, stage_limit_s


def test_the_block_search_says_it_proves_nothing() -> None:
    assert not proves_optimum(get_solver("hierarchical"))
    assert all(proves_optimum(get_solver(name)) for name in ("pruned", "cpsat", "enumerate"))


def test_a_stage_that_proves_nothing_ends_at_its_share_of_autos_limit() -> None:
    whole = Deadline.after(20.0)
    keep_set = whole.share(0.9)
    blocks = stage_limit_s(get_solver("hierarchical"), keep_set, whole)
    exact = stage_limit_s(get_solver("cpsat"), keep_set, whole)
    assert blocks is not None and exact is not None
    assert UNPROVEN_SHARE * 20.0 - 1.0 < blocks <= UNPROVEN_SHARE * 20.0
    assert 0.9 * 20.0 - 1.0 < exact <= 0.9 * 20.0
    # with no searches after it (whole=None), or without a limit, its own deadline
    alone = stage_limit_s(get_solver("hierarchical"), keep_set, None)
    assert alone is not None and 0.9 * 20.0 - 1.0 < alone <= 0.9 * 20.0
    unlimited = Deadline.after(None)
    assert stage_limit_s(get_solver("hierarchical"), unlimited, unlimited) is None
