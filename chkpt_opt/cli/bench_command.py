"""The bench command: a resumable sweep of solvers x graphs x budgets, with its report."""

from __future__ import annotations

import argparse
from pathlib import Path

from chkpt_opt.cli.output import EXIT_INTERNAL, EXIT_OK, Progress, emit
from chkpt_opt.errors import BudgetError, GraphFormatError


def cmd_bench(args: argparse.Namespace) -> int:
    from chkpt_opt.bench.report import (
        latex_table,
        markdown_summary,
        plot_overhead_vs_budget,
        plot_solve_time,
    )
    from chkpt_opt.bench.sweep import make_tasks, run_sweep
    from chkpt_opt.graphs.io import load_graph
    from chkpt_opt.solvers import get_solver

    graphs = args.graphs or sorted(Path("graphs").glob("*.json"))
    if not graphs:
        raise GraphFormatError(
            "no cost graphs given and none in graphs/; run `chkpt-opt corpus` first."
        )
    for name in args.solvers:
        get_solver(name)  # unknown names fail before any work
    for path in graphs:
        load_graph(path)  # so do malformed graph files
    for fraction in args.budgets:
        if not 0 < fraction <= 1:
            raise BudgetError(f"budget fraction {fraction} must be in (0, 1].")
    tasks = make_tasks(graphs, args.solvers, args.budgets, time_limit_s=args.time_limit)
    out = Path(args.output)
    progress = Progress("bench", not args.json)
    outcome = run_sweep(
        tasks,
        out / "results.csv",
        workers=args.workers,
        ray_address=args.ray_address,
        progress=progress,
    )
    rows = outcome.rows
    (out / "table.tex").write_text(latex_table(rows), encoding="utf-8")
    (out / "summary.md").write_text(markdown_summary(rows), encoding="utf-8")
    figures = [
        plot_overhead_vs_budget(rows, out / "overhead_vs_budget.png"),
        plot_solve_time(rows, out / "solve_time.png"),
    ]
    invalid = [r for r in rows if r["status"] == "invalid"]
    data = {
        "rows": len(rows),
        "tasks": len(tasks),
        "csv": str(out / "results.csv"),
        "table": str(out / "table.tex"),
        "figures": [str(f) for f in figures],
        "invalid": len(invalid),
        "failed": [{"task": list(key), "error": error} for key, error in outcome.failed],
    }
    emit(
        args,
        data,
        [
            f"{len(rows)} of {len(tasks)} tasks in {out / 'results.csv'}",
            f"table: {out / 'table.tex'}",
            *[f"figure: {f}" for f in figures],
        ]
        + ([f"{len(invalid)} schedules exceed their budget in the simulator"] if invalid else [])
        + [
            f"failed (run again to retry): {'/'.join(key)}: {error}"
            for key, error in outcome.failed
        ],
    )
    return EXIT_INTERNAL if invalid or outcome.failed else EXIT_OK
