"""Solver sweeps: solvers x graphs x budgets, run in parallel, appended to a CSV that resumes.

A budget is a fraction of the graph's store-everything peak (forward and backward, as the
simulator predicts it); the solver gets that many bytes. Every schedule a solver returns
is simulated again here, so a row's peak and status are the simulator's, not the solver's
claim.

Rows are written one by one as tasks finish, each line flushed and synced; an interrupted
sweep keeps what it finished, and running it again skips the tasks already in the file.
"""

from __future__ import annotations

import csv
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chkpt_opt.errors import SweepError

log = logging.getLogger(__name__)

COLUMNS = (
    "graph",
    "family",
    "nodes",
    "keep_all_peak_bytes",
    "budget_fraction",
    "budget_bytes",
    "solver",
    "status",
    "objective_s",
    "bound_s",
    "gap",
    "peak_bytes",
    "overhead",
    "regions",
    "solve_s",
)


class SweepFileError(SweepError):
    """The results file exists but is not a sweep CSV this version can resume."""


def _probe(address: str, *, timeout_s: float = 5.0) -> None:
    """Fails fast when nothing listens at a ``host:port`` address (Ray itself retries for
    minutes); other forms (``auto``, ``ray://...``) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "/" in address or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise SweepError(
            f"cannot connect to the Ray cluster at {address!r}: nothing answers there "
            f"({err.strerror or err}). Start the cluster (`ray start --head`) or pass the "
            "address that `ray status` prints on its head node."
        ) from None


def _connect_ray(address: str) -> Any:
    try:
        import ray
    except ImportError:
        raise SweepError(
            f"--ray-address {address!r} needs Ray, which is not installed; "
            "install it with: pip install 'chkpt_opt[ray]'."
        ) from None
    _probe(address)
    try:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SweepError(
            f"cannot connect to the Ray cluster at {address!r}: {first[:300]}. Check the "
            "address (`ray status` on the head node prints it) and, if the cluster uses "
            "token authentication, that RAY_AUTH_MODE and the token match its settings."
        ) from None
    return ray


@dataclass(frozen=True)
class SweepOutcome:
    """What a sweep left in its CSV.

    Attributes:
        rows: every row of the CSV, old and new.
        failed: ``(task key, error message)`` of the tasks that raised; they are not in the
            CSV, so running the sweep again retries them.
    """

    rows: list[dict[str, str]]
    failed: list[tuple[tuple[str, str, str], str]]


@dataclass(frozen=True)
class BenchTask:
    """One solve of a sweep.

    Attributes:
        graph_path: cost graph JSON file.
        solver: registered solver name.
        budget_fraction: budget as a fraction of the store-everything peak.
        time_limit_s: solver time limit.
    """

    graph_path: str
    solver: str
    budget_fraction: float
    time_limit_s: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        """What identifies the task in the CSV: graph name, solver, budget fraction."""
        return (Path(self.graph_path).stem, self.solver, f"{self.budget_fraction:.4f}")


def make_tasks(
    graph_paths: Iterable[str | Path],
    solvers: Iterable[str],
    fractions: Iterable[float],
    *,
    time_limit_s: float | None = None,
) -> list[BenchTask]:
    """The cross product, in a stable order (graph, budget, solver)."""
    solvers, fractions = list(solvers), list(fractions)
    return [
        BenchTask(str(path), solver, fraction, time_limit_s)
        for path in sorted(map(str, graph_paths))
        for fraction in fractions
        for solver in solvers
    ]


def run_task(task: BenchTask) -> dict[str, Any]:
    """Solves one task and returns its CSV row (the schedule re-simulated)."""
    from chkpt_opt.graphs.costgraph import total_compute_s
    from chkpt_opt.graphs.io import load_graph
    from chkpt_opt.memory_model.schedule import Schedule
    from chkpt_opt.memory_model.simulate import simulate
    from chkpt_opt.solvers import get_solver

    graph = load_graph(task.graph_path)
    keep_all = simulate(graph, Schedule()).peak_bytes
    budget = int(keep_all * task.budget_fraction)
    result = get_solver(task.solver)(graph, budget, time_limit_s=task.time_limit_s)
    profile = simulate(graph, result.schedule)
    fits = profile.peak_bytes <= budget
    status = result.status.value if fits or not result.feasible else "invalid"
    base = total_compute_s(graph)
    return {
        "graph": Path(task.graph_path).stem,
        "family": graph.graph.get("family", ""),
        "nodes": graph.number_of_nodes(),
        "keep_all_peak_bytes": keep_all,
        "budget_fraction": f"{task.budget_fraction:.4f}",
        "budget_bytes": budget,
        "solver": task.solver,
        "status": status,
        "objective_s": profile.recompute_s if fits else "",
        "bound_s": "" if result.bound is None else result.bound,
        "gap": "" if result.gap is None else result.gap,
        "peak_bytes": profile.peak_bytes,
        "overhead": profile.recompute_s / base if fits and base > 0 else "",
        "regions": len(result.schedule.regions),
        "solve_s": round(result.solve_s, 4),
    }


def row_key(row: dict[str, str]) -> tuple[str, str, str]:
    """What identifies a CSV row's task: the same tuple as :attr:`BenchTask.key`."""
    return (row["graph"], row["solver"], row["budget_fraction"])


def read_rows(csv_path: str | Path) -> list[dict[str, str]]:
    """Rows of a sweep CSV; a torn last line (from an interrupted run) is dropped."""
    path = Path(csv_path)
    if not path.is_file():
        return []
    rows = []
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is not None and tuple(reader.fieldnames) != COLUMNS:
            raise SweepFileError(
                f"{path} is not a chkpt-opt bench CSV of this version (its header is "
                f"{','.join(reader.fieldnames)[:200]!r}); write the sweep to another "
                "output folder, or move that file away."
            )
        for row in reader:
            if None in row or any(row.get(c) is None for c in COLUMNS):
                continue
            rows.append(row)
    return rows


class _CsvSink:
    """Appends rows to the CSV, rewriting it first if an interrupted run left a torn line."""

    def __init__(self, path: Path, kept: list[dict[str, str]]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        staging = path.with_name(path.name + ".partial")
        with staging.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, COLUMNS)
            writer.writeheader()
            writer.writerows(kept)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)  # the kept rows are never at risk while the file is rewritten
        self.handle = path.open("a", newline="", encoding="utf-8")
        self.writer = csv.DictWriter(self.handle, COLUMNS)

    def write(self, row: dict[str, Any]) -> None:
        self.writer.writerow(row)
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()


def _execute(
    tasks: list[BenchTask], *, workers: int | None, ray_address: str | None
) -> Iterator[tuple[BenchTask, dict[str, Any] | Exception]]:
    if ray_address is not None:
        ray = _connect_ray(ray_address)
        remote = ray.remote(run_task)
        pending = {remote.remote(t): t for t in tasks}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            task = pending.pop(done[0])
            try:
                yield task, ray.get(done[0])
            except Exception as err:
                yield task, err
        return
    if workers == 1:
        for task in tasks:
            try:
                yield task, run_task(task)
            except Exception as err:
                yield task, err
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_task, t): t for t in tasks}
        for future in as_completed(futures):
            try:
                yield futures[future], future.result()
            except Exception as err:
                yield futures[future], err


def run_sweep(
    tasks: list[BenchTask],
    csv_path: str | Path,
    *,
    workers: int | None = None,
    ray_address: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SweepOutcome:
    """Runs the tasks not yet in ``csv_path`` and appends their rows.

    Args:
        tasks: the sweep.
        csv_path: results file (created, or resumed).
        workers: processes of the local pool (default: one per CPU; 1 runs in-process).
        ray_address: address of a Ray cluster to run the tasks on instead.
        progress: called with (finished, total) after each task.

    Returns:
        All rows of the CSV and the tasks that failed.

    Raises:
        SweepFileError: ``csv_path`` exists and is not a sweep CSV.
        SweepError: ``ray_address`` is given and Ray is missing or the cluster unreachable.
    """
    path = Path(csv_path)
    kept = read_rows(path)
    done = {row_key(r) for r in kept}
    pending = [t for t in tasks if t.key not in done]
    log.info(
        "sweep: %d tasks, %d already done, %d to run",
        len(tasks),
        len(tasks) - len(pending),
        len(pending),
    )
    sink = _CsvSink(path, kept)
    finished = len(tasks) - len(pending)
    failed: list[tuple[tuple[str, str, str], str]] = []
    try:
        for task, outcome in _execute(pending, workers=workers, ray_address=ray_address):
            finished += 1
            if isinstance(outcome, Exception):
                log.warning("task %s failed: %s", task.key, outcome)
                failed.append((task.key, f"{type(outcome).__name__}: {outcome}"))
            else:
                sink.write(outcome)
            if progress is not None:
                progress(finished, len(tasks))
    finally:
        sink.close()
    return SweepOutcome(read_rows(path), sorted(failed))
