"""The research bench: sweeps into CSV, tables and figures; resuming; Ray; the corpus."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import chkpt_opt
import chkpt_opt.solvers
from chkpt_opt import zoo
from chkpt_opt.bench.max_batch import MaxBatch, largest, max_batch_size
from chkpt_opt.bench.sweep import (
    COLUMNS,
    SweepFileError,
    make_tasks,
    read_rows,
    row_key,
    run_sweep,
)
from chkpt_opt.cli import EXIT_INPUT, EXIT_INTERNAL, EXIT_OK, main
from chkpt_opt.corpus import generate_corpus

ROOT = Path(__file__).resolve().parents[1]
SMALL_GRAPHS = [ROOT / "graphs" / "mlp_small.json", ROOT / "graphs" / "vgg_small.json"]
SOLVERS = ["keep_all", "sqrt", "greedy"]
FRACTIONS = [0.9, 0.5]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tasks() -> list:
    return make_tasks(SMALL_GRAPHS, SOLVERS, FRACTIONS)


def _csv_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_bench_writes_csv_latex_summary_and_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    argv = ["bench", *map(str, SMALL_GRAPHS), "--solvers", *SOLVERS, "--budgets", "0.9", "0.5"]
    code = main([*argv, "--workers", "2", "-o", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK, report
    assert report["rows"] == report["tasks"] == 12 and report["failed"] == []
    rows = read_rows(out / "results.csv")
    assert len(rows) == 12 and tuple(rows[0]) == COLUMNS
    for row in rows:
        assert int(row["peak_bytes"]) <= int(row["budget_bytes"]) or row["status"] == "infeasible"
        assert row["status"] != "invalid"
    keep_all = {
        r["graph"]: r
        for r in rows
        if r["solver"] == "keep_all" and r["budget_fraction"] == "0.9000"
    }
    assert all(r["status"] == "infeasible" for r in keep_all.values())  # 90% < keep-all peak
    table = (out / "table.tex").read_text(encoding="utf-8")
    assert "\\begin{tabular}" in table and "mlp\\_small" in table and "greedy" in table
    summary = (out / "summary.md").read_text(encoding="utf-8")
    assert "vgg_small" in summary
    for figure in report["figures"]:
        data = Path(figure).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    # A second run finds every task done, solves nothing and writes the same rows.
    before = _csv_lines(out / "results.csv")
    code = main([*argv, "--workers", "2", "-o", str(out), "--json"])
    assert code == EXIT_OK and json.loads(capsys.readouterr().out)["rows"] == 12
    assert _csv_lines(out / "results.csv") == before


def test_interrupted_sweep_keeps_finished_rows_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "results.csv"
    tasks = _tasks()

    def interrupt_after_three(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(tasks, path, workers=1, progress=interrupt_after_three)
    kept = _csv_lines(path)
    assert len(kept) == 1 + 3  # header and the three finished tasks, nothing torn
    # An interrupted write leaves a torn last line; it is dropped and the task runs again.
    with path.open("a", encoding="utf-8") as handle:
        handle.write("vgg_small,chain,48")
    assert len(read_rows(path)) == 3
    seen: list[int] = []
    outcome = run_sweep(tasks, path, workers=1, progress=lambda done, total: seen.append(done))
    assert seen == list(range(4, len(tasks) + 1))  # only the nine unfinished tasks ran
    assert outcome.failed == [] and len(outcome.rows) == len(tasks)
    lines = _csv_lines(path)
    assert lines[:4] == kept and len(lines) == 1 + len(tasks)
    assert not path.with_name(path.name + ".partial").exists()
    keys = [row_key(r) for r in outcome.rows]
    assert sorted(keys) == sorted(t.key for t in tasks)


def test_a_failing_task_is_reported_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = chkpt_opt.solvers.get_solver

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("solver crashed")

    def broken_sqrt(name: str) -> object:
        return crash if name == "sqrt" else real(name)

    path = tmp_path / "results.csv"
    monkeypatch.setattr(chkpt_opt.solvers, "get_solver", broken_sqrt)
    outcome = run_sweep(_tasks(), path, workers=1)
    assert len(outcome.rows) == 8
    assert [key[1] for key, _ in outcome.failed] == ["sqrt"] * 4
    assert all("RuntimeError: solver crashed" in error for _, error in outcome.failed)
    code = main(["bench", str(SMALL_GRAPHS[0]), "--solvers", "sqrt", "--workers", "1",
                 "-o", str(tmp_path / "cli"), "--json"])  # fmt: skip
    assert code == EXIT_INTERNAL  # the sweep is incomplete; scripts must see it
    monkeypatch.setattr(chkpt_opt.solvers, "get_solver", real)
    outcome = run_sweep(_tasks(), path, workers=1)
    assert outcome.failed == [] and len(outcome.rows) == 12


def test_a_foreign_results_file_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    out.mkdir()
    foreign = out / "results.csv"
    foreign.write_text("name,score\nalice,3\n", encoding="utf-8")
    with pytest.raises(SweepFileError, match="not a chkpt-opt bench CSV"):
        run_sweep(_tasks(), foreign, workers=1)
    code = main(["bench", str(SMALL_GRAPHS[0]), "--solvers", "greedy", "-o", str(out)])
    assert code == EXIT_INPUT
    assert "another output folder" in capsys.readouterr().err
    assert foreign.read_text(encoding="utf-8") == "name,score\nalice,3\n"


def test_bench_refuses_a_malformed_graph_before_solving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "chkpt_opt.costgraph", "version": 1', encoding="utf-8")
    out = tmp_path / "bench"
    code = main(["bench", str(SMALL_GRAPHS[0]), str(bad), "--solvers", "greedy", "-o", str(out)])
    assert code == EXIT_INPUT
    assert "bad.json" in capsys.readouterr().err
    assert not (out / "results.csv").exists()


def test_optimize_plots_the_predicted_and_measured_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"{Path(__file__).parent / 'cli_models.py'}:small_mlp"
    figure = tmp_path / "timeline.png"
    code = main(
        [
            "optimize",
            spec,
            "--budget",
            "2MB",
            "--plot-timeline",
            str(figure),
            "--json",
            "--time-limit",
            "10",
        ]
    )
    assert code == EXIT_OK
    assert json.loads(capsys.readouterr().out)["timeline_plot"] == str(figure)
    assert figure.read_bytes().startswith(PNG_MAGIC)


def test_corpus_regenerates_byte_identical_files(tmp_path: Path) -> None:
    names = ["mlp_small", "vgg_small", "resnet_small"]
    written = generate_corpus(tmp_path, names=names)
    assert [p.name for p in written] == [f"{n}.json" for n in names]
    for path in written:
        assert path.read_bytes() == (ROOT / "graphs" / path.name).read_bytes(), path.name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def ray_cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """A one-node Ray cluster started from its command line, as on a real cluster."""
    pytest.importorskip("ray")
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray_cli is None:
        pytest.skip("the ray command is not installed")
    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths have a length limit
    port = _free_port()
    # An isolated test cluster: no token authentication, on the head or the client.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    start = [
        ray_cli,
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
    if started.returncode != 0:
        pytest.fail(f"ray start failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_bench_runs_on_a_ray_cluster(
    ray_cluster: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    address, env = ray_cluster
    out = tmp_path / "bench"
    command = [
        sys.executable,
        "-m",
        "chkpt_opt.cli",
        "bench",
        *map(str, SMALL_GRAPHS),
        "--solvers",
        *SOLVERS,
        "--budgets",
        "0.9",
        "0.5",
        "--ray-address",
        address,
        "-o",
        str(out),
        "--json",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert done.returncode == EXIT_OK, done.stderr[-3000:]
    assert json.loads(done.stdout)["rows"] == 12
    ray_rows = {row_key(r): r for r in read_rows(out / "results.csv")}
    local = {row_key(r): r for r in run_sweep(_tasks(), tmp_path / "local.csv", workers=1).rows}
    assert ray_rows.keys() == local.keys()
    for key, row in local.items():  # the same schedules, wherever they were solved
        for column in ("status", "peak_bytes", "objective_s", "regions"):
            assert ray_rows[key][column] == row[column], (key, column)


def test_an_unreachable_ray_cluster_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray")
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    argv = ["bench", str(SMALL_GRAPHS[0]), "--solvers", "greedy", "--ray-address", address]
    code = main([*argv, "-o", str(tmp_path / "bench")])
    assert code == EXIT_INPUT
    err = capsys.readouterr().err
    assert f"cannot connect to the Ray cluster at '{address}'" in err and "Traceback" not in err


# -- the largest batch ----------------------------------------------------------------------


def _mlp(batch: int) -> tuple:
    return zoo.mlp(width=64, depth=12, batch=64 * batch)


def _fits(batch: int, budget: str) -> tuple[bool, bool]:
    """Whether keep-all and the greedy solver's schedule fit ``budget`` at ``batch``,
    asked directly (no search)."""
    model, args, kwargs = _mlp(batch)
    graph = chkpt_opt.trace(model, args, kwargs)
    parsed, static, _ = chkpt_opt.activation_budget(graph, budget, optimizer=None)
    keep = chkpt_opt.simulate(graph, chkpt_opt.Schedule()).peak_bytes
    planned = chkpt_opt.solve(graph, budget, solver="greedy", optimizer=None).feasible
    return static.step_peak_bytes(keep) <= parsed.total_bytes, planned


@pytest.mark.slow  # 45 s on a loaded 2-core machine: about 20 captures of the MLP
def test_max_batch_answers_are_the_boundaries_and_keep_all_batches_are_never_solved() -> None:
    budget = "2MB"
    result = max_batch_size(_mlp, budget, solver="greedy", optimizer=None, max_batch=32)
    assert 1 <= result.without_checkpointing < result.with_plan < 32
    keep, _ = _fits(result.without_checkpointing, budget)
    keep_next, _ = _fits(result.without_checkpointing + 1, budget)
    _, plan = _fits(result.with_plan, budget)
    _, plan_next = _fits(result.with_plan + 1, budget)
    assert keep and not keep_next and plan and not plan_next
    settled = {batch for batch, keep_fits, _ in result.probes if keep_fits}
    assert result.solved and settled.isdisjoint(result.solved)
    # doubling from the keep-all answer, then bisecting: the old search solved at every
    # probe from batch 1 on (here 1, 2, 4, 8, 16, then bisection steps)
    doublings = (result.with_plan // result.without_checkpointing).bit_length()
    assert len(result.solved) <= doublings + result.without_checkpointing.bit_length() + 1
    for batch, keep_fits, plan_fits in result.probes:
        assert plan_fits == (batch <= result.with_plan)
        assert keep_fits == (batch <= result.without_checkpointing)


@pytest.mark.parametrize("start", [1, 2, 5, 9])
def test_largest_finds_the_threshold_from_a_start_that_fits(start: int) -> None:
    for threshold in range(start if start > 1 else 0, 40):
        asked: list[int] = []

        def fits(n: int, threshold: int = threshold, asked: list[int] = asked) -> bool:
            asked.append(n)
            return n <= threshold

        assert largest(fits, 30, start=start) == min(threshold, 30)
        assert all(start <= n <= 30 for n in asked)
        assert len(asked) == len(set(asked))


@pytest.mark.parametrize(("solver", "settings"), [("auto", {"gap": 0.99}), ("greedy", {})])
def test_max_batch_asks_auto_for_any_schedule_that_fits(
    solver: str, settings: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Measured on a 4-layer Llama (seq 512, 150 MB): the same answer (5) in 71 s instead of
    # 246 s; auto returns its first fitting rounding instead of searching for a proof.
    asked: list[dict[str, object]] = []
    solve = chkpt_opt.solve

    def recorded(*args: object, **kwargs: object) -> object:
        asked.append({k: v for k, v in kwargs.items() if k == "gap"})
        return solve(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(chkpt_opt, "solve", recorded)
    result = max_batch_size(_mlp, "1MB", solver=solver, optimizer=None, max_batch=8)
    assert result.solved and asked == [settings] * len(result.solved)


def test_the_next_batch_is_the_smallest_asked_above_the_answer() -> None:
    probes = ((1, True, True), (2, False, True), (4, False, False), (3, False, False))
    result = MaxBatch(100, 2, 1, "auto", probes, solved=(2, 3, 4), proven_infeasible=(4,))
    assert result.next_batch == (3, False)
    proven = MaxBatch(100, 2, 1, "auto", probes, solved=(2, 3, 4), proven_infeasible=(3, 4))
    assert proven.next_batch == (3, True)
    assert MaxBatch(100, 4, 1, "auto", probes).next_batch is None


def test_a_batch_whose_resident_memory_is_over_the_budget_is_proven_not_to_fit() -> None:
    def wider(batch: int) -> tuple:  # parameters growing with the batch: 69 kB at 1
        return zoo.mlp(width=64 * batch, depth=4, batch=8)

    result = max_batch_size(wider, "200kB", solver="greedy", optimizer=None, max_batch=8)
    assert result.with_plan == 1 and not result.solved  # batch 2: never solved
    assert result.next_batch == (2, True)


class _Head(torch.nn.Module):
    """A linear layer and a wide head, returning the loss beside the logits (as a Hugging
    Face model does)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 512)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.body(x)))
        return {"loss": logits.mean(), "logits": logits}


def test_max_batch_plans_for_a_loop_that_drops_the_logits_where_told() -> None:
    torch.manual_seed(0)

    def build(batch: int) -> tuple:
        return _Head(), (torch.randn(64 * batch, 32),), {}

    kwargs = {"solver": "greedy", "optimizer": None, "max_batch": 16}
    held = max_batch_size(build, "1MB", **kwargs)
    dropped = max_batch_size(build, "1MB", outputs_held=False, **kwargs)
    assert held.without_checkpointing < dropped.without_checkpointing
