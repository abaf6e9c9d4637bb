"""Commands on cost-graph files: trace, solve, simulate, show, corpus, solvers.

Each ``cmd_*`` takes the parsed arguments and returns the exit code; the errors it raises
are turned into exit codes by :func:`chkpt_opt.cli.entry.main`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from chkpt_opt.cli.model_spec import load_model_spec
from chkpt_opt.cli.output import (
    EXIT_INFEASIBLE,
    EXIT_OK,
    Progress,
    emit,
    optimizer_arg,
    sharding_arg,
)
from chkpt_opt.errors import GraphFormatError
from chkpt_opt.step_budget.budget import format_bytes


def cmd_trace(args: argparse.Namespace) -> int:
    from chkpt_opt.graphs.io import graph_fingerprint, save_graph
    from chkpt_opt.measurement import trace_and_measure
    from chkpt_opt.memory_model.schedule import Schedule
    from chkpt_opt.memory_model.simulate import simulate

    model, ex_args, ex_kwargs = load_model_spec(args.model)
    traced = trace_and_measure(
        model,
        ex_args,
        ex_kwargs,
        name=args.name or args.model.rpartition(":")[2],
        method=args.tracer,
        progress=Progress("tracing", not args.json),
    )
    graph = traced.graph
    save_graph(graph, args.output)
    peak = simulate(graph, Schedule()).peak_bytes
    data = {
        "graph": str(args.output),
        "name": graph.graph["name"],
        "nodes": graph.number_of_nodes(),
        "fingerprint": graph_fingerprint(graph),
        "tracer": graph.graph["tracer"],
        "keep_all_peak_bytes": peak,
        "param_bytes": graph.graph["param_bytes"],
    }
    emit(
        args,
        data,
        [
            f"traced {graph.graph['name']} with {graph.graph['tracer']}: "
            f"{graph.number_of_nodes()} ops -> {args.output}",
            f"parameters {format_bytes(graph.graph['param_bytes'])}; forward/backward peak without "
            f"checkpointing {format_bytes(peak)}",
        ],
    )
    return EXIT_OK


def cmd_solve(args: argparse.Namespace) -> int:
    from chkpt_opt.api import activation_budget
    from chkpt_opt.graphs.io import load_graph
    from chkpt_opt.memory_model.schedule_io import save_schedule
    from chkpt_opt.solvers import get_solver
    from chkpt_opt.step_budget.sharding import per_rank_graph, sharding_meta

    sharding = sharding_arg(args)
    graph = load_graph(args.graph)
    budget, static, act = activation_budget(
        graph, args.budget, optimizer=optimizer_arg(args.optimizer), sharding=sharding
    )
    graph = per_rank_graph(graph, sharding)
    result = get_solver(args.solver)(graph, act, time_limit_s=args.time_limit)
    predicted = static.step_peak_bytes(result.peak_bytes)
    data = {
        "status": result.status.value,
        "solver": result.solver,
        "objective_s": result.objective,
        "bound_s": result.bound,
        "gap": result.gap,
        "budget_bytes": budget.total_bytes,
        "activation_budget_bytes": act,
        "peak_bytes": result.peak_bytes,
        "predicted_peak_bytes": predicted,
        # The names chkpt_opt.solve's result uses (peak_bytes above is the activation peak).
        "step_budget_bytes": budget.total_bytes,
        "resident_bytes": static.resident_bytes,
        "step_peak_bytes": predicted,
        "regions": len(result.schedule.regions),
        "solve_s": result.solve_s,
    }
    if args.output and result.feasible:
        save_schedule(
            args.output,
            graph,
            result.schedule,
            budget_bytes=budget.total_bytes,
            activation_budget_bytes=act,
            predicted_peak_bytes=predicted,
            solver=result.solver,
            status=result.status.value,
            objective_s=result.objective,
            bound_s=result.bound,
            **sharding_meta(sharding),
        )
        data["schedule"] = str(args.output)
    gap = f", gap {result.gap:.2%}" if result.gap is not None else ""
    emit(
        args,
        data,
        [
            f"budget {format_bytes(budget.total_bytes)}: "
            f"resident {format_bytes(static.resident_bytes)} ({static.describe_resident()}), "
            f"forward/backward {format_bytes(act)}",
            f"{result.solver}: {result.status.value}{gap}; {len(result.schedule.regions)} regions; "
            f"extra compute {result.objective:.4g} s; predicted peak {format_bytes(predicted)}; "
            f"solved in {result.solve_s:.2f} s"
            + (f" -> {args.output}" if "schedule" in data else ""),
        ],
    )
    if not result.feasible:
        print(
            f"no schedule found within the budget; the lowest peak reached was "
            f"{format_bytes(predicted)}",
            file=sys.stderr,
        )
        return EXIT_INFEASIBLE
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from chkpt_opt.graphs.io import load_graph
    from chkpt_opt.memory_model.schedule import Schedule
    from chkpt_opt.memory_model.schedule_io import load_schedule
    from chkpt_opt.memory_model.simulate import simulate

    graph = load_graph(args.graph)
    schedule = Schedule()
    if args.schedule:
        loaded = load_schedule(args.schedule)
        loaded.check_against(graph)
        schedule = loaded.schedule
    profile = simulate(graph, schedule)
    data: dict[str, Any] = {
        "peak_bytes": profile.peak_bytes,
        "compute_s": profile.compute_s,
        "recompute_s": profile.recompute_s,
        "overhead": profile.overhead,
        "peak_step": {"kind": profile.peak_step.kind, "node": profile.peak_step.node},
    }
    lines = [
        f"peak {format_bytes(profile.peak_bytes)} at "
        f"{profile.peak_step.kind} {profile.peak_step.node}",
        f"estimated compute {profile.compute_s:.4g} s, "
        f"of which recomputation {profile.recompute_s:.4g} s "
        f"({profile.overhead:.1%})",
    ]
    if args.timeline:
        data["timeline"] = [
            {
                "kind": p.kind,
                "node": p.node,
                "during_bytes": p.during_bytes,
                "after_bytes": p.after_bytes,
            }
            for p in profile.timeline
        ]
        lines += [f"{p.kind:>10} {p.node:<40} {p.during_bytes:>14}" for p in profile.timeline]
    emit(args, data, lines)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from chkpt_opt.graphs.costgraph import ordered_nodes
    from chkpt_opt.graphs.io import graph_fingerprint, load_graph, read_json
    from chkpt_opt.memory_model.schedule_io import load_schedule

    raw = read_json(args.file, what="file")
    if isinstance(raw, dict) and raw.get("format") == "chkpt_opt.memory_model.schedule":
        loaded = load_schedule(args.file)
        data = {
            "kind": "schedule",
            "graph": loaded.graph_name,
            "fingerprint": loaded.fingerprint,
            "regions": [list(r) for r in loaded.schedule.regions],
            **loaded.meta,
        }
        lines = [
            f"schedule for graph {loaded.graph_name!r} ({loaded.fingerprint}): "
            f"{len(loaded.schedule.regions)} regions"
        ]
        lines += [f"  {k}: {v}" for k, v in sorted(loaded.meta.items())]
        lines += [
            f"  region {i}: {r[0]} .. {r[-1]} ({len(r)} ops)"
            for i, r in enumerate(loaded.schedule.regions)
        ]
        emit(args, data, lines)
        return EXIT_OK
    graph = load_graph(args.file)
    nodes = ordered_nodes(graph)
    top = sorted(nodes, key=lambda n: graph.nodes[n]["saved_bytes"], reverse=True)[: args.top]
    g = graph.graph
    data = {
        "kind": "graph",
        "name": g["name"],
        "nodes": len(nodes),
        "edges": graph.number_of_edges(),
        "fingerprint": graph_fingerprint(graph),
        **{
            k: g[k] for k in ("param_bytes", "buffer_bytes", "input_bytes", "tracer", "device_type")
        },
    }
    lines = [
        f"graph {g['name']!r}: {len(nodes)} ops, {graph.number_of_edges()} edges, "
        f"traced with {g['tracer']} "
        f"on {g['device_type']} (fingerprint {graph_fingerprint(graph)})",
        f"parameters {format_bytes(g['param_bytes'])}, buffers {format_bytes(g['buffer_bytes'])}, "
        f"inputs {format_bytes(g['input_bytes'])}",
        "largest saved-for-backward ops:",
    ]
    lines += [
        f"  {n:<40} {graph.nodes[n]['op']:<40} {format_bytes(graph.nodes[n]['saved_bytes'])}"
        for n in top
    ]
    emit(args, data, lines)
    return EXIT_OK


def cmd_corpus(args: argparse.Namespace) -> int:
    from chkpt_opt.corpus import generate_corpus

    def progress(done: int, total: int, name: str) -> None:
        if not args.json and name:
            print(f"[{done + 1}/{total}] tracing {name}", file=sys.stderr, flush=True)

    try:
        written = generate_corpus(args.output, names=args.only or None, progress=progress)
    except ValueError as err:
        raise GraphFormatError(str(err)) from None
    emit(args, {"written": [str(p) for p in written]}, [f"wrote {p}" for p in written])
    return EXIT_OK


def cmd_solvers(args: argparse.Namespace) -> int:
    from chkpt_opt.solvers import available_solvers

    solvers = available_solvers()
    emit(args, {"solvers": solvers}, [f"{k:<12} {v}" for k, v in solvers.items()])
    return EXIT_OK
