"""The gap each plan proves on the six Hugging Face families: ``auto``'s recompute against
its proven bound.

Run:
    python benchmarks/hf_gaps.py --time-limit 20 -o benchmarks/results/hf_gaps

For each family of :mod:`chkpt_opt.zoo.huggingface` at its default size (as
``benchmarks/own_layouts.py`` builds them: from its config with random weights, roofline op
costs, so the graphs are deterministic; the results vary only with where the time limit
cuts the searches), at two budgets: the peak of the model's own layer checkpointing (the
``"layers"`` layout of :func:`chkpt_opt.own_layouts.own_layouts`, what
``gradient_checkpointing_enable()`` runs) and a lower one, ``--lower`` of the way from that
peak down to the proven floor under every schedule's peak (the recompute bound's
``floor_bytes``; 0.5: halfway). For each:

* ``auto``'s recompute, status and the solver it chose;
* the bound it reports (``SolveResult.bound``: the best of its solvers' proven bounds and
  the recompute bound) and the space it holds over: ``stats["proofs_over"]``
  (``keep_set``: keep-set schedules; ``every_schedule``), or, for a schedule from beyond
  keep-set (``stats["keep_set"]`` records the keep-set result it beat), ``every_schedule``:
  auto's bound there is the recompute bound's;
* the gap, ``(recompute - bound) / recompute``, in percent;
* the recompute bound alone (over every schedule) and the gap to it.

Writes hf_gaps.csv and hf_gaps.md (the command and commit in its header).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers import SolveResult, get_solver
from chkpt_opt.zoo import huggingface as hf_zoo

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [
    "model",
    "ops",
    "budget",
    "budget_mib",
    "floor_mib",
    "auto_ms",
    "status",
    "chosen",
    "bound_ms",
    "bound_over",
    "gap_pct",
    "every_schedule_bound_ms",
    "every_schedule_gap_pct",
    "auto_s",
]


def _gap(objective_s: float, bound_s: float | None) -> str:
    if bound_s is None or objective_s <= 0:
        return "-" if bound_s is None else "0.0"
    return f"{max(0.0, objective_s - bound_s) / objective_s * 100:.1f}"


def _bound_over(result: SolveResult) -> str:
    """What space ``result.bound`` holds over (see the module docstring)."""
    if result.bound is None:
        return "-"
    if "keep_set" in result.stats:  # a schedule from beyond keep-set: the recompute bound
        return "every_schedule"
    return str(result.stats.get("proofs_over", "-"))


def _row(
    family: str,
    graph: CostGraph,
    label: str,
    budget: int,
    floor: int | None,
    time_limit_s: float,
) -> dict[str, Any]:
    """auto's result at ``budget`` as a row, with ``_floor_bytes``: its recompute bound's floor."""
    start = time.perf_counter()
    found = get_solver("auto")(graph, budget, time_limit_s=time_limit_s)
    auto_s = time.perf_counter() - start
    summary = found.stats.get("recompute_bound", {})
    cover = summary.get("bound_s")
    floor = summary.get("floor_bytes", 0) if floor is None else floor
    row = {
        "model": family,
        "ops": graph.number_of_nodes(),
        "budget": label,
        "budget_mib": f"{budget / 2**20:.1f}",
        "floor_mib": f"{floor / 2**20:.1f}",
        "auto_ms": f"{found.objective * 1e3:.2f}" if found.feasible else "over",
        "status": found.status.value,
        "chosen": found.stats.get("chosen", ""),
        "bound_ms": f"{found.bound * 1e3:.2f}" if found.bound is not None else "-",
        "bound_over": _bound_over(found),
        "gap_pct": _gap(found.objective, found.bound) if found.feasible else "-",
        "every_schedule_bound_ms": f"{cover * 1e3:.2f}" if cover is not None else "-",
        "every_schedule_gap_pct": _gap(found.objective, cover) if found.feasible else "-",
        "auto_s": f"{auto_s:.1f}",
        "_floor_bytes": floor,
    }
    print({k: v for k, v in row.items() if not k.startswith("_")}, flush=True)
    return row


def rows_of(
    family: str,
    lower: float,
    time_limit_s: float,
    *,
    llama_layers: int | None = None,
    peak_only: bool = False,
) -> list[dict[str, Any]]:
    sized = family == "llama" and llama_layers is not None
    model, args, _ = hf_zoo.FAMILIES[family](**({"layers": llama_layers} if sized else {}))
    graph = trace_model(model, args, name=family).graph
    if sized:
        family = f"llama{llama_layers}"
    layers = own_layouts(graph).get("layers")
    if layers is None:
        print(f"{family}: no layers found; skipped", file=sys.stderr)
        return []
    peak = simulate(graph, layers).peak_bytes
    rows = [_row(family, graph, "layers' peak", peak, None, time_limit_s)]
    # The floor from auto's own bound at the layers' peak (a call of our own would be
    # remembered, and hand auto a bound it did not have the time to compute).
    floor = int(rows[0].pop("_floor_bytes"))
    if peak_only:
        return rows
    lowered = int(peak - lower * (peak - floor))
    rows.append(
        _row(family, graph, f"{lower:g} of the way to the floor", lowered, floor, time_limit_s)
    )
    rows[1].pop("_floor_bytes")
    return rows


def _commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per auto call")
    parser.add_argument(
        "--lower", type=float, default=0.5, help="the lower budget: this share of the way down"
    )
    parser.add_argument(
        "--models", nargs="+", default=list(hf_zoo.FAMILIES), choices=list(hf_zoo.FAMILIES)
    )
    parser.add_argument(
        "--llama-layers", type=int, default=None, help="layers of the Llama (default: 6)"
    )
    parser.add_argument(
        "--peak-only", action="store_true", help="only the layers' peak, not the lower budget"
    )
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks/results/hf_gaps")
    options = parser.parse_args()
    command = "python benchmarks/hf_gaps.py " + " ".join(sys.argv[1:])
    commit = _commit()
    load_before = os.getloadavg()[0]
    rows = [
        row
        for family in options.models
        for row in rows_of(
            family,
            options.lower,
            options.time_limit,
            llama_layers=options.llama_layers,
            peak_only=options.peak_only,
        )
    ]
    options.out.mkdir(parents=True, exist_ok=True)
    with (options.out / "hf_gaps.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"Command: `{command}` at {commit}, CPU, {os.cpu_count()} cores shared with other jobs "
        f"(1-minute load {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end).",
        "",
        "| " + " | ".join(FIELDS) + " |",
        "|" + "---|" * len(FIELDS),
    ]
    lines += ["| " + " | ".join(str(r[k]) for k in FIELDS) + " |" for r in rows]
    (options.out / "hf_gaps.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
