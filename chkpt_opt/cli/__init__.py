"""The ``chkpt-opt`` command line.

Exit codes (stable, for scripts):
    0  success
    1  unexpected internal error
    2  bad usage or bad input (unreadable budget, malformed or mismatched file)
    3  the budget cannot be met: no schedule fits (solve, optimize, max-batch), or the
       per-layer lowering of ``export --target huggingface/torchtitan/megatron`` does not
       (the exact schedule may still fit through chkpt_opt's own apply)
    4  the model cannot be loaded or traced: its spec cannot be imported, its function
       raises or returns something else, or tracing fails

Layout: :mod:`~chkpt_opt.cli.parser` (the argument grammar), :mod:`~chkpt_opt.cli.entry`
(``main`` and the mapping of errors to exit codes), :mod:`~chkpt_opt.cli.output` (exit
codes, JSON or text, progress), :mod:`~chkpt_opt.cli.model_spec` (``module:function``
specs), and the commands: :mod:`~chkpt_opt.cli.graph_commands` (trace, solve, simulate,
show, corpus, solvers), :mod:`~chkpt_opt.cli.model_commands` (optimize, validate,
max-batch), :mod:`~chkpt_opt.cli.export_command`, :mod:`~chkpt_opt.cli.bench_command`.
"""

from chkpt_opt.cli.entry import main
from chkpt_opt.cli.model_spec import load_model_spec
from chkpt_opt.cli.output import EXIT_INFEASIBLE, EXIT_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_TRACE
from chkpt_opt.cli.parser import build_parser

__all__ = [
    "EXIT_INFEASIBLE",
    "EXIT_INPUT",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_TRACE",
    "build_parser",
    "load_model_spec",
    "main",
]
