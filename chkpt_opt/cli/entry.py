"""``main``: parses the command line, runs the command, and maps errors to exit codes."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from chkpt_opt.cli.output import EXIT_INFEASIBLE, EXIT_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_TRACE
from chkpt_opt.cli.parser import build_parser
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
