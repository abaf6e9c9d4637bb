"""The argument grammar of ``chkpt-opt``: every subcommand, its options and its help text.

The commands themselves live in one module per group (graph files, model specs, export,
bench); this module only wires each subcommand to its ``cmd_*`` function.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from chkpt_opt.cli.bench_command import cmd_bench
from chkpt_opt.cli.export_command import cmd_export
from chkpt_opt.cli.graph_commands import (
    cmd_corpus,
    cmd_show,
    cmd_simulate,
    cmd_solve,
    cmd_solvers,
    cmd_trace,
)
from chkpt_opt.cli.model_commands import cmd_max_batch, cmd_optimize, cmd_validate

EXAMPLES = """examples:
  chkpt-opt trace chkpt_opt.zoo:gpt -o gpt.json
  chkpt-opt solve gpt.json --budget 200MB --solver auto -o gpt.schedule.json
  chkpt-opt simulate gpt.json gpt.schedule.json --timeline
  chkpt-opt optimize chkpt_opt.zoo:resnet --budget 0.1GiB --validate
  chkpt-opt optimize chkpt_opt.zoo:gpt --budget 0.1GB --world-size 8 --sharding fsdp2
  chkpt-opt validate chkpt_opt.zoo:gpt --budget 0.3GB --compile
  chkpt-opt validate chkpt_opt.zoo:gpt --budget 0.3GB --device cuda
  chkpt-opt show gpt.json
  chkpt-opt export gpt.json gpt.schedule.json --target huggingface
  chkpt-opt export gpt.json gpt.schedule.json --target snapshot -o predicted.pickle
  chkpt-opt corpus -o graphs
  chkpt-opt bench graphs/*.json --solvers greedy sqrt auto --budgets 0.9 0.5 -o results/bench
  chkpt-opt max-batch chkpt_opt.zoo:gpt --budget 1GB
  chkpt-opt solvers

A model is given as package.module:function (or path/to/file.py:function); the function
takes no arguments and returns (model, example_args) or (model, example_args, example_kwargs).

exit codes: 0 ok, 1 internal error, 2 bad input, 3 budget cannot be met (by any schedule, or
by an export target's per-layer lowering), 4 model cannot be loaded (its function raises,
returns something else) or traced
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``chkpt-opt`` parser; each subcommand sets ``func``, its ``cmd_*`` function."""
    parser = argparse.ArgumentParser(
        prog="chkpt-opt",
        description="Optimal activation-checkpointing schedules for PyTorch training.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help_text: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=EXAMPLES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.set_defaults(func=func)
        return p

    p = add("trace", cmd_trace, "trace a model into a cost graph JSON file")
    p.add_argument("model", help="package.module:function returning (model, args[, kwargs])")
    p.add_argument("-o", "--output", required=True, type=Path, help="graph JSON file to write")
    p.add_argument("--name", help="graph name (default: the function's name)")
    p.add_argument("--tracer", default="auto", choices=["auto", "export", "fx"])

    def budget_args(p: argparse.ArgumentParser, *, sharded: bool = True) -> None:
        p.add_argument(
            "--budget",
            required=True,
            type=budget_arg,
            help='whole-step budget: "20GB", "20GiB", bytes (a plain integer), "80%%"',
        )
        p.add_argument("--solver", default="auto", help="solver name (see `chkpt-opt solvers`)")
        p.add_argument(
            "--optimizer", default="adamw", help="optimizer whose state to count, or none"
        )
        p.add_argument("--time-limit", type=float, default=None, help="solver time limit, seconds")
        if not sharded:
            return
        p.add_argument(
            "--world-size",
            type=int,
            default=None,
            help="ranks of sharded training: --budget is then per rank, the model's inputs "
            "one rank's local batch",
        )
        p.add_argument(
            "--sharding", choices=["fsdp2", "ddp"], default=None, help="with --world-size"
        )
        p.add_argument(
            "--reshard-after-forward",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="FSDP2's setting for the layer units (default: on)",
        )
        p.add_argument(
            "--master-element-bytes",
            type=int,
            default=None,
            help="bytes per element of the sharded parameters, gradients and optimizer "
            "states where they differ from the traced model's (4: fp32 master weights of "
            "a bf16 model)",
        )

    p = add("solve", cmd_solve, "solve a cost graph for a budget")
    p.add_argument("graph", type=Path)
    budget_args(p)
    p.add_argument("-o", "--output", type=Path, help="schedule JSON file to write")

    p = add("simulate", cmd_simulate, "simulate a schedule (or keeping everything) on a graph")
    p.add_argument("graph", type=Path)
    p.add_argument(
        "schedule", type=Path, nargs="?", help="schedule JSON (default: keep everything)"
    )
    p.add_argument("--timeline", action="store_true", help="print the memory at every step")

    p = add("optimize", cmd_optimize, "trace, solve and (optionally) validate a model")
    p.add_argument("model", help="package.module:function returning (model, args[, kwargs])")
    budget_args(p)
    p.add_argument("--tracer", default="auto", choices=["auto", "export", "fx"])
    p.add_argument("--validate", action="store_true", help="run and measure the optimized step")
    p.add_argument("--plot-timeline", type=Path, help="PNG: predicted vs measured memory timeline")
    p.add_argument("-o", "--output", type=Path, help="schedule JSON file to write")

    p = add("show", cmd_show, "describe a cost graph or schedule file")
    p.add_argument("file", type=Path)
    p.add_argument("--top", type=int, default=10, help="ops to list")

    p = add(
        "bench",
        cmd_bench,
        "sweep solvers x graphs x budgets into a CSV, a LaTeX table and plots; run again with "
        "the same -o to resume (only missing or failed tasks run)",
    )
    p.add_argument("graphs", nargs="*", type=Path, help="cost graph files (default: graphs/*.json)")
    p.add_argument(
        "--solvers",
        nargs="+",
        default=["greedy", "sqrt", "auto"],
        help="registered names (see `chkpt-opt solvers`)",
    )
    p.add_argument(
        "--budgets",
        nargs="+",
        type=float,
        default=[0.9, 0.7, 0.5, 0.3],
        help="fractions of the store-everything peak",
    )
    p.add_argument("--time-limit", type=float, default=60.0, help="per-solve time limit, seconds")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("results/bench"),
        help="folder for results.csv, table.tex, summary.md and the figures",
    )
    p.add_argument(
        "--workers", type=int, default=None, help="local processes (default: one per CPU)"
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="run on this Ray cluster instead (host:port, as `ray status` prints it)",
    )

    p = add("max-batch", cmd_max_batch, "largest batch that fits a budget, with and without a plan")
    p.add_argument(
        "model", help="package.module:function taking batch= and returning (model, args[, kwargs])"
    )
    budget_args(p, sharded=False)
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument(
        "--outputs-dropped",
        action="store_true",
        help="the loop drops the outputs beside the loss (the logits) before the backward "
        "pass, as model(**batch).loss.backward() and Trainer do (default: held to its end)",
    )

    p = add(
        "export", cmd_export, "lower a schedule for a trainer, or write the memory-viewer snapshot"
    )
    p.add_argument("graph", type=Path)
    p.add_argument("schedule", type=Path)
    p.add_argument(
        "--target", required=True, choices=["huggingface", "torchtitan", "megatron", "snapshot"]
    )
    p.add_argument(
        "-o", "--output", type=Path, help="file to write (JSON settings or snapshot pickle)"
    )

    p = add("validate", cmd_validate, "plan, run and measure a model on a device (cpu or cuda)")
    p.add_argument("model", help="package.module:function returning (model, args[, kwargs])")
    budget_args(p, sharded=False)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--tolerance", type=float, default=0.05, help="allowed |predicted-measured|/measured"
    )
    p.add_argument(
        "--repeats", type=int, default=9, help="timed rounds (both modules, alternating order)"
    )
    p.add_argument(
        "--profile-times",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time ops on the device for the solver (default: on, as chkpt_opt.plan)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run the plan under torch.compile (chkpt_opt.compile_module) and require "
        "the compiled step to fit the budget (CPU)",
    )

    p = add("corpus", cmd_corpus, "regenerate the benchmark corpus of cost graphs")
    p.add_argument(
        "-o", "--output", type=Path, default=Path("graphs"), help="directory (default graphs/)"
    )
    p.add_argument("--only", nargs="*", help="corpus entries to regenerate (default all)")

    add("solvers", cmd_solvers, "list the registered solvers")
    return parser


def budget_arg(text: str) -> int | str:
    """``--budget`` as the library reads it: a plain integer is bytes (docs/budget.md),
    anything else the budget's text (``"20GB"``, ``"80%"``), parsed and checked by
    :func:`chkpt_opt.step_budget.budget.parse_budget`."""
    stripped = text.strip().replace("_", "")
    return int(stripped) if stripped.isdecimal() else text
