"""Schedule files: a versioned JSON record of a solved schedule and what it was made for.

Example of the content::

    {"format": "chkpt_opt.schedule", "format_version": 1,
     "graph": {"name": "GPT", "fingerprint": "3f2a...", "nodes": 202},
     "budget_bytes": 200000000, "activation_budget_bytes": 110000000,
     "predicted_peak_bytes": 96600000, "solver": "auto", "status": "feasible",
     "objective_s": 0.31, "bound_s": null,
     "schedule": {"kind": "keep_set", "regions": [["linear", "relu"], ...]}}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import GraphFormatError, graph_fingerprint, read_json, write_json_atomic
from chkpt_opt.schedule import Schedule, check_schedule

SCHEDULE_FORMAT = "chkpt_opt.schedule"
SCHEDULE_VERSION = 1


@dataclass(frozen=True)
class ScheduleFile:
    """A schedule with its provenance.

    Attributes:
        schedule: the schedule.
        graph_name: name of the graph it was solved for.
        fingerprint: that graph's :func:`~chkpt_opt.graphs.io.graph_fingerprint`.
        meta: the other recorded fields (budget, prediction, solver, status...).
    """

    schedule: Schedule
    graph_name: str
    fingerprint: str
    meta: dict[str, Any]

    def check_against(self, graph: CostGraph) -> None:
        """Raises ScheduleError if the file was made for another graph (model or shapes)."""
        found = graph_fingerprint(graph)
        if found != self.fingerprint:
            raise ScheduleError(
                f"this schedule was made for graph {self.graph_name!r} with fingerprint "
                f"{self.fingerprint}, but the graph given has fingerprint {found} "
                f"({graph.graph.get('name')!r}): another model, or other input shapes. Solve "
                "again for this model and these shapes."
            )
        check_schedule(graph, self.schedule)


def save_schedule(path: str | Path, graph: CostGraph, schedule: Schedule, **meta: Any) -> None:
    """Writes a schedule file (atomically)."""
    data = {
        "format": SCHEDULE_FORMAT,
        "format_version": SCHEDULE_VERSION,
        "graph": {
            "name": graph.graph.get("name", ""),
            "fingerprint": graph_fingerprint(graph),
            "nodes": graph.number_of_nodes(),
        },
        **meta,
        "schedule": schedule.to_dict(),
    }
    write_json_atomic(path, data)


def load_schedule(path: str | Path) -> ScheduleFile:
    """Reads a schedule file, refusing other formats and versions with a clear error."""
    where = f"schedule file {str(path)!r}"
    try:
        data = read_json(path, what="schedule file")
    except GraphFormatError as err:
        raise ScheduleError(str(err)) from None
    if not isinstance(data, dict) or data.get("format") != SCHEDULE_FORMAT:
        raise ScheduleError(
            f'{where} is not a chkpt_opt schedule (expected "format": "{SCHEDULE_FORMAT}").'
        )
    if data.get("format_version") != SCHEDULE_VERSION:
        raise ScheduleError(
            f"{where} has format_version {data.get('format_version')!r}; this chkpt_opt reads "
            f"version {SCHEDULE_VERSION}. Solve again with this version."
        )
    graph = data.get("graph")
    if not isinstance(graph, dict) or not isinstance(graph.get("fingerprint"), str):
        raise ScheduleError(f"{where} lacks the graph it was made for (graph.fingerprint).")
    schedule = Schedule.from_dict(data.get("schedule"))
    meta = {
        k: v for k, v in data.items() if k not in ("format", "format_version", "graph", "schedule")
    }
    return ScheduleFile(schedule, str(graph.get("name", "")), graph["fingerprint"], meta)
