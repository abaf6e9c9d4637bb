"""One level of regions with cached ops against keep-set, on the corpus, in one run.

Per corpus graph (``graphs/*.json``, up to ``--max-ops`` ops) and budget (fractions of the
keep-all peak): the keep-set optimum (``milp``), the exact solver over cached ops
(``milp_cached``, ranked columns: optimal over one-level schedules whose regions cache a
prefix of their cacheable ops ranked by recompute saved per byte), and the two
heuristics that cache ops (``cache_rounding``, the recompute bound's LP rounded; ``cached``,
the local search from the keep-set optimum), each with its objective, status and solve
time; and per graph the smallest peak of each exact space with its proof. Writes
``cached_space.csv`` and ``cached_space.md`` to the output directory.

Usage::

    python benchmarks/cached_space.py --time-limit 30 --max-ops 60
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
from chkpt_opt.memory_model.schedule import Schedule  # noqa: E402
from chkpt_opt.memory_model.simulate import simulate  # noqa: E402
from chkpt_opt.solvers import SolveResult, get_solver  # noqa: E402
from chkpt_opt.solvers.cached.cache_rounding import cache_rounding  # noqa: E402
from chkpt_opt.solvers.deadline import Deadline  # noqa: E402

BUDGETS = (0.9, 0.7, 0.5, 0.3)


def _cells(name: str, result: SolveResult, solve_s: float) -> dict:
    return {
        f"{name}_status": result.status.value,
        f"{name}_recompute_ms": round(result.objective * 1e3, 4) if result.feasible else None,
        f"{name}_cached_ops": len(result.schedule.saved),
        f"{name}_solve_s": round(solve_s, 2),
    }


def solve_all(graph, budget: int, time_limit_s: float) -> dict:
    """The four results at one budget, each timed, as table cells."""
    row: dict = {}
    start = time.perf_counter()
    keep = get_solver("milp")(graph, budget, time_limit_s=time_limit_s)
    row.update(_cells("keep_set", keep, time.perf_counter() - start))
    start = time.perf_counter()
    exact = get_solver("milp_cached")(graph, budget, time_limit_s=time_limit_s)
    row.update(_cells("milp_cached", exact, time.perf_counter() - start))
    start = time.perf_counter()
    rounded = cache_rounding(graph, budget, deadline=Deadline.after(time_limit_s))
    row.update(_cells("cache_rounding", rounded, time.perf_counter() - start))
    start = time.perf_counter()
    search = get_solver("cached", warm_start=keep.schedule)
    row.update(
        _cells(
            "cached_search",
            search(graph, budget, time_limit_s=time_limit_s),
            time.perf_counter() - start,
        )
    )
    return row


def graph_rows(path: Path, time_limit_s: float) -> list[dict]:
    graph = load_graph(path)
    keep_all = simulate(graph, Schedule()).peak_bytes
    floors = {}
    for name in ("milp", "milp_cached"):
        lowest = get_solver(name)(graph, 0, time_limit_s=time_limit_s)
        floors[name] = (
            lowest.stats.get("min_feasible_bytes", lowest.peak_bytes) / keep_all,
            bool(lowest.stats.get("min_feasible_proven")),
        )
    rows = []
    for fraction in BUDGETS:
        budget = int(keep_all * fraction)
        row = {"graph": path.stem, "ops": graph.number_of_nodes(), "fraction": fraction}
        row.update(solve_all(graph, budget, time_limit_s))
        for name, key in (("milp", "keep_set"), ("milp_cached", "milp_cached")):
            row[f"{key}_smallest_peak_fraction"] = round(floors[name][0], 4)
            row[f"{key}_smallest_peak_proven"] = floors[name][1]
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    def cell(row: dict, name: str) -> str:
        ms = row[f"{name}_recompute_ms"]
        if ms is None:
            return "-"
        mark = "*" if row[f"{name}_status"] == "optimal" else ""
        cached = row[f"{name}_cached_ops"]
        return f"{ms:g}{mark} ({cached})" if cached else f"{ms:g}{mark}"

    lines = [
        "| graph | ops | budget | keep-set optimum | milp_cached | cache_rounding | cached search "
        "| smallest peak keep-set / cached |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        floors = " / ".join(
            f"{row[f'{k}_smallest_peak_fraction']:.3f}"
            + ("*" if row[f"{k}_smallest_peak_proven"] else "")
            for k in ("keep_set", "milp_cached")
        )
        lines.append(
            f"| {row['graph']} | {row['ops']} | {row['fraction']:.0%} | {cell(row, 'keep_set')} "
            f"| {cell(row, 'milp_cached')} | {cell(row, 'cache_rounding')} "
            f"| {cell(row, 'cached_search')} | {floors} |"
        )
    lines.append("")
    lines.append(
        "Recompute in ms (`*`: proven optimal in its space; in parentheses: cached ops; "
        "`-`: nothing fits). Smallest peaks as fractions of the keep-all peak (`*`: proven)."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--max-ops", type=int, default=60)
    parser.add_argument("-o", type=Path, default=ROOT / "benchmarks/results/cached_space")
    args = parser.parse_args()
    args.o.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for path in sorted((ROOT / "graphs").glob("*.json")):
        if load_graph(path).number_of_nodes() <= args.max_ops:
            rows += graph_rows(path, args.time_limit)
    with open(args.o / "cached_space.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    command = " ".join(["python", "benchmarks/cached_space.py", *sys.argv[1:]])
    (args.o / "cached_space.md").write_text(f"`{command}`\n\n" + markdown(rows))


if __name__ == "__main__":
    main()
