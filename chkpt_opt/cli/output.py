"""What every command shares on the way out: exit codes, JSON or text, the progress bar."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

EXIT_OK, EXIT_INTERNAL, EXIT_INPUT, EXIT_INFEASIBLE, EXIT_TRACE = 0, 1, 2, 3, 4


class Progress:
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


def emit(args: argparse.Namespace, data: dict[str, Any], lines: Sequence[str]) -> None:
    """Prints ``data`` as JSON under ``--json``, else the human-readable ``lines``."""
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True, default=str))
    else:
        print("\n".join(lines))


def optimizer_arg(value: str) -> str | None:
    """The ``--optimizer`` value as the API takes it (``none`` counts no optimizer state)."""
    return None if value.lower() == "none" else value


def sharding_arg(args: argparse.Namespace) -> Any:
    """The :class:`~chkpt_opt.step_budget.sharding.Sharding` of ``--world-size``/``--sharding``
    (None without ``--world-size``; ``--sharding`` alone is refused)."""
    from chkpt_opt.errors import BudgetError
    from chkpt_opt.step_budget.sharding import Sharding

    world = getattr(args, "world_size", None)
    if world is None:
        if getattr(args, "sharding", None) is not None:
            raise BudgetError(
                f"--sharding {args.sharding} needs --world-size N, the number of ranks."
            )
        return None
    return Sharding(
        world_size=world,
        strategy=args.sharding or "fsdp2",
        reshard_after_forward=args.reshard_after_forward,
        master_element_bytes=args.master_element_bytes,
    )
