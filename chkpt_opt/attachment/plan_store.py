"""Plans kept on disk across restarts: a schedule file per graph and settings.

A file's name is a hash of what a plan depends on: the cost graph's fingerprint (model and
shapes), the budget in bytes, the optimizer, the solver, whether op times were measured,
and the versions of torch and chkpt_opt. A resumed job finds the plan its first run made
and skips the solve; a file that no longer matches its graph is ignored.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from chkpt_opt.errors import ChkptOptError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import graph_fingerprint
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.schedule_io import load_schedule

log = logging.getLogger(__name__)


def plan_path(directory: Path, graph: CostGraph, settings: tuple[object, ...]) -> Path:
    """Where the plan of ``graph`` under ``settings`` is kept in ``directory``."""
    from chkpt_opt import __version__

    text = "|".join(map(str, (graph_fingerprint(graph), *settings, torch.__version__, __version__)))
    return directory / f"plan-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"


def load_stored(path: Path, graph: CostGraph) -> Schedule | None:
    """The schedule stored at ``path`` for ``graph``, or None when there is none or it was
    made for another graph (logged)."""
    if not path.exists():
        return None
    try:
        stored = load_schedule(path)
        stored.check_against(graph)
    except ChkptOptError as err:
        log.warning("ignoring the stored plan %s: %s", path, err)
        return None
    return stored.schedule
