"""validate(): what it reports about gradients and time, on small models."""

from __future__ import annotations

import torch
from torch import nn

import chkpt_opt
from chkpt_opt.validation import _compare_grads


def test_a_gradient_on_one_side_only_is_named_not_a_zero_difference() -> None:
    g = torch.ones(3)
    bitwise, max_rel, missing = _compare_grads({"w": g, "b": g}, {"w": g.clone(), "b": None})
    assert not bitwise and missing == ("b",) and max_rel == 0.0


def test_nan_where_the_original_is_finite_is_a_nan_difference() -> None:
    g = torch.ones(3)
    h = torch.tensor([1.0, float("nan"), 1.0])
    bitwise, max_rel, _ = _compare_grads({"w": g}, {"w": h})
    assert not bitwise and max_rel != max_rel  # NaN


def test_equal_gradients_and_a_relative_difference() -> None:
    g = torch.tensor([2.0, 4.0])
    assert _compare_grads({"w": g}, {"w": g.clone()}) == (True, 0.0, ())
    bitwise, max_rel, _ = _compare_grads({"w": g}, {"w": torch.tensor([2.0, 4.4])})
    assert not bitwise and abs(max_rel - 0.1) < 1e-6


def test_report_times_alternating_rounds_with_their_spread() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(32, 64)
    plan = chkpt_opt.plan(
        model, (x,), budget=10**9, optimizer=None, solver="keep_all", profile_times=False
    )
    optimized = plan.apply()
    report = chkpt_opt.validate(model, optimized, (x,), repeats=5)
    assert report.time_rounds == 5
    assert report.step_time_ratio > 0 and report.step_time_ratio_spread >= 0
    assert report.grads_bitwise_equal and not report.grads_missing
    text = report.summary()
    assert "over 5 rounds" in text and "e-0" not in text
