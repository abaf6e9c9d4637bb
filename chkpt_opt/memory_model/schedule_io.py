"""Schedule files: a versioned JSON record of a solved schedule and what it was made for.

Example of the content::

    {"format": "chkpt_opt.memory_model.schedule", "format_version": 1,
     "graph": {"name": "GPT", "fingerprint": "3f2a...", "nodes": 202},
     "budget_bytes": 200000000, "activation_budget_bytes": 110000000,
     "predicted_peak_bytes": 96600000, "solver": "auto", "status": "feasible",
     "objective_s": 0.31, "bound_s": null,
     "schedule": {"kind": "keep_set", "regions": [["linear", "relu"], ...]}}

A schedule with nested regions or cached ops is written as version 2, with
``"schedule": {"kind": "regions", "regions": [...], "nested": [...], "saved": [...]}``
(``schemas/schedule-v2.schema.json``). A schedule with unpacked ops (recompute on unpack)
is written as version 3, its schedule with ``"unpacked": [...]`` beside those
(``schemas/schedule-v3.schema.json``). A staged schedule is written as version 4:
``"schedule": {"kind": "staged", "recompute": [[backward op, [forward ops]], ...]}``
(``schemas/schedule-v4.schema.json``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chkpt_opt.errors import ScheduleError, short
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import GraphFormatError, graph_fingerprint, read_json, write_json_atomic
from chkpt_opt.memory_model.schedule import Schedule, check_schedule

SCHEDULE_FORMAT = "chkpt_opt.memory_model.schedule"
SCHEDULE_VERSION = 2
"""The version written for schedules beyond keep-set (nested regions, cached ops); a
keep-set schedule is written as version 1, which every reader of version 1 reads."""
UNPACKED_VERSION = 3
"""The version written for schedules with unpacked ops (what readers of version 2 lack)."""
STAGED_VERSION = 4
"""The version written for staged schedules (what readers of version 3 lack)."""
READ_VERSIONS = (1, 2, 3, 4)


def file_version(schedule: Schedule) -> int:
    """The oldest file version that can hold ``schedule``."""
    if schedule.staged:
        return STAGED_VERSION
    if schedule.unpacked:
        return UNPACKED_VERSION
    return 1 if schedule.is_keep_set() else SCHEDULE_VERSION


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
                f"this schedule was made for graph {short(self.graph_name)} with fingerprint "
                f"{self.fingerprint}, but the graph given has fingerprint {found} "
                f"({graph.graph.get('name')!r}): another model, or other input shapes. Solve "
                "again for this model and these shapes."
            )
        check_schedule(graph, self.schedule)


def save_schedule(path: str | Path, graph: CostGraph, schedule: Schedule, **meta: Any) -> None:
    """Writes a schedule file (atomically)."""
    data = {
        "format": SCHEDULE_FORMAT,
        "format_version": file_version(schedule),
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
    version = data.get("format_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise ScheduleError(
            f"{where} has format_version {short(version)}; this chkpt_opt reads versions "
            f"{list(READ_VERSIONS)}. Solve again with this version."
        )
    graph = data.get("graph")
    if not isinstance(graph, dict) or not isinstance(graph.get("fingerprint"), str):
        raise ScheduleError(f"{where} lacks the graph it was made for (graph.fingerprint).")
    _check_fields(data, where)
    try:
        schedule = Schedule.from_dict(data.get("schedule"))
    except ScheduleError as err:
        raise ScheduleError(f"{where}: {err}") from None
    if version < file_version(schedule):
        raise ScheduleError(
            f"{where} says format_version {version} but holds "
            f"{_what_needs(schedule)}, "
            f"which version {version} cannot express; write it as version "
            f"{file_version(schedule)}."
        )
    meta = {
        k: v for k, v in data.items() if k not in ("format", "format_version", "graph", "schedule")
    }
    return ScheduleFile(schedule, str(graph.get("name", "")), graph["fingerprint"], meta)


def _what_needs(schedule: Schedule) -> str:
    """What in ``schedule`` needs its file version, in words."""
    if schedule.staged:
        return "a staged schedule"
    return "unpacked ops" if schedule.unpacked else "nested regions or cached ops"


_INT_FIELDS = {
    "budget_bytes": 1,
    "activation_budget_bytes": 0,
    "predicted_peak_bytes": 0,
    "forward_backward_peak_bytes": 0,
    "resident_bytes": 0,
}
_STATUSES = ("optimal", "feasible", "infeasible", "timed_out")


def _check_fields(data: dict[str, Any], where: str) -> None:
    """Checks the recorded fields as ``schemas/schedule-v4.schema.json`` does."""

    def fail(field: str, expected: str) -> ScheduleError:
        return ScheduleError(
            f"{where}: field {field!r} must be {expected}, got {short(data_at(field))}."
        )

    def data_at(field: str) -> Any:
        value: Any = data
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    graph = data["graph"]
    if not isinstance(graph.get("name"), str):
        raise fail("graph.name", "a string")
    nodes = graph.get("nodes")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
        raise fail("graph.nodes", "an int >= 0")
    if not re.fullmatch(r"[0-9a-f]{16}", graph["fingerprint"]):
        raise fail("graph.fingerprint", "16 hexadecimal digits")
    for field, low in _INT_FIELDS.items():
        if field in data:
            value = data[field]
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise fail(field, f"an int >= {low}")
    if "status" in data and data["status"] not in _STATUSES:
        raise fail("status", f"one of {list(_STATUSES)}")
    for field in ("objective_s", "bound_s"):
        value = data.get(field)
        if value is None and (field == "bound_s" or field not in data):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise fail(field, "a number >= 0")
    for field in ("solver", "torch_version", "chkpt_opt_version"):
        if field in data and not isinstance(data[field], str):
            raise fail(field, "a string")
    # The keys of the schedule itself are checked by Schedule.from_dict.
