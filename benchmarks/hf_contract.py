"""``auto`` against the keep-set solvers alone on Hugging Face graphs, at one time limit.

Run:
    python benchmarks/hf_contract.py --time-limit 20

On the padded graphs of ``tests/data/hf_padded`` (``python benchmarks/hf_graphs.py``: op
times measured, the budget the peak of HF's own checkpointing), each solver runs alone at
the same budget and limit, one after another: status, recompute, peak, wall time. What
``tests/solvers/test_auto_contract.py`` holds at 40 s, shown at any limit. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from chkpt_opt.graphs.io import load_graph
from chkpt_opt.solvers import get_solver

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_padded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--families", nargs="+", default=["bert", "llama"])
    parser.add_argument("--solvers", nargs="+", default=["auto", "hierarchical", "pruned"])
    options = parser.parse_args()
    budgets = json.loads((DATA / "budgets.json").read_text())
    print("| family | solver | status | recompute ms | peak MiB | budget MiB | wall s |")
    print("|---|---|---|---|---|---|---|")
    for family in options.families:
        graph = load_graph(DATA / f"{family}.json")
        budget = budgets[family]
        for name in options.solvers:
            start = time.perf_counter()
            result = get_solver(name)(graph, budget, time_limit_s=options.time_limit)
            recompute = f"{result.objective * 1e3:.3f}" if result.feasible else "-"
            print(
                f"| {family} | {name} | {result.status.value} | {recompute} | "
                f"{result.peak_bytes / 2**20:.2f} | {budget / 2**20:.2f} | "
                f"{time.perf_counter() - start:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
