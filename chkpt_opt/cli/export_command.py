"""The export command: a schedule lowered to a trainer's settings, or a predicted snapshot."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from chkpt_opt.cli.output import EXIT_INFEASIBLE, EXIT_OK, emit
from chkpt_opt.errors import ScheduleError
from chkpt_opt.step_budget.budget import format_bytes

if TYPE_CHECKING:
    from chkpt_opt.export.layers import Lowering


def over_budget_message(lowering: Lowering, schedule_path: Path, step_budget: object) -> str:
    """The one line that says a lowering misses the budget its schedule was solved for.

    ``step_budget`` is the whole-step budget the schedule file records (if an int, the
    advice names the whole-step budget to ask for).
    """
    over = lowering.over_budget_bytes
    allowed = lowering.lowered_peak_bytes - over
    fits = (
        f" ({format_bytes(lowering.exact_peak_bytes)}, it fits)"
        if lowering.exact_peak_bytes <= allowed
        else ""
    )
    raise_to = (
        f"to at least {format_bytes(step_budget + over)} for the whole step "
        f"(--budget {step_budget + over}B)"
        if isinstance(step_budget, int)
        else f"by at least {format_bytes(over)}"
    )
    return (
        f"the {lowering.target} lowering of {schedule_path} (whole-layer checkpointing) peaks "
        f"at {format_bytes(lowering.lowered_peak_bytes)} in forward/backward, over the "
        f"{format_bytes(allowed)} the schedule was solved for by "
        f"{format_bytes(over)}; raise the budget {raise_to} and solve again, or run the exact "
        f"schedule{fits} through chkpt_opt's own apply (chkpt_opt.optimize, or Plan.apply); "
        "no settings file was written."
    )


def cmd_export(args: argparse.Namespace) -> int:
    from chkpt_opt.graphs.io import load_graph
    from chkpt_opt.memory_model.schedule_io import load_schedule
    from chkpt_opt.step_budget.sharding import per_rank_graph, sharding_from_meta

    graph = load_graph(args.graph)
    loaded = load_schedule(args.schedule)
    loaded.check_against(graph)
    # A schedule solved for one rank is lowered on that rank's graph (its gradients resident).
    graph = per_rank_graph(graph, sharding_from_meta(loaded.meta))
    if args.target == "snapshot":
        from chkpt_opt.export.snapshot import save_predicted_snapshot

        output = args.output or Path("predicted_snapshot.pickle")
        save_predicted_snapshot(output, graph, loaded.schedule)
        emit(
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
        "budget_bytes": lowering.budget_bytes,
        "meets_budget": lowering.meets_budget,
    }
    notes = list(lowering.notes)
    if lowering.budget_bytes is None:
        notes.append(
            f"{args.schedule} records no forward/backward budget; the lowering was not checked "
            "against one"
        )
    lines = [
        f"{lowering.target}: {json.dumps(lowering.settings)}",
        f"forward/backward peak: exact {format_bytes(lowering.exact_peak_bytes)}, lowered "
        f"{format_bytes(lowering.lowered_peak_bytes)}"
        + (
            f" (budget {format_bytes(lowering.budget_bytes)})"
            if lowering.budget_bytes is not None
            else ""
        )
        + f"; extra compute: exact {lowering.exact_overhead:.1%}, lowered "
        f"{lowering.lowered_overhead:.1%}",
        *[f"note: {note}" for note in notes],
    ]
    if not lowering.meets_budget:
        # As `solve` does with no schedule in the budget: show the numbers, write nothing,
        # and exit with the code of a budget that cannot be met.
        emit(args, data, lines)
        step_budget = loaded.meta.get("budget_bytes")
        print(
            f"chkpt-opt: {over_budget_message(lowering, args.schedule, step_budget)}",
            file=sys.stderr,
        )
        return EXIT_INFEASIBLE
    if args.output:
        from chkpt_opt.graphs.io import write_json_atomic

        write_json_atomic(args.output, data)
    emit(args, data, lines)
    return EXIT_OK
