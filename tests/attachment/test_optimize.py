"""``chkpt_opt.optimize`` and ``attachment_of`` on a small network: a budget no schedule
meets for the example inputs is refused at ``optimize``; the summary lists each plan once
with the shapes it served; the gap and the stall reach the solver."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import chkpt_opt
from chkpt_opt.attachment import OPTIMIZE_GAP, OPTIMIZE_STALL_S
from chkpt_opt.attachment.held_batches import held_batch_bytes
from chkpt_opt.errors import InfeasibleBudgetError, SolverError

WIDTH, LAYERS = 64, 6


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    )


def test_an_infeasible_budget_is_refused_at_optimize_with_example_inputs() -> None:
    net = _net()
    x = torch.randn(256, WIDTH)
    keep_all = chkpt_opt.plan(
        net, (x,), budget=10**12, optimizer=None, solver="keep_all", profile_times=False
    )
    # far below any schedule's peak, above what lives through the step: the parameters,
    # the inputs and the tensors in this process that look like other batches (.held_batches:
    # other tests' 2-d float tensors of 256 rows, where they run in this worker)
    held = held_batch_bytes(net, ((x,), {}))
    budget = keep_all.static.resident_bytes + held + 1000
    with pytest.raises(InfeasibleBudgetError) as info:
        chkpt_opt.optimize(net, (x,), budget=budget, optimizer=None, profile_times=False)
    assert info.value.min_feasible_bytes is not None and info.value.min_feasible_bytes > budget
    # Refused at optimize, the model is left as it was: its own forward, no plan.
    assert chkpt_opt.attachment_of(net) is None and "forward" not in net.__dict__
    net(x).sum().backward()


def test_the_summary_lists_each_plan_once_with_the_shapes_it_served() -> None:
    net = _net()
    chkpt_opt.optimize(net, budget=10**12, optimizer=None, profile_times=False)
    for batch in (32, 32, 24, 16, 8):
        net.zero_grad(set_to_none=True)  # a step per batch (no gradients held across)
        net(torch.randn(batch, WIDTH)).sum().backward()
    attachment = chkpt_opt.attachment_of(net)
    assert isinstance(attachment, chkpt_opt.attachment.Attachment)
    stats = attachment.stats
    assert (stats.captures, stats.solves) == (1, 1)
    (runner,) = attachment.runners  # one symbolic capture serves the four shapes
    assert runner.input_dims is not None
    lines = attachment.summary().splitlines()
    assert lines[0].startswith("1 plan(s) kept; 5 training calls, 1 captures, 1 solves")
    assert len(lines) == 2 and lines[1].startswith("plan 1 (solved, symbolic sizes")
    for batch in (32, 24, 16, 8):
        assert f"[{batch}, {WIDTH}]" in lines[1]


def test_the_gap_and_the_stall_reach_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimize``'s gap and stall: 5% and 10 s for ``auto`` by default, the caller's where
    given, none for a solver that takes none (and a clear error where one is given to it)."""
    import chkpt_opt.api

    seen: list[tuple[str, dict[str, object]]] = []
    real = chkpt_opt.api.get_solver

    def spy(name: str, **settings: object) -> object:
        seen.append((name, settings))
        return real(name, **settings)

    monkeypatch.setattr(chkpt_opt.api, "get_solver", spy)
    x = torch.randn(8, WIDTH)
    for settings, expected in (
        ({}, ("auto", {"gap": OPTIMIZE_GAP, "stall_s": OPTIMIZE_STALL_S})),
        ({"gap": 0.2}, ("auto", {"gap": 0.2, "stall_s": OPTIMIZE_STALL_S})),
        ({"stall_s": 3.0}, ("auto", {"gap": OPTIMIZE_GAP, "stall_s": 3.0})),
        ({"solver": "greedy"}, ("greedy", {})),
    ):
        seen.clear()
        chkpt_opt.optimize(
            _net(), (x,), budget=10**12, optimizer=None, profile_times=False, **settings
        )
        assert seen == [expected]
    with pytest.raises(SolverError, match="gap"):
        chkpt_opt.optimize(_net(), (x,), budget=10**12, optimizer=None, solver="greedy", gap=0.1)
