"""dp_nested's sets of cuts (solvers/nested/cut_stages.py)."""

from __future__ import annotations

from chkpt_opt.solvers.nested.cut_stages import cut_stages


def test_coarse_stages_cover_every_phase_fewest_cuts_first_and_climb_over_phase_zero() -> None:
    allowed = [0, 1, 2, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 19, 20, 21, 22]
    n = 22
    stages, primary = cut_stages(allowed, n, (4, 8), phases=True)
    assert stages[-1] == allowed and primary[-1] == allowed
    # count 4: stride 6, so strides 5 and 6 at every phase; count 8: stride 3, so 2 and 3.
    expected = []
    for step in (5, 6, 2, 3):
        for phase in range(step):
            cuts = sorted({0, *allowed[phase::step], n})
            if cuts not in expected:
                expected.append(cuts)
    # Fewest cuts first, ties in the order of strides and phases (a set's solve grows
    # steeply with its cuts).
    assert stages[:-1] == sorted(expected, key=len)
    assert [len(c) for c in stages] == sorted(len(c) for c in stages)
    assert all(cuts[0] == 0 and cuts[-1] == n and set(cuts) <= set(allowed) for cuts in stages)
    # Without phases, and for the lowest-peak climb: phase 0 of each count's stride.
    plain, plain_primary = cut_stages(allowed, n, (4, 8), phases=False)
    assert plain == plain_primary == primary
    assert primary[:-1] == [sorted({*allowed[::6], n}), sorted({*allowed[::3], n})]
