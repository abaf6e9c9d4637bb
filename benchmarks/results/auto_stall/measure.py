"""``auto``'s stall rule on Hugging Face BERT, for ``OPTIMIZE_STALL_S``.

Run (from the repository root):
    OMP_NUM_THREADS=1 python benchmarks/results/auto_stall/measure.py

BERT from ``chkpt_opt.zoo.huggingface`` (its default size, random weights, roofline op
costs), at the peak of its own layer checkpointing; ``auto`` with ``optimize``'s gap (5%)
and a 60 s limit, without the stall rule and with 10 s; prints each run's wall time, cost,
status and what the searches beyond keep-set ran or skipped, and writes measure.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers import get_solver
from chkpt_opt.zoo import huggingface as hf_zoo

LIMIT_S, GAP = 60.0, 0.05


def main() -> None:
    model, args, _ = hf_zoo.FAMILIES["bert"]()
    graph = trace_model(model.train(), args, {}).graph
    budget = simulate(graph, own_layouts(graph)["layers"]).peak_bytes
    rows = []
    for stall_s in (None, 10.0):
        start = time.perf_counter()
        result = get_solver("auto", gap=GAP, stall_s=stall_s)(graph, budget, time_limit_s=LIMIT_S)
        rows.append(
            {
                "stall_s": stall_s,
                "wall_s": round(time.perf_counter() - start, 1),
                "recompute_ms": round(result.objective * 1e3, 3),
                "status": result.status.value,
                "chosen": result.stats.get("chosen"),
                "beyond_keep_set": result.stats.get("beyond_keep_set"),
                "refused": result.stats.get("beyond_keep_set_refused"),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out = {"budget_bytes": budget, "limit_s": LIMIT_S, "gap": GAP, "rows": rows}
    (Path(__file__).parent / "measure.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
