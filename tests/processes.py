"""Child processes of the test process, for tests that nothing chkpt_opt starts outlives it."""

from __future__ import annotations

import os
from pathlib import Path


def child_pids() -> set[int]:
    """The process ids of this process's children, reaped or not (Linux), read per thread:
    a thread that ends while they are read is skipped (CI once met one, a solver's or a
    progress bar's, gone between the listing and the read)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return pids


def new_child_pids(before: set[int]) -> set[int]:
    """The children alive now that were not in ``before`` (earlier tests in the same worker
    may have left their own, such as multiprocessing's resource tracker)."""
    return child_pids() - before
