"""Commands on a model spec: optimize, validate, max-batch (trace and plan in one go)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from chkpt_opt.cli.model_spec import builder, call_builder, load_model_spec, normalize_built
from chkpt_opt.cli.output import (
    EXIT_INFEASIBLE,
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_OK,
    emit,
    optimizer_arg,
    sharding_arg,
)
from chkpt_opt.errors import ChkptOptError
from chkpt_opt.step_budget.budget import format_bytes


def _plan(args: argparse.Namespace, model: Any, ex_args: Any, ex_kwargs: Any, **extra: Any) -> Any:
    """``chkpt_opt.plan`` with the budget, solver, optimizer and time limit of the command."""
    import chkpt_opt

    return chkpt_opt.plan(
        model,
        ex_args,
        example_kwargs=ex_kwargs,
        budget=args.budget,
        solver=args.solver,
        optimizer=optimizer_arg(args.optimizer),
        time_limit_s=args.time_limit,
        sharding=sharding_arg(args),
        **extra,
    )


def cmd_optimize(args: argparse.Namespace) -> int:
    from chkpt_opt.validation import validate as run_validation

    if args.validate and args.world_size is not None:
        print(
            "chkpt-opt: --validate runs the step on one device, which a per-rank plan "
            "(--world-size) does not describe; drop one of them (a sharded plan is checked "
            "under FSDP2 itself: docs/sharded.md).",
            file=sys.stderr,
        )
        return EXIT_INPUT
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
        plan.save(args.output)
        data["schedule"] = str(args.output)
    if args.validate:
        optimized = plan.apply()
        report = run_validation(
            model, optimized, ex_args, ex_kwargs, predicted_peak_bytes=plan.profile.peak_bytes
        )
        measured = plan.static.resident_bytes + report.measured_peak_bytes
        data.update(
            measured_peak_bytes=measured,
            grads_bitwise_equal=report.grads_bitwise_equal,
            max_grad_rel_diff=report.max_grad_rel_diff,
            step_time_ratio=report.step_time_ratio,
            step_time_ratio_spread=report.step_time_ratio_spread,
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
        from chkpt_opt.measurement.module_state import preserved_state
        from chkpt_opt.measurement.step import measure_timeline

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
    emit(args, data, lines)
    return EXIT_OK


def _to_device(value: Any, device: str) -> Any:
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def cmd_validate(args: argparse.Namespace) -> int:
    import torch

    from chkpt_opt.validation import validate as run_validation

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
    report = run_validation(
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
        "step_time_ratio_spread": report.step_time_ratio_spread,
        "time_rounds": report.time_rounds,
        "grads_bitwise_equal": report.grads_bitwise_equal,
        "grads_missing": list(report.grads_missing),
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
    emit(args, data, lines)
    return EXIT_OK if ok else EXIT_INTERNAL


def cmd_max_batch(args: argparse.Namespace) -> int:
    from chkpt_opt.bench.max_batch import max_batch_size

    if ":" not in args.model:
        load_model_spec(args.model)  # raises the usual error
    module_name, _, func_name = args.model.rpartition(":")
    make = builder(module_name, func_name)

    def build(batch: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        return normalize_built(args.model, call_builder(args.model, make, batch=batch))

    result = max_batch_size(
        build,
        args.budget,
        solver=args.solver,
        optimizer=optimizer_arg(args.optimizer),
        max_batch=args.max_batch,
        time_limit_s=args.time_limit,
        outputs_held=not args.outputs_dropped,
    )
    data = {
        "budget_bytes": result.budget_bytes,
        "with_plan": result.with_plan,
        "without_checkpointing": result.without_checkpointing,
        "gain": result.gain,
        "solver": result.solver,
        "probes": result.probes,
        "proven_infeasible": result.proven_infeasible,
    }
    gain = f" ({result.gain:.2f}x)" if result.gain else ""
    above = result.next_batch
    beyond = ""
    if above is not None:
        limit = "the solver's default" if args.time_limit is None else f"{args.time_limit:g} s"
        beyond = (
            f"; batch {above[0]}: no schedule fits (proven)"
            if above[1]
            else f"; batch {above[0]}: no schedule found in {limit} (not proven that none fits)"
        )
    emit(
        args,
        data,
        [
            f"budget {format_bytes(result.budget_bytes)}: largest batch without checkpointing "
            f"{result.without_checkpointing}, "
            f"with the {result.solver} plan {result.with_plan}{gain}{beyond}",
        ],
    )
    return EXIT_OK if result.with_plan else EXIT_INFEASIBLE
