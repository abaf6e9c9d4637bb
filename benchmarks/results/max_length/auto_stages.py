"""Where ``auto``'s time goes on the graph ``benchmarks/max_length.py`` plans at one shape: the
seconds into the solve at which each of its solvers ended (its INFO progress lines), what
each found, and the solver chosen.

Run (from the repository root):
    OMP_NUM_THREADS=1 python benchmarks/results/max_length/auto_stages.py \
        --shapes 2x512 1x1216 --time-limit 54 -o auto_stages.json

The graph and activation budget are those of a ``max_length.py`` probe (32-layer LoRA Llama,
logits dropped before the backward pass, HF checkpointing's step peak at 512 tokens);
``--time-limit`` 54 s is what a 60 s ``plan()`` leaves its solve after the capture. With
``PYTHONPATH`` set to another checkout (a ``git worktree``), that library runs; ``commit``
names the checkout's.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import max_length  # noqa: E402

import chkpt_opt  # noqa: E402
from chkpt_opt.solvers import get_solver  # noqa: E402

STAGE = re.compile(r"auto: (\S+) -> (\S+), (.*?), peak (\d+) bytes, ([\d.]+) s;")


class Stages(logging.Handler):
    """Collects auto's progress lines with the seconds since ``start``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.start = time.perf_counter()
        self.rows: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = STAGE.search(record.getMessage())
        if match:
            solver, status, found, peak, took = match.groups()
            self.rows.append(
                {
                    "ended_s": round(time.perf_counter() - self.start, 1),
                    "solver": solver,
                    "status": status,
                    "found": found,
                    "peak_bytes": int(peak),
                    "took_s": float(took),
                }
            )


def run(shape: str, budget_bytes: int, time_limit_s: float) -> dict:
    batch, tokens = (int(x) for x in shape.split("x"))
    data = max_length.make_batch(batch, tokens, 0)
    graph, _, act = max_length.graph_at(max_length.build(32, "lora"), data, budget_bytes)
    stages = Stages()
    logger = logging.getLogger("chkpt_opt")
    logger.addHandler(stages)
    logger.setLevel(logging.INFO)
    try:
        stages.start = time.perf_counter()
        result = get_solver("auto")(graph, act, time_limit_s=time_limit_s)
    finally:
        logger.removeHandler(stages)
    return {
        "shape": shape,
        "ops": graph.number_of_nodes(),
        "activation_budget_bytes": act,
        "wall_s": round(time.perf_counter() - stages.start, 1),
        "status": result.status.value,
        "chosen": result.stats.get("chosen"),
        "recompute_s": result.objective if result.feasible else None,
        "peak_bytes": result.peak_bytes,
        "stages": stages.rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["2x512", "1x1216"])
    parser.add_argument("--budget-bytes", type=int, default=138_755_848)
    parser.add_argument("--time-limit", type=float, default=54.0)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    library = Path(chkpt_opt.__file__).resolve().parents[1]  # (PYTHONPATH: another checkout)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=library
    ).stdout.strip()
    rows = []
    for shape in args.shapes:
        rows.append(run(shape, args.budget_bytes, args.time_limit))
        print(json.dumps(rows[-1]), flush=True)
    out = {"command": " ".join(sys.argv), "commit": commit, "library": str(library), "rows": rows}
    args.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
