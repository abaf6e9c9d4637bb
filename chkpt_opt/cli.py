"""The ``chkpt-opt`` command line.

Exit codes (stable, for scripts):
    0  success
    1  unexpected internal error
    2  bad usage or bad input (unreadable budget, malformed or mismatched file)
    3  the budget cannot be met (no schedule fits)
    4  the model cannot be traced or loaded
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chkpt_opt.budget import format_bytes
from chkpt_opt.errors import (
    BudgetError,
    ChkptOptError,
    GraphFormatError,
    InfeasibleBudgetError,
    ScheduleError,
    SolverError,
    SweepError,
    TraceError,
)

EXIT_OK, EXIT_INTERNAL, EXIT_INPUT, EXIT_INFEASIBLE, EXIT_TRACE = 0, 1, 2, 3, 4

EXAMPLES = """examples:
  chkpt-opt trace chkpt_opt.zoo:gpt -o gpt.json
  chkpt-opt solve gpt.json --budget 200MB --solver auto -o gpt.schedule.json
  chkpt-opt simulate gpt.json gpt.schedule.json --timeline
  chkpt-opt optimize chkpt_opt.zoo:resnet --budget 0.1GiB --validate
  chkpt-opt validate chkpt_opt.zoo:gpt --budget 0.3GB --compile
  chkpt-opt validate chkpt_opt.zoo:gpt --budget 0.3GB --device cuda
  chkpt-opt show gpt.json
  chkpt-opt export gpt.json gpt.schedule.json --target huggingface
  chkpt-opt export gpt.json gpt.schedule.json --target snapshot -o predicted.pickle
  chkpt-opt corpus -o graphs
  chkpt-opt bench graphs/*.json --solvers greedy sqrt auto --budgets 0.9 0.5 -o results/bench
  chkpt-opt max-batch chkpt_opt.zoo:gpt --budget 1GB
  chkpt-opt solvers

A model is given as package.module:function (or path/to/file.py:function); the function
takes no arguments and returns (model, example_args) or (model, example_args, example_kwargs).

exit codes: 0 ok, 1 internal error, 2 bad input, 3 budget cannot be met, 4 model cannot be traced
"""


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _builder(module_name: str, func_name: str) -> Callable[..., Any]:
    spec = f"{module_name}:{func_name}"
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise TraceError(f"model file {module_name!r} does not exist.")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or loader_spec.loader is None:
                raise TraceError(f"cannot import {module_name!r}.")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except TraceError:
        raise
    except Exception as err:
        raise TraceError(f"cannot import {module_name!r} for model spec {spec!r}: {err}") from err
    builder = getattr(module, func_name, None)
    if not callable(builder):
        raise TraceError(f"{module_name!r} has no function {func_name!r} (model spec {spec!r}).")
    return builder


def _normalize_built(spec: str, built: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise TraceError(
            f"{spec} returned {type(built).__name__}; it must return (model, example_args) or "
            "(model, example_args, example_kwargs)."
        )
    model, args = built[0], built[1]
    kwargs = built[2] if len(built) == 3 else {}
    return model, tuple(args) if isinstance(args, (tuple, list)) else (args,), dict(kwargs or {})


def load_model_spec(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Imports ``package.module:function`` (or ``file.py:function``) and calls it.

    Raises:
        TraceError: when the spec is malformed, cannot be imported, or returns something else.
    """
    if ":" not in spec:
        raise TraceError(
            f"model spec {spec!r} must be package.module:function or path/to/file.py:function, "
            "e.g. chkpt_opt.zoo:gpt."
        )
    module_name, _, func_name = spec.rpartition(":")
    return _normalize_built(spec, _builder(module_name, func_name)())


def _emit(args: argparse.Namespace, data: dict[str, Any], lines: Sequence[str]) -> None:
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True, default=str))
    else:
        print("\n".join(lines))


def _optimizer(value: str) -> str | None:
    return None if value.lower() == "none" else value


def cmd_trace(args: argparse.Namespace) -> int:
    from chkpt_opt.graphs.io import graph_fingerprint, save_graph
    from chkpt_opt.graphs.tracer import trace_model
    from chkpt_opt.schedule import Schedule
    from chkpt_opt.simulate import simulate

    model, ex_args, ex_kwargs = load_model_spec(args.model)
    traced = trace_model(
        model,
        ex_args,
        ex_kwargs,
        name=args.name or args.model.rpartition(":")[2],
        method=args.tracer,
        progress=_Progress("tracing", not args.json),
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
    _emit(
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
    from chkpt_opt.schedule_io import save_schedule
    from chkpt_opt.solvers import get_solver

    graph = load_graph(args.graph)
    budget, static, act = activation_budget(
        graph, args.budget, optimizer=_optimizer(args.optimizer)
    )
    result = get_solver(args.solver)(graph, act, time_limit_s=args.time_limit)
    predicted = static.resident_bytes + max(result.peak_bytes, static.optimizer_phase_bytes)
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
        )
        data["schedule"] = str(args.output)
    gap = f", gap {result.gap:.2%}" if result.gap is not None else ""
    _emit(
        args,
        data,
        [
            f"budget {format_bytes(budget.total_bytes)}: "
            f"resident {format_bytes(static.resident_bytes)}, "
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
            f"{format_bytes(static.resident_bytes + result.peak_bytes)}",
            file=sys.stderr,
        )
        return EXIT_INFEASIBLE
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from chkpt_opt.graphs.io import load_graph
    from chkpt_opt.schedule import Schedule
    from chkpt_opt.schedule_io import load_schedule
    from chkpt_opt.simulate import simulate

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
    _emit(args, data, lines)
    return EXIT_OK


def _plan(args: argparse.Namespace, model: Any, ex_args: Any, ex_kwargs: Any, **extra: Any) -> Any:
    """``chkpt_opt.plan`` with the budget, solver, optimizer and time limit of the command."""
    import chkpt_opt

    return chkpt_opt.plan(
        model,
        ex_args,
        example_kwargs=ex_kwargs,
        budget=args.budget,
        solver=args.solver,
        optimizer=_optimizer(args.optimizer),
        time_limit_s=args.time_limit,
        **extra,
    )


def cmd_optimize(args: argparse.Namespace) -> int:
    import chkpt_opt
    from chkpt_opt.schedule_io import save_schedule

    model, ex_args, ex_kwargs = load_model_spec(args.model)
    plan = _plan(args, model, ex_args, ex_kwargs, tracer=args.tracer)
    data: dict[str, Any] = {
        "budget_bytes": plan.budget.total_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "forward_backward_peak_bytes": plan.profile.peak_bytes,
        "status": plan.result.status.value,
        "regions": len(plan.schedule.regions),
        "estimated_overhead": plan.profile.overhead,
    }
    lines = [plan.summary()]
    if args.output:
        save_schedule(
            args.output,
            plan.graph,
            plan.schedule,
            budget_bytes=plan.budget.total_bytes,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            solver=plan.result.solver,
            status=plan.result.status.value,
            objective_s=plan.result.objective,
        )
        data["schedule"] = str(args.output)
    if args.validate:
        optimized = plan.apply()
        report = chkpt_opt.validate(
            model, optimized, ex_args, ex_kwargs, predicted_peak_bytes=plan.profile.peak_bytes
        )
        measured = plan.static.resident_bytes + report.measured_peak_bytes
        data.update(
            measured_peak_bytes=measured,
            grads_bitwise_equal=report.grads_bitwise_equal,
            max_grad_rel_diff=report.max_grad_rel_diff,
            step_time_ratio=report.step_time_ratio,
            prediction_error=report.prediction_error,
            within_budget=measured <= plan.budget.total_bytes,
        )
        lines += [
            report.summary(),
            f"whole step measured {format_bytes(measured)} "
            f"({'within' if measured <= plan.budget.total_bytes else 'OVER'} the budget)",
        ]
    if args.plot_timeline:
        from chkpt_opt.bench.report import plot_timeline
        from chkpt_opt.measure import measure_timeline, preserved_state

        with preserved_state(model):
            measured_series = measure_timeline(plan.apply(), ex_args, ex_kwargs)
        plot_timeline(
            [p.during_bytes for p in plan.profile.timeline],
            measured_series,
            args.plot_timeline,
            title=f"{args.model} under {args.budget}",
        )
        data["timeline_plot"] = str(args.plot_timeline)
        lines.append(f"timeline plot: {args.plot_timeline}")
    _emit(args, data, lines)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from chkpt_opt.graphs.costgraph import ordered_nodes
    from chkpt_opt.graphs.io import graph_fingerprint, load_graph, read_json
    from chkpt_opt.schedule_io import load_schedule

    raw = read_json(args.file, what="file")
    if isinstance(raw, dict) and raw.get("format") == "chkpt_opt.schedule":
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
        _emit(args, data, lines)
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
    _emit(args, data, lines)
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
    _emit(args, {"written": [str(p) for p in written]}, [f"wrote {p}" for p in written])
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from chkpt_opt.bench.report import (
        latex_table,
        markdown_summary,
        plot_overhead_vs_budget,
        plot_solve_time,
    )
    from chkpt_opt.bench.sweep import make_tasks, run_sweep
    from chkpt_opt.graphs.io import load_graph
    from chkpt_opt.solvers import get_solver

    graphs = args.graphs or sorted(Path("graphs").glob("*.json"))
    if not graphs:
        raise GraphFormatError(
            "no cost graphs given and none in graphs/; run `chkpt-opt corpus` first."
        )
    for name in args.solvers:
        get_solver(name)  # unknown names fail before any work
    for path in graphs:
        load_graph(path)  # so do malformed graph files
    for fraction in args.budgets:
        if not 0 < fraction <= 1:
            raise BudgetError(f"budget fraction {fraction} must be in (0, 1].")
    tasks = make_tasks(graphs, args.solvers, args.budgets, time_limit_s=args.time_limit)
    out = Path(args.output)
    progress = _Progress("bench", not args.json)
    outcome = run_sweep(
        tasks,
        out / "results.csv",
        workers=args.workers,
        ray_address=args.ray_address,
        progress=progress,
    )
    rows = outcome.rows
    (out / "table.tex").write_text(latex_table(rows), encoding="utf-8")
    (out / "summary.md").write_text(markdown_summary(rows), encoding="utf-8")
    figures = [
        plot_overhead_vs_budget(rows, out / "overhead_vs_budget.png"),
        plot_solve_time(rows, out / "solve_time.png"),
    ]
    invalid = [r for r in rows if r["status"] == "invalid"]
    data = {
        "rows": len(rows),
        "tasks": len(tasks),
        "csv": str(out / "results.csv"),
        "table": str(out / "table.tex"),
        "figures": [str(f) for f in figures],
        "invalid": len(invalid),
        "failed": [{"task": list(key), "error": error} for key, error in outcome.failed],
    }
    _emit(
        args,
        data,
        [
            f"{len(rows)} of {len(tasks)} tasks in {out / 'results.csv'}",
            f"table: {out / 'table.tex'}",
            *[f"figure: {f}" for f in figures],
        ]
        + ([f"{len(invalid)} schedules exceed their budget in the simulator"] if invalid else [])
        + [
            f"failed (run again to retry): {'/'.join(key)}: {error}"
            for key, error in outcome.failed
        ],
    )
    return EXIT_INTERNAL if invalid or outcome.failed else EXIT_OK


def cmd_max_batch(args: argparse.Namespace) -> int:
    import functools

    from chkpt_opt.bench.max_batch import max_batch_size

    if ":" not in args.model:
        load_model_spec(args.model)  # raises the usual error
    module_name, _, func_name = args.model.rpartition(":")
    builder = _builder(module_name, func_name)

    def build(batch: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        return _normalize_built(args.model, functools.partial(builder, batch=batch)())

    result = max_batch_size(
        build,
        args.budget,
        solver=args.solver,
        optimizer=_optimizer(args.optimizer),
        max_batch=args.max_batch,
        time_limit_s=args.time_limit,
    )
    data = {
        "budget_bytes": result.budget_bytes,
        "with_plan": result.with_plan,
        "without_checkpointing": result.without_checkpointing,
        "gain": result.gain,
        "solver": result.solver,
        "probes": result.probes,
    }
    gain = f" ({result.gain:.2f}x)" if result.gain else ""
    _emit(
        args,
        data,
        [
            f"budget {format_bytes(result.budget_bytes)}: largest batch without checkpointing "
            f"{result.without_checkpointing}, "
            f"with the {result.solver} plan {result.with_plan}{gain}",
        ],
    )
    return EXIT_OK if result.with_plan else EXIT_INFEASIBLE


def cmd_export(args: argparse.Namespace) -> int:
    from chkpt_opt.graphs.io import load_graph
    from chkpt_opt.schedule_io import load_schedule

    graph = load_graph(args.graph)
    loaded = load_schedule(args.schedule)
    loaded.check_against(graph)
    if args.target == "snapshot":
        from chkpt_opt.export.snapshot import save_predicted_snapshot

        output = args.output or Path("predicted_snapshot.pickle")
        save_predicted_snapshot(output, graph, loaded.schedule)
        _emit(
            args,
            {"snapshot": str(output)},
            [f"wrote {output}: open it at https://pytorch.org/memory_viz beside a real snapshot"],
        )
        return EXIT_OK
    from chkpt_opt.export.layers import lower_to_layers

    budget = loaded.meta.get("activation_budget_bytes")
    try:
        lowering = lower_to_layers(
            graph,
            loaded.schedule,
            target=args.target,
            budget_bytes=budget if isinstance(budget, int) else None,
        )
    except ValueError as err:
        raise ScheduleError(str(err)) from None
    data = {
        "target": lowering.target,
        "settings": lowering.settings,
        "layers": list(lowering.layers),
        "exact": lowering.exact,
        "exact_peak_bytes": lowering.exact_peak_bytes,
        "lowered_peak_bytes": lowering.lowered_peak_bytes,
        "exact_overhead": lowering.exact_overhead,
        "lowered_overhead": lowering.lowered_overhead,
        "notes": list(lowering.notes),
    }
    if args.output:
        from chkpt_opt.graphs.io import write_json_atomic

        write_json_atomic(args.output, data)
    _emit(
        args,
        data,
        [
            f"{lowering.target}: {json.dumps(lowering.settings)}",
            f"forward/backward peak: exact {format_bytes(lowering.exact_peak_bytes)}, lowered "
            f"{format_bytes(lowering.lowered_peak_bytes)}; extra compute: exact "
            f"{lowering.exact_overhead:.1%}, lowered {lowering.lowered_overhead:.1%}",
            *[f"note: {note}" for note in lowering.notes],
        ],
    )
    return EXIT_OK


def _to_device(value: Any, device: str) -> Any:
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def cmd_validate(args: argparse.Namespace) -> int:
    import torch

    import chkpt_opt

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ChkptOptError(
            f"--device {args.device} was asked for, but no CUDA device is available."
        )
    if args.compile and args.device != "cpu":
        print(
            f"chkpt-opt: --compile measures with the CPU allocator's events; drop --device "
            f"{args.device} or --compile.",
            file=sys.stderr,
        )
        return EXIT_INPUT
    model, ex_args, ex_kwargs = load_model_spec(args.model)
    model = model.to(args.device)
    ex_args, ex_kwargs = _to_device(ex_args, args.device), _to_device(ex_kwargs, args.device)
    plan = _plan(args, model, ex_args, ex_kwargs, profile_times=args.profile_times)
    report = chkpt_opt.validate(
        model,
        plan.apply(),
        ex_args,
        ex_kwargs,
        predicted_peak_bytes=plan.profile.peak_bytes,
        repeats=args.repeats,
    )
    measured = plan.static.resident_bytes + report.measured_peak_bytes
    ok = measured <= plan.budget.total_bytes and abs(report.prediction_error or 0) <= args.tolerance
    data = {
        "device": report.device,
        "budget_bytes": plan.budget.total_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": measured,
        "forward_backward_predicted_bytes": plan.profile.peak_bytes,
        "forward_backward_measured_bytes": report.measured_peak_bytes,
        "baseline_forward_backward_bytes": report.baseline_peak_bytes,
        "prediction_error": report.prediction_error,
        "step_time_ratio": report.step_time_ratio,
        "grads_bitwise_equal": report.grads_bitwise_equal,
        "max_grad_rel_diff": report.max_grad_rel_diff,
        "within_budget": measured <= plan.budget.total_bytes,
    }
    lines = [plan.summary(), report.summary()]
    if args.compile:
        from chkpt_opt.export.compiled import measure_compiled

        compiled = measure_compiled(plan, ex_args, ex_kwargs)
        ok = ok and compiled.meets_budget
        data["compiled"] = {
            **dataclasses.asdict(compiled),
            "meets_budget": compiled.meets_budget,
            "notes": list(compiled.notes),
        }
        lines += [
            f"compiled: forward+backward {format_bytes(compiled.compiled_peak_bytes)} "
            f"(eager {format_bytes(compiled.eager_peak_bytes)}, may use "
            f"{format_bytes(compiled.budget_dynamic_bytes)})",
            *(f"  {note}" for note in compiled.notes),
        ]
    data["passed"] = ok
    lines.append(
        f"whole step: measured {format_bytes(measured)} vs budget "
        f"{format_bytes(plan.budget.total_bytes)} -> {'PASS' if ok else 'FAIL'}"
    )
    _emit(args, data, lines)
    return EXIT_OK if ok else EXIT_INTERNAL


def cmd_solvers(args: argparse.Namespace) -> int:
    from chkpt_opt.solvers import available_solvers

    solvers = available_solvers()
    _emit(args, {"solvers": solvers}, [f"{k:<12} {v}" for k, v in solvers.items()])
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chkpt-opt",
        description="Optimal activation-checkpointing schedules for PyTorch training.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help_text: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=EXAMPLES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.set_defaults(func=func)
        return p

    p = add("trace", cmd_trace, "trace a model into a cost graph JSON file")
    p.add_argument("model", help="package.module:function returning (model, args[, kwargs])")
    p.add_argument("-o", "--output", required=True, type=Path, help="graph JSON file to write")
    p.add_argument("--name", help="graph name (default: the function's name)")
    p.add_argument("--tracer", default="auto", choices=["auto", "export", "fx"])

    def budget_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--budget", required=True, help='whole-step budget: "20GB", "20GiB", bytes, "80%%"'
        )
        p.add_argument("--solver", default="auto", help="solver name (see `chkpt-opt solvers`)")
        p.add_argument(
            "--optimizer", default="adamw", help="optimizer whose state to count, or none"
        )
        p.add_argument("--time-limit", type=float, default=None, help="solver time limit, seconds")

    p = add("solve", cmd_solve, "solve a cost graph for a budget")
    p.add_argument("graph", type=Path)
    budget_args(p)
    p.add_argument("-o", "--output", type=Path, help="schedule JSON file to write")

    p = add("simulate", cmd_simulate, "simulate a schedule (or keeping everything) on a graph")
    p.add_argument("graph", type=Path)
    p.add_argument(
        "schedule", type=Path, nargs="?", help="schedule JSON (default: keep everything)"
    )
    p.add_argument("--timeline", action="store_true", help="print the memory at every step")

    p = add("optimize", cmd_optimize, "trace, solve and (optionally) validate a model")
    p.add_argument("model", help="package.module:function returning (model, args[, kwargs])")
    budget_args(p)
    p.add_argument("--tracer", default="auto", choices=["auto", "export", "fx"])
    p.add_argument("--validate", action="store_true", help="run and measure the optimized step")
    p.add_argument("--plot-timeline", type=Path, help="PNG: predicted vs measured memory timeline")
    p.add_argument("-o", "--output", type=Path, help="schedule JSON file to write")

    p = add("show", cmd_show, "describe a cost graph or schedule file")
    p.add_argument("file", type=Path)
    p.add_argument("--top", type=int, default=10, help="ops to list")

    p = add(
        "bench",
        cmd_bench,
        "sweep solvers x graphs x budgets into a CSV, a LaTeX table and plots; run again with "
        "the same -o to resume (only missing or failed tasks run)",
    )
    p.add_argument("graphs", nargs="*", type=Path, help="cost graph files (default: graphs/*.json)")
    p.add_argument(
        "--solvers",
        nargs="+",
        default=["greedy", "sqrt", "auto"],
        help="registered names (see `chkpt-opt solvers`)",
    )
    p.add_argument(
        "--budgets",
        nargs="+",
        type=float,
        default=[0.9, 0.7, 0.5, 0.3],
        help="fractions of the store-everything peak",
    )
    p.add_argument("--time-limit", type=float, default=60.0, help="per-solve time limit, seconds")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("results/bench"),
        help="folder for results.csv, table.tex, summary.md and the figures",
    )
    p.add_argument(
        "--workers", type=int, default=None, help="local processes (default: one per CPU)"
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="run on this Ray cluster instead (host:port, as `ray status` prints it)",
    )

    p = add("max-batch", cmd_max_batch, "largest batch that fits a budget, with and without a plan")
    p.add_argument(
        "model", help="package.module:function taking batch= and returning (model, args[, kwargs])"
    )
    budget_args(p)
    p.add_argument("--max-batch", type=int, default=4096)

    p = add(
        "export", cmd_export, "lower a schedule for a trainer, or write the memory-viewer snapshot"
    )
    p.add_argument("graph", type=Path)
    p.add_argument("schedule", type=Path)
    p.add_argument(
        "--target", required=True, choices=["huggingface", "torchtitan", "megatron", "snapshot"]
    )
    p.add_argument(
        "-o", "--output", type=Path, help="file to write (JSON settings or snapshot pickle)"
    )

    p = add("validate", cmd_validate, "plan, run and measure a model on a device (cpu or cuda)")
    p.add_argument("model", help="package.module:function returning (model, args[, kwargs])")
    budget_args(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--tolerance", type=float, default=0.05, help="allowed |predicted-measured|/measured"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed steps per module")
    p.add_argument(
        "--profile-times", action="store_true", help="time ops on the device for the solver"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run the plan under torch.compile (chkpt_opt.compile_module) and require "
        "the compiled step to fit the budget (CPU)",
    )

    p = add("corpus", cmd_corpus, "regenerate the benchmark corpus of cost graphs")
    p.add_argument(
        "-o", "--output", type=Path, default=Path("graphs"), help="directory (default graphs/)"
    )
    p.add_argument("--only", nargs="*", help="corpus entries to regenerate (default all)")

    add("solvers", cmd_solvers, "list the registered solvers")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``chkpt-opt``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )
    try:
        return int(args.func(args))
    except InfeasibleBudgetError as err:
        print(f"chkpt-opt: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except TraceError as err:
        print(f"chkpt-opt: {err}", file=sys.stderr)
        return EXIT_TRACE
    except (BudgetError, GraphFormatError, ScheduleError, SolverError, SweepError) as err:
        print(f"chkpt-opt: {err}", file=sys.stderr)
        return EXIT_INPUT
    except ChkptOptError as err:
        print(f"chkpt-opt: {err}", file=sys.stderr)
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        print("chkpt-opt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
