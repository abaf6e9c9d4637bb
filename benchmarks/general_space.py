"""Schedules beyond keep-set, side by side with keep-set, in one run.

Three parts, one results directory (``benchmarks/results/general_space``):

* the corpus (``graphs/*.json``): per graph and budget, the keep-set optimum
  (``auto`` with ``general=False``) and the general ``auto`` (keep-set solvers, then the
  cached-op search from the keep-set result and, where no keep-set schedule fits, the
  nested search): objective, status, bound; and per graph the smallest peak of each space
  with its proven lower bound;
* a deep chain (32 x Linear(256, 256) + ReLU, batch 4096): the smallest whole-step budget
  of each space, and a plan at 0.75x the keep-set one, measured;
* conv nets from the zoo (VGG at 32² and 64² images, ResNet): keep-set against general at
  budgets that are fractions of the keep-all peak and of the smallest keep-set peak (just
  above it, and below it), the general plans measured (peak against prediction, gradients
  against the original), ``dp_nested`` and the nested heuristic beside them.

With ``--dp-nested``, the exact nested DP (``dp_nested``: simple chains, and the blocks
between separators of other graphs, each block free to run its own keep-set options;
refused elsewhere) and the nested heuristic side by
side: on the corpus graphs it accepts (columns ``dp_nested_*`` and ``nested_*``), and on
the deep chain at the 0.75x budget and at its smallest peak (``deep_chain.dp_nested``).

Usage::

    python benchmarks/general_space.py --time-limit 10
    python benchmarks/general_space.py --time-limit 30 --parts conv_nets  # one part; the
        # others stay in results.json as they were
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chkpt_opt  # noqa: E402
from chkpt_opt import zoo  # noqa: E402
from chkpt_opt.api import Plan  # noqa: E402
from chkpt_opt.errors import InfeasibleBudgetError, SolverError  # noqa: E402
from chkpt_opt.graphs.io import load_graph  # noqa: E402
from chkpt_opt.measurement.step import measure_step  # noqa: E402
from chkpt_opt.memory_model.schedule import Schedule  # noqa: E402
from chkpt_opt.memory_model.simulate import simulate  # noqa: E402
from chkpt_opt.solvers import SolveResult, get_solver  # noqa: E402

BUDGETS = (0.9, 0.7, 0.5, 0.3)
PARTS = ("deep_chain", "conv_nets", "corpus")


def _row(result: SolveResult) -> dict:
    return {
        "status": result.status.value,
        "objective_s": result.objective,
        "bound_s": result.bound,
        "peak_bytes": result.peak_bytes,
        "space": result.stats.get("space", "keep_set"),
        "nested": len(result.schedule.nested),
        "cached": len(result.schedule.saved),
    }


def nested_side_by_side(graph, budget: int, time_limit_s: float) -> dict:
    """``dp_nested`` and the nested heuristic at one budget (a refusal is recorded)."""
    row: dict = {}
    for name in ("dp_nested", "nested"):
        start = time.perf_counter()
        try:
            result = get_solver(name)(graph, budget, time_limit_s=time_limit_s)
        except SolverError as err:
            row[f"{name}_refused"] = str(err)[:80]
            continue
        row.update({f"{name}_{k}": v for k, v in _row(result).items()})
        row[f"{name}_solve_s"] = round(time.perf_counter() - start, 2)
        row[f"{name}_optimal_over"] = result.stats.get("optimal_over")
    return row


def corpus(
    time_limit_s: float,
    out: Path,
    ops: tuple[int, int],
    command: str,
    dp_nested: bool = False,
    earlier_command: str = "",
    names: list[str] | None = None,
    fractions: tuple[float, ...] = BUDGETS,
) -> list[dict]:
    """The corpus part over the graphs whose op counts lie in ``ops`` (inclusive), and
    whose names are in ``names`` where given, at ``fractions`` of their keep-all peaks;
    the rows of the other graphs stay in
    ``corpus.csv`` as they were, each row naming the command that made it
    (``earlier_command`` for rows from before that column)."""
    rows = []
    ran: set[str] = set()
    for path in sorted((ROOT / "graphs").glob("*.json")):
        graph = load_graph(path)
        if not ops[0] <= graph.number_of_nodes() <= ops[1] or path.stem not in (
            names or [path.stem]
        ):
            continue
        ran.add(path.stem)
        keep_all = simulate(graph, Schedule()).peak_bytes
        mins, lowers = {}, {}
        for space, general in (("keep_set", False), ("general", True)):
            solver = get_solver("auto", general=general)
            lowest = solver(graph, 0, time_limit_s=time_limit_s)
            mins[space] = lowest.peak_bytes
            # A proven lower bound on the smallest peak of the space: the exact solvers'
            # over keep-set schedules; over every schedule, the recompute bound's floor.
            if general:
                lowers[space] = lowest.stats["recompute_bound"]["floor_bytes"]
            else:
                lowers[space] = lowest.stats.get("min_feasible_lower_bytes") or 0
        for fraction in fractions:
            budget = int(keep_all * fraction)
            row = {"graph": path.stem, "nodes": graph.number_of_nodes(), "fraction": fraction}
            row["command"] = command
            for space, general in (("keep_set", False), ("general", True)):
                start = time.perf_counter()
                result = get_solver("auto", general=general)(
                    graph, budget, time_limit_s=time_limit_s
                )
                row.update({f"{space}_{k}": v for k, v in _row(result).items()})
                row[f"{space}_solve_s"] = round(time.perf_counter() - start, 2)
                row[f"{space}_smallest_peak_fraction"] = round(mins[space] / keep_all, 4)
                row[f"{space}_smallest_peak_lower_fraction"] = round(lowers[space] / keep_all, 4)
            if dp_nested:
                row.update(nested_side_by_side(graph, budget, time_limit_s))
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = out / "corpus.csv"
    if path.exists():
        with open(path, newline="") as f:
            kept = [r for r in csv.DictReader(f) if r["graph"] not in ran]
        for r in kept:
            r["command"] = r.get("command") or earlier_command
        order = {b: k for k, b in enumerate(BUDGETS)}
        rows = sorted(
            [*kept, *rows],
            key=lambda r: (int(r["nodes"]), r["graph"], order.get(float(r["fraction"]), 9)),
        )
    with open(path, "w", newline="") as f:
        fields = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def _measured(model: nn.Module, args: tuple, kwargs: dict, plan: Plan) -> dict:
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = None
    measure_step(model, args, kwargs)
    reference = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    measured = measure_step(plan.apply(), args, kwargs).peak_bytes
    equal = all(
        (r is None and p.grad is None) or torch.equal(r, p.grad)
        for r, p in zip(reference, model.parameters())
    )
    predicted = plan.profile.peak_bytes
    return {
        "measured_peak_bytes": measured,
        "predicted_peak_bytes": predicted,
        "prediction_error": round((predicted - measured) / measured, 5),
        "grads_bitwise_equal": equal,
    }


def deep_chain(time_limit_s: float, dp_nested: bool = False) -> dict:
    model, (x,), _ = zoo.relu_chain(width=256, depth=32, batch=4096)
    graph = chkpt_opt.trace(model, (x,))
    static = chkpt_opt.plan(model, (x,), budget=10**12, optimizer=None).static
    resident = static.param_bytes + static.input_bytes
    keep_min = get_solver("auto", general=False)(graph, 0, time_limit_s=time_limit_s).peak_bytes
    general = get_solver("auto", general=True)
    gen_min = general(graph, 0, time_limit_s=time_limit_s).peak_bytes
    budget = int(0.75 * (keep_min + resident))
    plan = chkpt_opt.plan(
        model, (x,), budget=budget, optimizer=None, solver=general, time_limit_s=60
    )
    out = {
        "plain_step_bytes": simulate(graph, Schedule()).peak_bytes + resident,
        "keep_set_smallest_step_bytes": keep_min + resident,
        "general_smallest_step_bytes": gen_min + resident,
        "budget_bytes": budget,
        "status": plan.result.status.value,
        "overhead": round(plan.profile.overhead, 4),
        "nested_regions": len(plan.schedule.nested),
        **_measured(model, (x,), {}, plan),
    }
    out["measured_step_bytes"] = out["measured_peak_bytes"] + resident
    if dp_nested:
        out["dp_nested"] = {
            "at_0.75": nested_side_by_side(graph, budget - resident, time_limit_s),
            "smallest": nested_side_by_side(graph, 0, time_limit_s),
        }
        floor = out["dp_nested"]["smallest"].get("dp_nested_peak_bytes")
        if floor is not None:  # dp_nested's plan at its smallest peak, run
            lowest = chkpt_opt.plan(
                model,
                (x,),
                budget=floor + resident,
                optimizer=None,
                solver=get_solver("dp_nested"),
                time_limit_s=4 * time_limit_s,
            )
            out["dp_nested"]["smallest_plan"] = {
                "status": lowest.result.status.value,
                "step_budget_bytes": floor + resident,
                "nested_regions": len(lowest.schedule.nested),
                "overhead": round(lowest.profile.overhead, 4),
                **_measured(model, (x,), {}, lowest),
            }
    print(json.dumps(out), flush=True)
    return out


CONV_NETS = {
    "vgg": lambda: zoo.vgg(widths=(16, 32, 64, 128), convs_per_stage=3, image=32, batch=8),
    "vgg64": lambda: zoo.vgg(widths=(16, 32, 64, 128), convs_per_stage=3, image=64, batch=8),
    "resnet": lambda: zoo.resnet(widths=(16, 32), blocks_per_stage=2, image=32, batch=8),
}
KEEP_ALL_FRACTIONS = (0.8, 0.6, 0.5, 0.45)
"""Conv-net budgets as fractions of the keep-all peak."""
FLOOR_FRACTIONS = (1.02, 0.9)
"""... and as fractions of the smallest keep-set peak: just above it, and below it."""


def _floor(result: SolveResult) -> dict:
    """The smallest peak a solve at budget 0 found, and whether it is proven minimal."""
    return {
        "peak_bytes": result.peak_bytes,
        "proven": bool(result.stats.get("min_feasible_proven")),
        "solver": result.solver,
    }


def _nested_floor(graph, time_limit_s: float) -> dict | None:
    """``dp_nested``'s smallest peak (given four times the limit: the lowest-peak search
    solves the DP several times), or None where it refuses the graph."""
    start = time.perf_counter()
    try:
        result = get_solver("dp_nested")(graph, 0, time_limit_s=4 * time_limit_s)
    except SolverError:
        return None
    return {**_floor(result), "solve_s": round(time.perf_counter() - start, 2)}


def conv_nets(time_limit_s: float) -> list[dict]:
    """Per conv net and budget: the keep-set optimum, ``auto``'s general plan (measured when
    it fits: peak against prediction, gradients against the original) and, side by side,
    ``dp_nested`` and the nested heuristic."""
    rows = []
    for name, build in CONV_NETS.items():
        model, args, kwargs = build()
        graph = chkpt_opt.trace(model, args, kwargs)
        keep_all = simulate(graph, Schedule()).peak_bytes
        keep_floor = get_solver("auto", general=False)(graph, 0, time_limit_s=time_limit_s)
        static = chkpt_opt.plan(
            model, args, example_kwargs=kwargs, budget=10**12, optimizer=None
        ).static
        resident = static.param_bytes + static.buffer_bytes + static.input_bytes
        floors = {"keep_set": _floor(keep_floor), "nested": _nested_floor(graph, time_limit_s)}
        print(json.dumps({"model": name, "floors": floors}), flush=True)
        budgets = [("keep_all", f, int(keep_all * f)) for f in KEEP_ALL_FRACTIONS]
        budgets += [("keep_set_floor", f, int(keep_floor.peak_bytes * f)) for f in FLOOR_FRACTIONS]
        for of, fraction, budget in budgets:
            keep = get_solver("auto", general=False)(graph, budget, time_limit_s=time_limit_s)
            start = time.perf_counter()
            try:  # auto beyond keep-set; its result is the general row
                plan = chkpt_opt.plan(
                    model,
                    args,
                    example_kwargs=kwargs,
                    budget=budget + resident,
                    optimizer=None,
                    time_limit_s=time_limit_s,
                )
                general = plan.result
            except InfeasibleBudgetError:  # the same solve, for its lowest peak
                plan = None
                general = get_solver("auto")(graph, budget, time_limit_s=time_limit_s)
            row = {
                "model": name,
                "ops": graph.number_of_nodes(),
                "budget_of": of,
                "fraction": fraction,
                "budget_bytes": budget,
                "keep_all_bytes": keep_all,
                "keep_set_floor_bytes": keep_floor.peak_bytes,
                "floors": floors,
                "keep_set": _row(keep),
                "general": {**_row(general), "plan_s": round(time.perf_counter() - start, 2)},
                "space_optima": general.stats.get("space_optima"),
                **nested_side_by_side(graph, budget, time_limit_s),
            }
            if plan is not None:
                row.update(_measured(model, args, kwargs, plan))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--min-ops", type=int, default=0)
    parser.add_argument("--max-ops", type=int, default=320)
    parser.add_argument("--graphs", nargs="+", help="corpus part: only these graphs")
    parser.add_argument(
        "--fractions",
        nargs="+",
        type=float,
        default=list(BUDGETS),
        help="corpus part: budgets as fractions of the keep-all peak",
    )
    parser.add_argument("-o", type=Path, default=ROOT / "benchmarks/results/general_space")
    parser.add_argument(
        "--dp-nested", action="store_true", help="add dp_nested beside the nested heuristic"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="run only these parts; the others' results stay as the file has them",
    )
    args = parser.parse_args()
    args.o.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    path = args.o / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    command = " ".join(["python", "benchmarks/general_space.py", *sys.argv[1:]])
    commands = results.setdefault("commands", {})
    if "command" in results:  # a file from before --parts: one command made every part
        commands.update(dict.fromkeys(PARTS, results.pop("command")))
    results.update(torch=torch.__version__)
    for part in args.parts:
        if part == "deep_chain":
            results["deep_chain"] = deep_chain(args.time_limit, args.dp_nested)
        elif part == "conv_nets":
            results["conv_nets"] = conv_nets(args.time_limit)
        else:
            results["corpus_rows"] = len(
                corpus(
                    args.time_limit,
                    args.o,
                    (args.min_ops, args.max_ops),
                    command,
                    args.dp_nested,
                    commands.get(part, ""),
                    args.graphs,
                    tuple(args.fractions),
                )
            )
        commands[part] = command if part != "corpus" else "corpus.csv's command column"
    path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
