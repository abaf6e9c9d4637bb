"""Where does the time-indexed bound beat the recompute bound, and what does it cost?

Run (from the repository root):
    OMP_NUM_THREADS=1 python benchmarks/results/bound_looseness/timed_share.py \
        > benchmarks/results/bound_looseness/timed_share.jsonl

For the corpus graphs of more than 80 ops (at 0.5 and 0.3 of keep-all) and the Hugging
Face families of ``benchmarks/hf_gaps.py`` (at their layers' peak): both bounds, the
time-indexed program's variables and its seconds (programs of up to 120,000 alive-or-not
variables are built; 20 s each at most). One JSON line per graph and budget.
"""

from __future__ import annotations

import json
import time

from chkpt_opt.corpus import CORPUS
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound
from chkpt_opt.solvers.bounds.timed_bound import timed_bound
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.zoo import huggingface as hf_zoo

MIN_OPS = 81
"""auto adds the time-indexed bound only above 80 ops (``EARLY_MIN_OPS``)."""


def _line(name: str, graph: CostGraph, budget_label: str, budget: int) -> None:
    cover = recompute_bound(graph, budget)
    start = time.perf_counter()
    timed = timed_bound(graph, budget, max_variables=120_000, deadline=Deadline.after(20))
    row = {
        "graph": name,
        "ops": graph.number_of_nodes(),
        "budget": budget_label,
        "recompute_bound_ms": None if cover.bound_s is None else round(cover.bound_s * 1e3, 3),
        "timed_bound_ms": None if timed.bound_s is None else round(timed.bound_s * 1e3, 3),
        "variables": timed.variables,
        "timed_s": round(time.perf_counter() - start, 2),
        "note": timed.note,
    }
    print(json.dumps(row), flush=True)


def main() -> None:
    for entry in CORPUS:
        if entry.family == "layers":
            graph = entry.builder(**entry.settings)
        else:
            model, args, kwargs = entry.builder(**entry.settings)
            graph = trace_model(model, args, kwargs, name=entry.name).graph
        if graph.number_of_nodes() < MIN_OPS:
            continue
        keep_all = simulate(graph, Schedule()).peak_bytes
        for share in (0.5, 0.3):
            _line(entry.name, graph, f"{share} of keep-all", int(keep_all * share))
    for family in ("llama", "gpt2", "bert", "vit"):
        model, args, _ = hf_zoo.FAMILIES[family]()
        graph = trace_model(model, args, name=family).graph
        peak = simulate(graph, own_layouts(graph)["layers"]).peak_bytes
        _line(f"hf_{family}", graph, "layers' peak", peak)


if __name__ == "__main__":
    main()
