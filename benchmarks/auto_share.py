"""How the general ``auto`` splits its time limit between the keep-set stages and the
searches beyond keep-set: keep-set alone (``general=False``) against the general ``auto``
keeping a share of 0.2 and of 0.1 of the limit for the searches (the default since
0.1), one after another, on Hugging Face graphs built from configs with random weights
(6 layers of width 256, batch 4 x 256 tokens; ``--graphs`` adds corpus graphs).

Run:
    python benchmarks/auto_share.py --time-limit 20 -o benchmarks/results/auto_share
Writes auto_share.csv and auto_share.md: per graph and budget (a fraction of the keep-all
peak), each variant's status, recompute time, what it chose, and its keep-set stage's
recompute time.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver
from chkpt_opt.zoo import huggingface as hf_zoo

ROOT = Path(__file__).resolve().parent.parent
VARIANTS: dict[str, dict[str, Any]] = {
    "keep-set": {"general": False},
    "share 0.2": {"general_share": 0.2},
    "share 0.1": {"general_share": 0.1},
}
FIELDS = ["graph", "ops", "fraction"] + [
    f"{label} {what}"
    for label in VARIANTS
    for what in ("status", "ms", "chosen", "keep-set stage ms", "s")
]


def hf_graph(family: str) -> CostGraph:
    model, args, _ = hf_zoo.FAMILIES[family](layers=6, width=256, batch=4, seq=256)
    return trace_model(model, args, name=family).graph


def rows_of(name: str, graph: CostGraph, fractions: list[float], limit_s: float) -> list[dict]:
    keep_all = simulate(graph, Schedule()).peak_bytes
    rows = []
    for fraction in fractions:
        row: dict[str, Any] = {"graph": name, "ops": graph.number_of_nodes(), "fraction": fraction}
        for label, options in VARIANTS.items():
            start = time.perf_counter()
            result = get_solver("auto", **options)(
                graph, int(fraction * keep_all), time_limit_s=limit_s
            )
            stage = result.stats.get("keep_set", {}).get("objective_s", result.objective)
            row |= {
                f"{label} status": result.status.value,
                f"{label} ms": f"{result.objective * 1e3:.3f}",
                f"{label} chosen": result.stats.get("chosen", ""),
                f"{label} keep-set stage ms": f"{stage * 1e3:.3f}",
                f"{label} s": f"{time.perf_counter() - start:.1f}",
            }
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--families", nargs="+", default=["llama", "gpt2", "bert"])
    parser.add_argument("--graphs", nargs="*", default=[], help="corpus graphs (graphs/*.json)")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.35, 0.6])
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks/results/auto_share")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in options.families:
        rows += rows_of(family, hf_graph(family), options.fractions, options.time_limit)
    for name in options.graphs:
        graph = load_graph(ROOT / "graphs" / f"{name}.json")
        rows += rows_of(name, graph, options.fractions, options.time_limit)
    with (options.out / "auto_share.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(FIELDS) + " |", "|" + "---|" * len(FIELDS)]
    lines += ["| " + " | ".join(str(r[k]) for k in FIELDS) + " |" for r in rows]
    (options.out / "auto_share.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
