"""chkpt-opt on a model spec: optimize, validate (eager and compiled), max-batch."""

from __future__ import annotations

import json

import pytest

from chkpt_opt.cli import EXIT_INPUT, EXIT_OK
from chkpt_opt.cli.parser import build_parser
from tests.cli.conftest import BUDGET, SPEC, run


def test_optimize_validates_within_budget(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "optimize",
        SPEC,
        "--budget",
        BUDGET,
        "--optimizer",
        "none",
        "--validate",
        "--json",
        "--time-limit",
        "10",
    )
    assert code == EXIT_OK
    data = json.loads(out)
    assert data["within_budget"] and data["grads_bitwise_equal"]
    assert abs(data["prediction_error"]) <= 0.03


def test_validate_compile_measures_the_compiled_step(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "validate",
        SPEC,
        "--budget",
        BUDGET,
        "--optimizer",
        "none",
        "--compile",
        "--json",
        "--time-limit",
        "10",
    )
    data = json.loads(out)
    compiled = data["compiled"]
    assert compiled["compiled_saved_bytes"] is not None
    assert compiled["notes"] and "saves" in compiled["notes"][0]
    assert data["passed"] == (data["within_budget"] and compiled["meets_budget"])
    assert code == (EXIT_OK if data["passed"] else 1)


def test_validate_compile_refuses_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys, "validate", SPEC, "--budget", BUDGET, "--compile", "--device", "cpu:0"
    )
    assert code == EXIT_INPUT
    assert "--compile measures with the CPU allocator" in err


@pytest.mark.slow  # 18-26 s: CI keeps to 15 min
def test_max_batch_with_a_plan_is_larger(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "max-batch",
        SPEC,
        "--budget",
        BUDGET,
        "--optimizer",
        "none",
        "--solver",
        "greedy",
        "--max-batch",
        "2048",
        "--json",
    )
    assert code == EXIT_OK
    data = json.loads(out)
    assert data["with_plan"] > data["without_checkpointing"] >= 1
    fits = {batch: (keep, planned) for batch, keep, planned in data["probes"]}
    assert fits[data["with_plan"]][1] and fits[data["without_checkpointing"]][0]


@pytest.mark.parametrize(
    ("flag", "value"), [((), None), (("--profile-times",), True), (("--no-profile-times",), False)]
)
def test_validate_profile_times_defaults_to_the_device(flag: tuple[str, ...], value: bool) -> None:
    """No flag leaves the choice to ``plan`` (measured op times wherever the model's
    tensors are real); either flag forces it."""
    options = build_parser().parse_args(["validate", SPEC, "--budget", BUDGET, *flag])
    assert options.profile_times is value


def test_optimize_refuses_to_validate_a_per_rank_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("optimize", SPEC, "--budget", BUDGET, "--world-size", "2", "--validate")
    code, _, err = run(capsys, *argv)
    assert code == EXIT_INPUT and "--world-size" in err


def test_a_plain_integer_budget_is_bytes() -> None:
    """docs/budget.md: a plain integer is bytes, on the command line too."""
    options = build_parser().parse_args(["max-batch", SPEC, "--budget", "55890184"])
    assert options.budget == 55890184
    options = build_parser().parse_args(["optimize", SPEC, "--budget", "2MB"])
    assert options.budget == "2MB"  # read by parse_budget, as before


def test_max_batch_takes_a_budget_in_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("max-batch", SPEC, "--budget", "2000000", "--optimizer", "none", "--solver")
    code, out, _ = run(capsys, *argv, "greedy", "--max-batch", "64", "--json")
    assert code == EXIT_OK and json.loads(out)["budget_bytes"] == 2_000_000


def test_max_batch_says_whether_the_next_batch_is_proven_not_to_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("max-batch", SPEC, "--budget", "400000", "--optimizer", "none", "--solver")
    code, out, _ = run(capsys, *argv, "greedy", "--max-batch", "64", "--time-limit", "5")
    batch = int(out.split("plan ")[1].split()[0])  # 1 (keep-all), 2 does not fit
    # greedy proves nothing: the batch above is one it found no schedule for
    assert code == EXIT_OK and f"batch {batch + 1}: no schedule found in 5 s" in out, out
    assert "not proven that none fits" in out
