"""Child processes of the test process, for tests that nothing chkpt_opt starts outlives it."""

from __future__ import annotations

import os
from pathlib import Path


def child_pids() -> set[int]:
    """The process ids of this process's children, reaped or not (Linux)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    return {int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()}


def new_child_pids(before: set[int]) -> set[int]:
    """The children alive now that were not in ``before`` (earlier tests in the same worker
    may have left their own, such as multiprocessing's resource tracker)."""
    return child_pids() - before
