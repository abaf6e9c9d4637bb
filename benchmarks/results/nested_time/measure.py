"""What one deep multi-level schedule costs to lower and simulate, and whether the nested
(multi-level) shape search keeps its time limit, on the graph where it did not: the
32-layer LoRA Llama of ``benchmarks/max_length.py`` at 1 x 768 tokens (logits dropped
before the backward pass, as the attachment plans it).

Run (from the repository root):
    OMP_NUM_THREADS=1 python benchmarks/results/nested_time/measure.py -o OUT.json
    OMP_NUM_THREADS=1 python benchmarks/results/nested_time/measure.py --no-search -o OUT.json

The schedule timed is the first prefix shape of the search (one outermost region, each op
recomputed once per later segment: quadratic recomputation for constant memory). The
search runs at ``--limits`` seconds with an activation budget of ``--budget-mib``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import max_length  # noqa: E402

import chkpt_opt  # noqa: E402
from chkpt_opt.graphs.costgraph import ordered_nodes  # noqa: E402
from chkpt_opt.memory_model.op_sequence import lower  # noqa: E402
from chkpt_opt.memory_model.schedule import Schedule  # noqa: E402
from chkpt_opt.memory_model.simulate import simulate  # noqa: E402
from chkpt_opt.solvers import get_solver  # noqa: E402
from chkpt_opt.solvers.nested.shape_search import Shape, shape_spans  # noqa: E402
from chkpt_opt.solvers.segments import candidate_cuts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--budget-mib", type=float, default=20.0)
    parser.add_argument("--limits", type=float, nargs="*", default=[10.0, 30.0])
    parser.add_argument("--no-search", action="store_true", help="time the schedule only")
    parser.add_argument(
        "--plan-limit",
        type=float,
        default=None,
        help="also time chkpt_opt.plan(time_limit_s=this) and plan.apply() at --plan-budget-mib",
    )
    parser.add_argument("--plan-budget-mib", type=float, default=132.33)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    model = max_length.build(args.layers, "lora")
    batch = max_length.make_batch(1, args.tokens, 0)
    graph = chkpt_opt.plan(
        model,
        (),
        example_kwargs=batch.inputs,
        budget=10**12,
        solver="keep_all",
        outputs_held=False,
        profile_times=False,
    ).graph
    order = ordered_nodes(graph)
    cuts = candidate_cuts(graph)
    outer, nested = shape_spans(cuts, len(order), Shape(1, (), 1))
    schedule = Schedule(
        regions=tuple(tuple(order[a:b]) for a, b in outer),
        nested=tuple(tuple(order[a:b]) for a, b in nested),
    )
    start = time.perf_counter()
    steps = len(lower(graph, schedule))
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    peak = simulate(graph, schedule, check=False).peak_bytes
    simulate_s = time.perf_counter() - start
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    out: dict = {
        "command": " ".join(sys.argv),
        "commit": commit,
        "ops": len(order),
        "prefix_shape": {"steps": steps, "lower_s": lower_s, "simulate_s": simulate_s},
        "prefix_shape_peak_bytes": peak,
        "search": [],
    }
    print(json.dumps(out), flush=True)
    for limit in [] if args.no_search else args.limits:
        start = time.perf_counter()
        found = get_solver("nested")(graph, int(args.budget_mib * 2**20), time_limit_s=limit)
        row = {
            "time_limit_s": limit,
            "wall_s": time.perf_counter() - start,
            "status": found.status.value,
            "peak_bytes": found.peak_bytes,
            "recompute_s": found.objective,
            **{k: found.stats.get(k) for k in ("shapes_tried", "shapes_skipped_for_time")},
        }
        out["search"].append(row)
        print(json.dumps(row), flush=True)
    if args.plan_limit is not None:
        out["plan"] = _plan_and_apply(args, batch)
        print(json.dumps(out["plan"]), flush=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")


def _plan_and_apply(args: argparse.Namespace, batch: max_length.Batch) -> dict:
    """``chkpt_opt.plan`` as ``benchmarks/max_length.py`` calls it, then ``plan.apply()``,
    each timed (a refusal: its message)."""
    model = max_length.build(args.layers, "lora")
    start = time.perf_counter()
    try:
        made = chkpt_opt.plan(
            model,
            (),
            example_kwargs=batch.inputs,
            budget=int(args.plan_budget_mib * 2**20),
            time_limit_s=args.plan_limit,
            outputs_held=False,
            profile_times=False,
        )
    except chkpt_opt.InfeasibleBudgetError as err:
        return {
            "time_limit_s": args.plan_limit,
            "plan_s": time.perf_counter() - start,
            "refused": str(err).split(". ")[0],
        }
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    made.apply()
    return {
        "time_limit_s": args.plan_limit,
        "budget_mib": args.plan_budget_mib,
        "plan_s": plan_s,
        "planning_s": made.result.stats.get("planning_s"),
        "status": made.result.status.value,
        "chosen": made.result.stats.get("chosen"),
        "nested_regions": len(made.schedule.nested),
        "predicted_step_peak_bytes": made.static.step_peak_bytes(made.profile.peak_bytes),
        "recompute_s": made.result.objective,
        "apply_s": time.perf_counter() - start,
    }


if __name__ == "__main__":
    main()
