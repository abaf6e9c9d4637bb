"""The recompute bound and the staged rounding at depth: what this folder's tables come from.

Run (one core), from the checkout to measure (for "before", a git worktree of the earlier
commit, with ``PYTHONPATH`` at it):

    OMP_NUM_THREADS=1 python benchmarks/results/bound_at_depth/measure.py OUT.json

1. The recompute bound (no deadline, memo cleared) on every corpus graph of at most 700 ops
   at 90/70/50/30% of its keep-all peak, and on the Hugging Face Llama (width 256, batch
   4 x 256) of 4, 8 and 32 layers at the peak of its own layer checkpointing: the bound,
   floor, rows, wall time, and a digest of the LP's shares (``recompute_share``), which the
   roundings read.
2. The staged rounding alone (the bound given, the graph frozen as ``auto`` freezes it) on
   the Hugging Face families at their layers' peak and halfway to the floor, and on the
   8- and 32-layer Llama at their layers' peak: its recompute, and the seconds after which
   its best schedule so far was within 5%, 2% and 1% of the bound.

Graphs are traced once into ``--graphs`` (default /tmp/bound_at_depth_graphs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.frozen import frozen
from chkpt_opt.graphs.io import load_graph, save_graph
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers.bounds import recompute_bound as rb
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.staged import rounding
from chkpt_opt.zoo import huggingface as hf_zoo

ROOT = Path(__file__).resolve().parents[3]
HF = [("llama", 2), ("llama", 4), ("llama", 6), ("llama", 8), ("llama", 32)]
HF += [(family, None) for family in ("vit", "mixtral", "gpt2", "bert", "t5")]


def _hf_graph(family: str, layers: int | None, cache: Path) -> tuple[str, CostGraph, int, int]:
    """The traced graph, its layers' peak and the budget halfway to the floor."""
    name = f"{family}{layers or ''}"
    path = cache / f"{name}.json"
    if path.exists():
        graph = load_graph(path)
    else:
        model, args, _ = hf_zoo.FAMILIES[family](**({"layers": layers} if layers else {}))
        graph = trace_model(model, args, name=family).graph
        save_graph(graph, path)
    peak = simulate(graph, own_layouts(graph)["layers"]).peak_bytes
    rb._memo.clear()
    floor = rb.recompute_bound(graph, peak).floor_bytes
    return name, graph, peak, int(peak - 0.5 * (peak - floor))


def _bound(graph: CostGraph, budget: int) -> dict[str, Any]:
    rb._memo.clear()
    if hasattr(rb, "_rows_memo"):
        rb._rows_memo.clear()
    start = time.perf_counter()
    found = rb.recompute_bound(graph, budget)
    return {
        "bound_s": found.bound_s,
        "floor_bytes": found.floor_bytes,
        "steps": found.steps,
        "complete": found.complete,
        "wall_s": time.perf_counter() - start,
        # The LP's shares (what the roundings read), as a digest: equal digests, equal shares.
        "share_sha256": hashlib.sha256(
            json.dumps(sorted(found.recompute_share.items())).encode()
        ).hexdigest(),
    }


def _rounding(graph: CostGraph, budget: int, limit_s: float) -> dict[str, Any]:
    simulate_alone = rounding.simulate
    with frozen(graph):
        rb._memo.clear()
        bound = rb.recompute_bound(graph, budget)
        assert bound.bound_s is not None
        start = time.perf_counter()
        reached: dict[str, float] = {}
        best: list[float] = []

        def timed(g: CostGraph, schedule: Schedule) -> Any:
            profile = simulate_alone(g, schedule)
            if profile.peak_bytes <= budget and (not best or profile.recompute_s < best[-1]):
                best.append(profile.recompute_s)
                gap = (profile.recompute_s - bound.bound_s) / profile.recompute_s
                for level in ("0.05", "0.02", "0.01"):
                    if gap <= float(level) and level not in reached:
                        reached[level] = time.perf_counter() - start
            return profile

        rounding.simulate = timed
        try:
            found = rounding.staged_rounding(
                graph, budget, relaxed=bound, deadline=Deadline.after(limit_s)
            )
        finally:
            rounding.simulate = simulate_alone
    return {
        "recompute_s": found.objective if found.feasible else None,
        "bound_s": bound.bound_s,
        "wall_s": time.perf_counter() - start,
        "within_s": reached,
        "stats": found.stats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--graphs", type=Path, default=Path("/tmp/bound_at_depth_graphs"))
    parser.add_argument("--limit", type=float, default=10.0, help="staged rounding's seconds")
    options = parser.parse_args()
    options.graphs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"load_before": os.getloadavg(), "bound": {}, "rounding": {}}
    hf = [_hf_graph(family, layers, options.graphs) for family, layers in HF]
    for name, graph, peak, _ in hf:
        if name in ("llama4", "llama8", "llama32"):
            result["bound"][f"{name}@{peak}"] = _bound(graph, peak)
    for path in sorted((ROOT / "graphs").glob("*.json")):
        graph = load_graph(path)
        if graph.number_of_nodes() > 700:
            continue
        keep_all = simulate(graph, Schedule()).peak_bytes
        for fraction in (0.9, 0.7, 0.5, 0.3):
            budget = int(keep_all * fraction)
            result["bound"][f"{path.stem}@{budget}"] = _bound(graph, budget)
    for name, graph, peak, half in hf:
        if name in ("llama4",):
            continue
        budgets = [("peak", peak)] + ([] if name in ("llama8", "llama32") else [("half", half)])
        for label, budget in budgets:
            limit = options.limit * (2 if name == "llama32" else 1)
            result["rounding"][f"{name}@{label}"] = _rounding(graph, budget, limit)
            print(name, label, result["rounding"][f"{name}@{label}"], flush=True)
    result["load_after"] = os.getloadavg()
    options.out.write_text(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
