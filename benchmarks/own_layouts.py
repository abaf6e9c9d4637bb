"""The layouts of a model's own checkpointing against ``auto`` at their peaks, in one cost
model: does chkpt_opt's plan recompute less than what the user would run instead?

Run:
    python benchmarks/own_layouts.py --time-limit 20 -o benchmarks/results/own_layouts

For each Hugging Face family (:mod:`chkpt_opt.zoo.huggingface` at its default sizes, as
``hf_models.py`` builds them: from its config with random weights, 6 layers of width 256,
batch 4 x 256 tokens, ViT 4 images of 224²; roofline op costs, so the run is deterministic
but for the time limit) and each of its own layouts
(:func:`chkpt_opt.own_layouts.own_layouts`: a region per layer, as
``gradient_checkpointing_enable()``; those regions caching their matmuls, as selective
activation checkpointing), at that layout's simulated peak:

* the layout's recompute time (the simulator's);
* the cached-op rounding's (:mod:`chkpt_opt.solvers.cached.cache_rounding`), and its time;
* ``auto``'s within the time limit, its status, the solver it chose, and what its keep-set
  stage found (``stats["keep_set"]``: what keep-set schedules alone reach);
* ``auto`` over the layout (at most 1: chkpt_opt recomputes no more than the layout).

Nothing runs the models' steps here; ``benchmarks/hf_models.py`` measures the peers and
the plans for their measured peaks. Writes own_layouts.csv and own_layouts.md.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path
from typing import Any

from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.cached.cache_rounding import cache_rounding
from chkpt_opt.zoo import huggingface as hf_zoo

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [
    "model",
    "ops",
    "layout",
    "regions",
    "cached",
    "peak_mib",
    "layout_ms",
    "rounding_ms",
    "rounding_s",
    "auto_ms",
    "auto_status",
    "auto_chosen",
    "auto_keep_set_ms",
    "auto_s",
    "auto_over_layout",
]


def rows_of(family: str, time_limit_s: float) -> list[dict[str, Any]]:
    model, args, _ = hf_zoo.FAMILIES[family]()
    graph = trace_model(model, args, name=family).graph
    rows = []
    for name, layout in own_layouts(graph).items():
        own = simulate(graph, layout)
        start = time.perf_counter()
        rounded = cache_rounding(graph, own.peak_bytes)
        rounding_s = time.perf_counter() - start
        start = time.perf_counter()
        found = get_solver("auto")(graph, own.peak_bytes, time_limit_s=time_limit_s)
        auto_s = time.perf_counter() - start
        keep_set = found.stats.get("keep_set", {}).get("objective_s", found.objective)
        row = {
            "model": family,
            "ops": graph.number_of_nodes(),
            "layout": name,
            "regions": len(layout.regions),
            "cached": len(layout.saved),
            "peak_mib": f"{own.peak_bytes / 2**20:.1f}",
            "layout_ms": f"{own.recompute_s * 1e3:.2f}",
            "rounding_ms": f"{rounded.objective * 1e3:.2f}" if rounded.feasible else "over",
            "rounding_s": f"{rounding_s:.1f}",
            "auto_ms": f"{found.objective * 1e3:.2f}" if found.feasible else "over",
            "auto_status": found.status.value,
            "auto_chosen": found.stats.get("chosen", ""),
            "auto_keep_set_ms": f"{keep_set * 1e3:.2f}",
            "auto_s": f"{auto_s:.1f}",
            "auto_over_layout": (
                f"{found.objective / own.recompute_s:.3f}"
                if found.feasible and own.recompute_s > 0
                else ""
            ),
        }
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per auto call")
    parser.add_argument(
        "--models", nargs="+", default=list(hf_zoo.FAMILIES), choices=list(hf_zoo.FAMILIES)
    )
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks/results/own_layouts")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    rows = [row for family in options.models for row in rows_of(family, options.time_limit)]
    with (options.out / "own_layouts.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    command = (
        f"python benchmarks/own_layouts.py --time-limit {options.time_limit:g}"
        f" --models {' '.join(options.models)}"
    )
    lines = [f"`{command}`", "", "| " + " | ".join(FIELDS) + " |", "|" + "---|" * len(FIELDS)]
    lines += ["| " + " | ".join(str(r[k]) for k in FIELDS) + " |" for r in rows]
    (options.out / "own_layouts.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
