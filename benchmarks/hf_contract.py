"""``auto`` against the keep-set solvers alone, at several time limits.

Run:
    python benchmarks/hf_contract.py --time-limits 10 20 40 \\
        --corpus gpt_small resnet_large unet_large -o benchmarks/results/hf_contract

On the padded graphs of ``tests/data/hf_padded`` (``python benchmarks/hf_graphs.py``: op
times measured, the budget the peak of HF's own checkpointing), and on the corpus graphs
named by ``--corpus`` (``graphs/``) at ``--fractions`` of their keep-all peaks, each solver
runs alone at the same budget and limit, one after another (auto first, then the others,
then the next case: the machine's load falls on all of them alike): status, recompute,
peak, wall time. A case holds auto's contract where no solver alone recomputes less while
fitting (what ``tests/solvers/test_auto_contract.py`` holds on the padded graphs at 20 s).
Prints a markdown table; with ``-o``, writes ``hf_contract.md`` (the command and commit in
its header) and ``hf_contract.csv`` there.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveResult, get_solver

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "hf_padded"
REL = 1e-6
"""Relative margin below which two recompute times are a tie."""
FIELDS = [
    "graph",
    "budget",
    "limit_s",
    "solver",
    "status",
    "recompute_ms",
    "peak_mib",
    "budget_mib",
    "wall_s",
    "contract",
]


def cases(options: argparse.Namespace) -> list[tuple[str, str, CostGraph, int]]:
    """``(graph name, budget label, graph, budget bytes)`` of every case."""
    out = []
    budgets = json.loads((DATA / "budgets.json").read_text())
    for family in options.families:
        out.append((family, "HF ckpt peak", load_graph(DATA / f"{family}.json"), budgets[family]))
    for name in options.corpus:
        graph = load_graph(ROOT / "graphs" / f"{name}.json")
        peak = simulate(graph, Schedule()).peak_bytes
        for fraction in options.fractions:
            out.append((name, f"{fraction:g} of keep-all", graph, int(fraction * peak)))
    return out


def beaten_by(auto: SolveResult, others: dict[str, SolveResult]) -> list[str]:
    """The solvers alone that beat ``auto`` (cheaper while fitting; nothing fitting, a lower
    peak), each with its margin."""
    beaten = []
    for name, alone in others.items():
        if alone.feasible and (
            not auto.feasible or auto.objective > alone.objective * (1 + REL) + 1e-15
        ):
            extra = (auto.objective / alone.objective - 1) * 100 if auto.feasible else None
            beaten.append(f"{name} ({extra:+.1f}%)" if extra is not None else f"{name} (fits)")
        elif not alone.feasible and not auto.feasible and alone.peak_bytes < auto.peak_bytes:
            beaten.append(f"{name} (lower peak)")
    return beaten


def run_case(
    graph: CostGraph, budget: int, limit_s: float, solvers: list[str]
) -> list[tuple[str, SolveResult, float]]:
    """Every solver alone on the case, in order: ``(name, result, wall seconds)``."""
    out = []
    for name in solvers:
        start = time.perf_counter()
        result = get_solver(name)(graph, budget, time_limit_s=limit_s)
        out.append((name, result, time.perf_counter() - start))
    return out


def rows_of(
    name: str, label: str, budget: int, limit_s: float, runs: list[tuple[str, SolveResult, float]]
) -> list[dict[str, Any]]:
    """One row per solver; the contract's verdict on auto's row."""
    results = {solver: result for solver, result, _ in runs}
    others = {solver: result for solver, result in results.items() if solver != "auto"}
    rows = []
    for solver, result, wall_s in runs:
        contract = ""
        if solver == "auto":
            beaten = beaten_by(result, others)
            contract = "holds" if not beaten else "broken: " + ", ".join(beaten)
        rows.append(
            {
                "graph": name,
                "budget": label,
                "limit_s": f"{limit_s:g}",
                "solver": solver,
                "status": result.status.value,
                "recompute_ms": f"{result.objective * 1e3:.3f}" if result.feasible else "-",
                "peak_mib": f"{result.peak_bytes / 2**20:.2f}",
                "budget_mib": f"{budget / 2**20:.2f}",
                "wall_s": f"{wall_s:.1f}",
                "contract": contract,
            }
        )
    return rows


def _line(row: dict[str, Any]) -> str:
    return "| " + " | ".join(str(row[f]) for f in FIELDS) + " |"


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, help="one limit (same as --time-limits T)")
    parser.add_argument("--time-limits", type=float, nargs="+", default=[20.0])
    parser.add_argument("--families", nargs="*", default=["bert", "llama"])
    parser.add_argument("--corpus", nargs="*", default=[], help="corpus graphs (graphs/)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.7, 0.5])
    parser.add_argument(
        "--solvers", nargs="+", default=["auto", "hierarchical", "pruned", "greedy"]
    )
    parser.add_argument("-o", "--out", type=Path, help="folder for hf_contract.md and .csv")
    options = parser.parse_args()
    limits = [options.time_limit] if options.time_limit is not None else options.time_limits
    command = "python benchmarks/hf_contract.py " + " ".join(sys.argv[1:])
    commit = _commit()  # what runs, whatever is committed meanwhile
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    print("| " + " | ".join(FIELDS) + " |")
    print("|" + "---|" * len(FIELDS))
    for name, label, graph, budget in cases(options):
        for limit_s in limits:
            runs = run_case(graph, budget, limit_s, options.solvers)
            for row in rows_of(name, label, budget, limit_s, runs):
                rows.append(row)
                print(_line(row), flush=True)
    load_after = os.getloadavg()[0]
    if options.out is None:
        return
    options.out.mkdir(parents=True, exist_ok=True)
    with open(options.out / "hf_contract.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    autos = [r for r in rows if r["solver"] == "auto"]
    held = sum(r["contract"] == "holds" for r in autos)
    lines = [
        f"Command: `{command}` at {commit}, CPU, {os.cpu_count()} cores shared with other "
        f"jobs (1-minute load {load_before:.1f} at the start, {load_after:.1f} at the end).",
        "",
        f"auto's contract held in {held} of {len(autos)} cases (a case: graph, budget, limit; "
        "auto against each solver alone, run right after it).",
        "",
        "| " + " | ".join(FIELDS) + " |",
        "|" + "---|" * len(FIELDS),
        *(_line(row) for row in rows),
    ]
    (options.out / "hf_contract.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
