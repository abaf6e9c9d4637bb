"""chkpt-opt export to per-layer targets: a lowering over the schedule's budget exits 3."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from chkpt_opt.cli import EXIT_INFEASIBLE, EXIT_OK, main
from tests.cli.conftest import run

TINY_GPT = f"{Path(__file__).parent.parent / 'cli_models.py'}:tiny_gpt"
TARGETS = ["huggingface", "torchtitan", "megatron"]
SIZE = r"[\d.]+ (?:kB|MB) \([\d.]+ (?:KiB|MiB)\)"


@pytest.fixture(scope="module")
def gpt_graph(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "gpt.json"
    assert main(["trace", TINY_GPT, "-o", str(path)]) == EXIT_OK
    return path


def solve(graph: Path, budget: str) -> Path:
    schedule = graph.with_name(f"gpt.{budget}.schedule.json")
    if not schedule.exists():
        argv = ["solve", str(graph), "--budget", budget, "--optimizer", "none", "--solver"]
        assert main([*argv, "greedy", "-o", str(schedule)]) == EXIT_OK
    return schedule


@pytest.mark.parametrize("target", TARGETS)
def test_lowering_over_the_budget_exits_3(
    gpt_graph: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    # 3 MB for the whole step: greedy finds a schedule with partial layers that fits; no
    # whole-layer choice does (every layer checkpointed peaks above the budget).
    schedule = solve(gpt_graph, "3MB")
    capsys.readouterr()
    output = tmp_path / "settings.json"
    code, out, err = run(
        capsys, "export", str(gpt_graph), str(schedule), "--target", target, "-o", str(output)
    )
    assert code == EXIT_INFEASIBLE, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert "Traceback" not in err
    assert re.search(
        rf"the {target} lowering of .* peaks at {SIZE} in forward/backward, over the {SIZE} "
        rf"the schedule was solved for by {SIZE}; raise the budget to at least {SIZE} for the "
        r"whole step \(--budget \d+B\)",
        line,
    ), line
    assert "chkpt_opt's own apply" in line, line
    assert not output.exists()  # as solve writes no schedule that misses the budget
    # The settings and the numbers are still shown, the budget among them.
    assert "(budget " in out and f"{target}: " in out


def test_lowering_within_the_budget_exits_0_and_writes(
    gpt_graph: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schedule = solve(gpt_graph, "10MB")  # above the keep-all peak
    capsys.readouterr()
    output = tmp_path / "settings.json"
    code, out, err = run(
        capsys,
        "export",
        str(gpt_graph),
        str(schedule),
        "--target",
        "huggingface",
        "-o",
        str(output),
        "--json",
    )
    assert code == EXIT_OK, err
    data = json.loads(out)
    assert data["meets_budget"] and data["lowered_peak_bytes"] <= data["budget_bytes"]
    assert json.loads(output.read_text())["settings"] == data["settings"]


def test_a_per_rank_schedule_is_lowered_on_the_rank_graph(
    gpt_graph: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The schedule file records its sharding; the lowering is checked against the rank's
    forward/backward budget on the graph without parameter gradients in time."""
    schedule = gpt_graph.with_name("gpt.rank.schedule.json")
    argv = ["solve", str(gpt_graph), "--budget", "10MB", "--world-size", "4", "--solver"]
    assert main([*argv, "greedy", "-o", str(schedule)]) == EXIT_OK
    recorded = json.loads(schedule.read_text())["sharding"]
    assert recorded["world_size"] == 4 and recorded["strategy"] == "fsdp2"
    capsys.readouterr()
    code, out, _ = run(capsys, "export", str(gpt_graph), str(schedule), "--target", "torchtitan")
    assert code == EXIT_OK, out
    from chkpt_opt import Sharding, load_graph, simulate
    from chkpt_opt.memory_model.schedule_io import load_schedule
    from chkpt_opt.step_budget.sharding import per_rank_graph

    code, out, _ = run(
        capsys, "export", str(gpt_graph), str(schedule), "--target", "torchtitan", "--json"
    )
    rank = per_rank_graph(load_graph(gpt_graph), Sharding(world_size=4))
    exact = simulate(rank, load_schedule(schedule).schedule).peak_bytes
    assert json.loads(out)["exact_peak_bytes"] == exact
