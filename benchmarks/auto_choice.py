"""Flat CP-SAT against the pruned every-cut solver on mid-sized corpus graphs, at one limit.

Run:
    python benchmarks/auto_choice.py --time-limit 8

``auto`` sends a graph to one keep-set exact solver
(:func:`chkpt_opt.solvers.keepset.choice.pick_exact`): flat CP-SAT over every cut, or the
pruned every-cut MILP above
:data:`~chkpt_opt.solvers.keepset.choice.PRUNED_MIN_POSITIONS` cuts. This runs both, one after the
other, on corpus graphs on either side of that threshold at budgets of 0.9 and 0.7 of the
keep-all peak, and records each one's wall time, status and recompute. Writes
``auto_choice.csv`` and ``auto_choice.md`` to the output directory.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chkpt_opt.graphs.io import load_graph  # noqa: E402
from chkpt_opt.memory_model.schedule import Schedule, cut_positions  # noqa: E402
from chkpt_opt.memory_model.simulate import simulate  # noqa: E402
from chkpt_opt.solvers import get_solver  # noqa: E402

GRAPHS = ("encoder_small", "vit_small", "unet_large", "resnet_large", "gpt_small")
FRACTIONS = (0.9, 0.7)
SOLVERS = ("cpsat", "pruned")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=8.0, help="seconds per solve")
    parser.add_argument(
        "-o", "--output", type=Path, default=ROOT / "benchmarks/results/auto_choice"
    )
    options = parser.parse_args()
    rows = []
    for name in GRAPHS:
        graph = load_graph(ROOT / "graphs" / f"{name}.json")
        keep_all = simulate(graph, Schedule()).peak_bytes
        cuts = sum(cut_positions(graph)) - 2
        for fraction in FRACTIONS:
            budget = int(fraction * keep_all)
            for solver in SOLVERS:
                start = time.perf_counter()
                result = get_solver(solver)(graph, budget, time_limit_s=options.time_limit)
                rows.append(
                    {
                        "graph": name,
                        "cuts": cuts,
                        "fraction": fraction,
                        "solver": solver,
                        "wall_s": round(time.perf_counter() - start, 1),
                        "status": result.status.value,
                        "recompute_ms": round(result.objective * 1e3, 3),
                    }
                )
                print(rows[-1], flush=True)
    options.output.mkdir(parents=True, exist_ok=True)
    with (options.output / "auto_choice.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"`python benchmarks/auto_choice.py --time-limit {options.time_limit:g}`",
        "",
        "| graph | cuts | budget | cpsat | pruned |",
        "|---|---|---|---|---|",
    ]
    for i in range(0, len(rows), len(SOLVERS)):
        flat, pruned = rows[i], rows[i + 1]
        cell = "{status} {recompute_ms} ms in {wall_s} s"
        lines.append(
            f"| {flat['graph']} | {flat['cuts']} | {flat['fraction']} | "
            f"{cell.format(**flat)} | {cell.format(**pruned)} |"
        )
    (options.output / "auto_choice.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
