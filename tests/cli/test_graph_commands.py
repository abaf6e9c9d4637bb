"""chkpt-opt on cost-graph files: trace, solve, simulate, show; their files and exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from chkpt_opt.cli import EXIT_INFEASIBLE, EXIT_INPUT, EXIT_OK, EXIT_TRACE
from tests.cli.conftest import BUDGET, run


def test_trace_solve_simulate_show_round_trip(
    graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schedule = tmp_path / "mlp.schedule.json"
    code, out, _ = run(
        capsys,
        "solve",
        str(graph_file),
        "--budget",
        BUDGET,
        "--optimizer",
        "none",
        "-o",
        str(schedule),
        "--json",
    )
    assert code == EXIT_OK, out
    solved = json.loads(out)
    assert solved["status"] in ("optimal", "feasible")
    assert solved["predicted_peak_bytes"] <= 2_000_000
    assert solved["step_peak_bytes"] == solved["predicted_peak_bytes"]
    step_budget, resident = solved["step_budget_bytes"], solved["resident_bytes"]
    assert step_budget - resident == solved["activation_budget_bytes"]
    assert solved["regions"] > 0
    code, out, _ = run(capsys, "simulate", str(graph_file), str(schedule), "--json", "--timeline")
    assert code == EXIT_OK
    simulated = json.loads(out)
    assert simulated["peak_bytes"] == solved["peak_bytes"]
    assert max(p["during_bytes"] for p in simulated["timeline"]) == simulated["peak_bytes"]
    code, out, _ = run(capsys, "show", str(schedule))
    assert code == EXIT_OK and "regions" in out
    code, out, _ = run(capsys, "show", str(graph_file), "--json")
    assert json.loads(out)["kind"] == "graph"


def test_budget_that_cannot_be_met_exits_3(
    graph_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "solve", str(graph_file), "--budget", "400kB", "--optimizer", "none")
    assert code == EXIT_INFEASIBLE
    # both units, at the scale of the value (format_bytes)
    assert re.search(r"\d (?:kB|MB|GB) \([\d.]+ (?:KiB|MiB|GiB)\)", err), err


@pytest.mark.parametrize("budget", ["20gb", "20Gb", "20.5", "lots"])
def test_bad_budget_exits_2_with_accepted_forms(
    graph_file: Path, capsys: pytest.CaptureFixture[str], budget: str
) -> None:
    code, _, err = run(capsys, "solve", str(graph_file), "--budget", budget)
    assert code == EXIT_INPUT
    assert "GiB" in err


def test_a_plain_integer_budget_is_bytes(
    graph_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/budget.md: a plain integer is bytes; 20 bytes holds no step."""
    code, _, err = run(capsys, "solve", str(graph_file), "--budget", "20")
    assert code == EXIT_INFEASIBLE and "'20' = 20 bytes" in err, err


def test_malformed_and_mismatched_files_exit_2(
    graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truncated = tmp_path / "truncated.json"
    truncated.write_text(graph_file.read_text()[:200])
    code, _, err = run(capsys, "show", str(truncated))
    assert code == EXIT_INPUT and "truncated" in err
    # A schedule made for another model is refused by simulate.
    other = tmp_path / "other.json"
    assert run(capsys, "trace", "chkpt_opt.zoo:resnet", "-o", str(other))[0] == EXIT_OK
    schedule = tmp_path / "resnet.schedule.json"
    assert run(capsys, "solve", str(other), "--budget", "1GB", "-o", str(schedule))[0] == EXIT_OK
    code, _, err = run(capsys, "simulate", str(graph_file), str(schedule))
    assert code == EXIT_INPUT and "fingerprint" in err


def test_untraceable_or_missing_model_exits_4(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run(capsys, "trace", "no.such.module:f", "-o", str(tmp_path / "x.json"))[0] == EXIT_TRACE
    assert run(capsys, "trace", "chkpt_opt.zoo", "-o", str(tmp_path / "x.json"))[0] == EXIT_TRACE
    model_file = tmp_path / "branchy.py"
    model_file.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x * 2 if x.sum() > 0 else x - 1\n"
        "def build():\n"
        "    return M(), (torch.randn(4),)\n"
    )
    code, _, err = run(capsys, "trace", f"{model_file}:build", "-o", str(tmp_path / "x.json"))
    assert code == EXIT_TRACE
    assert "cannot be traced" in err


def test_solve_with_world_size_splits_the_budget_per_rank(
    capsys: pytest.CaptureFixture[str], graph_file: Path
) -> None:
    # what is checked is the split, not the schedule: short solves (39 s at auto's default)
    limit = ("--time-limit", "5")
    code, out, _ = run(capsys, "solve", str(graph_file), "--budget", "1MB", *limit, "--json")
    whole = json.loads(out)
    argv = ["solve", str(graph_file), "--budget", "1MB", "--world-size", "8", "--sharding"]
    code, out, _ = run(capsys, *argv, "fsdp2", *limit, "--json")
    rank = json.loads(out)
    assert code == EXIT_OK and rank["resident_bytes"] < whole["resident_bytes"]
    code, out, _ = run(capsys, *argv[:3], "5MB", *argv[4:], "ddp", *limit)
    assert "per rank of 8, ddp" in out and "gradient buckets" in out
    code, _, err = run(capsys, "solve", str(graph_file), "--budget", "1MB", "--sharding", "ddp")
    assert code == EXIT_INPUT and "--world-size" in err
