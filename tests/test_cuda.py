"""CUDA validation (skipped without a CUDA device; run by benchmarks/cuda_validate.sh)."""

from __future__ import annotations

import pytest

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.bench.max_batch import max_batch_size

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_plan_meets_budget_and_prediction_on_cuda(name: str) -> None:
    model, args, kwargs = zoo.on_device(getattr(zoo, name)(), "cuda")
    full = chkpt_opt.plan(model, args, budget=10**15, optimizer="adamw")
    budget = (
        full.static.resident_bytes
        + full.static.optimizer_phase_bytes
        + full.profile.peak_bytes // 2
    )
    plan = chkpt_opt.plan(model, args, budget=budget, optimizer="adamw", time_limit_s=20)
    assert plan.graph.graph["cost_model"] == "measured-cuda"  # profile_times's default there
    report = chkpt_opt.validate(
        model, plan.apply(), args, kwargs, predicted_peak_bytes=plan.profile.peak_bytes, repeats=5
    )
    assert report.device == "cuda"
    assert plan.static.resident_bytes + report.measured_peak_bytes <= budget
    assert abs(report.prediction_error) <= 0.05, report.summary()
    assert report.grads_bitwise_equal or report.max_grad_rel_diff <= 1e-6, report.summary()
    print(f"{name}: {report.summary()}")


def test_optimal_plan_admits_a_larger_batch_on_cuda() -> None:
    def build(batch: int):
        return zoo.on_device(zoo.gpt(batch=batch), "cuda")

    result = max_batch_size(build, "1GB", optimizer="adamw", max_batch=64, time_limit_s=5)
    print(
        f"max batch under 1 GB: {result.without_checkpointing} without, "
        f"{result.with_plan} with a plan"
    )
    assert result.with_plan > result.without_checkpointing >= 1
