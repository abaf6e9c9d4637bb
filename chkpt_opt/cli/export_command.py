"""The export command: a schedule lowered to a trainer's settings, or a predicted snapshot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from chkpt_opt.budget import format_bytes
from chkpt_opt.cli.output import EXIT_OK, emit
from chkpt_opt.errors import ScheduleError


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
    }
    if args.output:
        from chkpt_opt.graphs.io import write_json_atomic

        write_json_atomic(args.output, data)
    emit(
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
