"""How tight the recompute bound is, and what it proves where the integer programs do not.

Run:
    python benchmarks/recompute_bound.py                       # corpus + Hugging Face graphs
    python benchmarks/recompute_bound.py --hf --time-limit 20  # HF graphs, auto beside it

For every corpus graph (``graphs/*.json``) and budget (a fraction of the keep-all peak), the
recompute bound of :mod:`chkpt_opt.solvers.bounds.recompute_bound` (its value, time and floor)
beside the proven optimum that ``auto`` reached in the corpus bench
(``benchmarks/results/bench/results.csv``, 60 s per solve); with ``--hf``, the Hugging Face
families of :mod:`chkpt_opt.zoo.huggingface` traced (6 layers of width 256, no weights
needed beyond the config) and solved by ``auto`` here with the time limit given, its status
and gap with the bound counted and without. Writes ``results.csv`` and ``summary.md`` to the
output directory.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound
from chkpt_opt.solvers.deadline import Deadline

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [
    "graph",
    "ops",
    "budget_fraction",
    "bound_s",
    "bound_solve_s",
    "bound_steps",
    "floor_fraction",
    "proves_infeasible",
    "reference",
    "reference_status",
    "reference_objective_s",
    "bound_over_objective",
    "auto_bound_without_s",
]


def corpus_optima(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    """``(graph, budget fraction) -> row`` of ``auto`` in the corpus bench results."""
    if not path.exists():
        return {}
    with path.open() as f:
        return {
            (r["graph"], f"{float(r['budget_fraction']):.2f}"): r
            for r in csv.DictReader(f)
            if r["solver"] == "auto"
        }


def hf_graphs(families: list[str]) -> dict[str, CostGraph]:
    """The Hugging Face families traced at their default sizes."""
    import torch

    from chkpt_opt.graphs.tracer import trace_model
    from chkpt_opt.zoo import huggingface

    graphs = {}
    for name in families:
        torch.manual_seed(0)
        model, args, kwargs = huggingface.FAMILIES[name]()
        graphs[f"hf_{name}"] = trace_model(model, args, kwargs, name=name).graph
        print(f"traced {name}: {graphs[f'hf_{name}'].number_of_nodes()} ops", file=sys.stderr)
    return graphs


def row_for(
    name: str, graph: CostGraph, fraction: float, limit_s: float, reference: dict[str, str] | None
) -> dict[str, Any]:
    peak = simulate(graph, Schedule()).peak_bytes
    budget = int(peak * fraction)
    bound = recompute_bound(graph, budget, deadline=Deadline.after(limit_s))
    row: dict[str, Any] = {
        "graph": name,
        "ops": graph.number_of_nodes(),
        "budget_fraction": f"{fraction:.2f}",
        "bound_s": bound.bound_s,
        "bound_solve_s": round(bound.solve_s, 3),
        "bound_steps": bound.steps,
        "floor_fraction": round(bound.floor_bytes / peak, 4),
        "proves_infeasible": bound.proves_infeasible,
    }
    if reference is not None:
        objective = reference.get("objective_s")
        row.update(
            reference="corpus bench, auto 60 s" if reference else "",
            reference_status=reference.get("status", ""),
            reference_objective_s=float(objective) if objective else None,
        )
    else:
        result = get_solver("auto")(graph, budget, time_limit_s=limit_s)
        cover = result.stats.get("recompute_bound", {}).get("bound_s")
        without = result.bound if result.bound is not None and result.bound != cover else None
        row.update(
            reference=f"auto {limit_s:g} s here",
            reference_status=result.status.value,
            reference_objective_s=result.objective if result.feasible else None,
            auto_bound_without_s=without,
        )
    objective = row.get("reference_objective_s")
    if objective and bound.bound_s is not None:
        row["bound_over_objective"] = round(bound.bound_s / objective, 4)
    return row


def summary(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| graph | ops | budget | bound s | bound time s | reference | status | objective s "
        "| bound / objective |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def fmt(x: Any) -> str:
            return "" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))

        bound = "infeasible" if r["proves_infeasible"] else fmt(r["bound_s"])
        lines.append(
            f"| {r['graph']} | {r['ops']} | {r['budget_fraction']} | {bound} "
            f"| {r['bound_solve_s']} | {r.get('reference', '')} | {r.get('reference_status', '')} "
            f"| {fmt(r.get('reference_objective_s'))} | {fmt(r.get('bound_over_objective'))} |"
        )
    optimal = [
        r["bound_over_objective"]
        for r in rows
        if r.get("reference_status") == "optimal" and r.get("bound_over_objective") is not None
    ]
    if optimal:
        lines += [
            "",
            f"Against proven optima ({len(optimal)} rows): bound / optimum from "
            f"{min(optimal):.3f} to {max(optimal):.3f}, median {statistics.median(optimal):.3f}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.9, 0.7, 0.5, 0.3])
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--no-corpus", action="store_true", help="skip the corpus graphs")
    parser.add_argument("--hf", nargs="*", default=None, help="HF families (none given: all)")
    out = ROOT / "benchmarks/results/recompute_bound"
    parser.add_argument("-o", "--out", type=Path, default=out)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    if not args.no_corpus:
        optima = corpus_optima(ROOT / "benchmarks/results/bench/results.csv")
        for path in sorted((ROOT / "graphs").glob("*.json")):
            graph = load_graph(path)
            for fraction in args.budgets:
                reference = optima.get((path.stem, f"{fraction:.2f}"), {})
                rows.append(row_for(path.stem, graph, fraction, args.time_limit, reference))
                print(rows[-1], file=sys.stderr)
    if args.hf is not None:
        from chkpt_opt.zoo import huggingface

        for name, graph in hf_graphs(args.hf or sorted(huggingface.FAMILIES)).items():
            for fraction in args.budgets:
                rows.append(row_for(name, graph, fraction, args.time_limit, None))
                print(rows[-1], file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "summary.md").write_text(summary(rows))
    print(summary(rows))


if __name__ == "__main__":
    main()
