"""Scale: plan a 48-layer decoder (thousands of ATen ops) with solver="auto".

Run:  python benchmarks/decoder48.py [--flat-time-limit 120]

Traces ``zoo.gpt(n_layer=48, d_model=64, ...)`` on fake tensors, then for budgets of 90, 70,
50 and 30% of the store-everything peak: the auto solver's time (hierarchical solving over
the repeated blocks), its extra compute, and, for comparison, the flat CP-SAT solve with a
time limit where the flat model can be built (``--layers 8`` gives a decoder it solves):
its status, bound, and the gap between the two where CP-SAT proves a bound.
Writes decoder48.csv and decoder48.md to the output directory.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

from chkpt_opt import zoo
from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--flat-time-limit", type=float, default=120.0)
    parser.add_argument("--flat-solver", default="milp", help="flat exact solver to compare with")
    parser.add_argument(
        "--flat-subset",
        action="store_true",
        help="let the flat solver use its candidate subset of cuts (faster, proves nothing)",
    )
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.9, 0.7, 0.5, 0.3])
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/decoder48"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, inputs, _ = zoo.gpt(
        n_layer=args.layers, d_model=64, n_head=4, seq_len=128, batch=4, vocab=512
    )
    start = time.perf_counter()
    graph = trace_model(model, inputs, name=f"gpt{args.layers}").graph
    trace_s = time.perf_counter() - start
    keep = simulate(graph, Schedule()).peak_bytes
    rows = []
    for fraction in args.budgets:
        budget = int(keep * fraction)
        start = time.perf_counter()
        auto = get_solver("auto")(graph, budget)
        auto_s = time.perf_counter() - start
        try:
            settings = {} if args.flat_subset else {"max_positions": None}  # every allowed cut
            flat = get_solver(args.flat_solver, **settings)(
                graph, budget, time_limit_s=args.flat_time_limit
            )
        except SolverError as err:  # the flat model is refused for graphs this large
            flat = None
            print(f"flat solve refused: {err}", flush=True)
        gap = None
        if flat is not None and flat.bound is not None and auto.feasible and auto.objective > 0:
            gap = max(0.0, (auto.objective - flat.bound) / auto.objective)
        rows.append(
            {
                "ops": graph.number_of_nodes(),
                "budget_fraction": fraction,
                "auto_status": auto.status.value,
                "auto_solver": auto.stats.get("chosen", ""),
                "auto_s": round(auto_s, 1),
                "auto_overhead": round(simulate(graph, auto.schedule).overhead, 4),
                "flat_status": "refused (too large)" if flat is None else flat.status.value,
                "flat_s": "" if flat is None else round(flat.solve_s, 1),
                "flat_objective_s": round(flat.objective, 6) if flat and flat.feasible else "",
                "flat_bound_s": "" if flat is None or flat.bound is None else round(flat.bound, 6),
                "auto_objective_s": round(auto.objective, 6),
                "gap_vs_flat_bound": "" if gap is None else round(gap, 4),
            }
        )
        print(rows[-1], flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    with (args.output / "decoder48.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"{args.layers}-layer decoder, {graph.number_of_nodes()} ops, traced in {trace_s:.1f} s "
        f"(2 CPU threads)",
        "",
        f"| budget | auto | auto time (s) | extra compute | flat {args.flat_solver} "
        "| flat time (s) | gap to flat bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = "" if r["gap_vs_flat_bound"] == "" else f"{100 * r['gap_vs_flat_bound']:.2f}%"
        lines.append(
            f"| {100 * r['budget_fraction']:.0f}% | {r['auto_status']} ({r['auto_solver']}) | "
            f"{r['auto_s']} | {100 * r['auto_overhead']:.1f}% | {r['flat_status']} | "
            f"{r['flat_s']} | {gap} |"
        )
    (args.output / "decoder48.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
