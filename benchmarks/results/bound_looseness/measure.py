"""How loose the recompute bound is below the layers' peak (issue 46): on Hugging Face
Llamas small enough for Checkmate's program (2 layers and up: one has no layers to
checkpoint), ``auto``'s plan and recompute bound beside the
``staged`` solver's (Checkmate's program over every schedule: its bound holds over every
schedule PyTorch executes here, and its schedules are staged ones) and the time-indexed
bound (:mod:`chkpt_opt.solvers.bounds.timed_bound`).

Run (from the repository root; writes JSON lines to stdout, a table to stderr):
    OMP_NUM_THREADS=1 python benchmarks/results/bound_looseness/measure.py --layers 2 \
        --auto-limit 20 --staged-limit 120 > benchmarks/results/bound_looseness/results.jsonl

The models and budgets are ``benchmarks/hf_gaps.py``'s: the peak of the model's own layer
checkpointing, and halfway from there to the recompute bound's floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.bounds.timed_bound import timed_bound
from chkpt_opt.solvers.staged.exact import StagedSolver
from chkpt_opt.zoo import huggingface as hf_zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--auto-limit", type=float, default=20.0)
    parser.add_argument("--staged-limit", type=float, default=120.0, help="0: not run")
    parser.add_argument("--lower", type=float, nargs="+", default=[0.0, 0.5])
    args = parser.parse_args()
    for layers in args.layers:
        model, inputs, _ = hf_zoo.llama(layers=layers)
        graph = trace_model(model, inputs, name=f"llama{layers}").graph
        peak = simulate(graph, own_layouts(graph)["layers"]).peak_bytes
        start = time.perf_counter()
        first = get_solver("auto")(graph, peak, time_limit_s=args.auto_limit)
        first_s = time.perf_counter() - start
        floor = int(first.stats["recompute_bound"]["floor_bytes"])
        for lower in args.lower:
            budget = int(peak - lower * (peak - floor))
            start = time.perf_counter()
            auto = (
                first
                if lower == 0.0
                else get_solver("auto")(graph, budget, time_limit_s=args.auto_limit)
            )
            auto_s = first_s if lower == 0.0 else time.perf_counter() - start
            start = time.perf_counter()
            timed = timed_bound(graph, budget)
            timed_s = time.perf_counter() - start
            staged, staged_s = None, 0.0
            if args.staged_limit > 0:
                start = time.perf_counter()
                staged = StagedSolver(max_ops=graph.number_of_nodes(), warm_start=auto.schedule)(
                    graph, budget, time_limit_s=args.staged_limit
                )
                staged_s = time.perf_counter() - start
            row = {
                "layers": layers,
                "ops": graph.number_of_nodes(),
                "lower": lower,
                "budget_bytes": budget,
                "auto_ms": auto.objective * 1e3 if auto.feasible else None,
                "auto_status": auto.status.value,
                "auto_chosen": auto.stats.get("chosen"),
                "bound_ms": auto.stats["recompute_bound"]["bound_s"]
                * 1e3,  # auto's: both bounds' max
                "auto_s": round(auto_s, 1),
                "timed_bound_ms": None if timed.bound_s is None else timed.bound_s * 1e3,
                "timed_s": round(timed_s, 1),
                "timed_variables": timed.variables,
            }
            if staged is not None:
                row.update(
                    staged_ms=staged.objective * 1e3 if staged.feasible else None,
                    staged_status=staged.status.value,
                    staged_bound_ms=None if staged.bound is None else staged.bound * 1e3,
                    staged_s=round(staged_s, 1),
                )
            print(json.dumps(row), flush=True)
            print(
                f"llama{layers} ({row['ops']} ops) at {lower:g} of the way to the floor: auto "
                f"{row['auto_ms']} ms, its bound {row['bound_ms']:.3f} ms, "
                f"time-indexed bound {row['timed_bound_ms']} ms ({row['timed_s']} s); staged "
                f"{row.get('staged_ms')} ms ({row.get('staged_status')}), its bound "
                f"{row.get('staged_bound_ms')} ms",
                file=sys.stderr,
                flush=True,
            )


if __name__ == "__main__":
    main()
