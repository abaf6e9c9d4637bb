"""A model's own checkpoint layout run by chkpt_opt, beside the plan and the model's own
checkpointing: where a plan is slower than the peer, is it the search, the cost model or
the execution?

Run:
    python benchmarks/hf_layout.py --model t5 --repeats 15

For one Hugging Face model (:mod:`chkpt_opt.zoo.huggingface`, built from its config with
random weights, ``profile_times=True``), measured on the CPU in one process:

* ``hf``: ``gradient_checkpointing_enable()`` (non-reentrant), and its allocator peak;
* ``plan``: ``auto``'s plan for that peak (the time limit given);
* ``layout``: Hugging Face's layout as a chkpt_opt schedule, one region per layer
  (:func:`~chkpt_opt.own_layouts.own_layouts`: every segment named after a layer).

Per module: the cost model's recompute seconds (the simulator's, per-region overhead
included) and the median time of interleaved steps over the original's and over ``hf``'s
in the same round, ± twice the median absolute deviation. Then one profiled step of
``hf`` and of ``layout``: whether they run the same ATen ops the same number of times, and
the ops whose self time differs most between the two steps. Writes ``<model>.md`` to the
output directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from hf_models import (
    allocator_peak,
    hf_checkpointed,
    with_result,
    write_markdown,
)
from peers import paired_ratio, timings
from torch import nn
from torch.profiler import ProfilerActivity, profile

import chkpt_opt
from chkpt_opt.api import Plan
from chkpt_opt.measurement.step import run_step
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers.base import result_from_profile
from chkpt_opt.zoo import huggingface as hf_zoo


def planned(base: Plan, schedule: Schedule, budget_bytes: int, solver: str) -> Plan:
    """``base`` with ``schedule`` as its plan (simulated, judged at ``budget_bytes``)."""
    profile_ = simulate(base.graph, schedule)
    result = result_from_profile(
        schedule, profile_, budget_bytes=budget_bytes, solver=solver, solve_s=0.0
    )
    return with_result(base, result, budget_bytes, profile_)


def op_profile(module: nn.Module, args: tuple[Any, ...]) -> dict[str, tuple[int, float]]:
    """ATen op -> (calls, self CPU seconds) of one step, after two warm-up steps."""
    for _ in range(2):
        run_step(module, args, {})
    for p in module.parameters():
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(module, args, {})
    return {
        e.key: (e.count, e.self_cpu_time_total / 1e6)
        for e in prof.key_averages()
        if e.key.startswith("aten::")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="t5", choices=list(hf_zoo.FAMILIES))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds for auto")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/hf_layout"))
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    model, args, _ = hf_zoo.FAMILIES[options.model]()
    base = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=True
    )
    graph = base.graph
    hf = hf_checkpointed(model)
    budget = allocator_peak(hf, args)
    layouts = own_layouts(graph)
    if not layouts:
        sys.exit(f"{options.model}: no layers found; nothing to compare")
    layout = layouts["layers"]
    found = chkpt_opt.get_solver("auto")(graph, budget, time_limit_s=options.time_limit)
    plans = {
        "plan": planned(base, found.schedule, budget, "auto"),
        "layout": planned(base, layout, budget, "layout"),
    }
    modules: dict[str, nn.Module] = {"original": model, "hf": hf}
    modules.update({label: made.apply() for label, made in plans.items()})
    times = timings(modules, args, options.repeats)
    lines = [
        f"# {options.model}: the model's own layout run by chkpt_opt",
        "",
        f"`python benchmarks/hf_layout.py --model {options.model} --repeats {options.repeats}"
        f" --time-limit {options.time_limit:g}`; budget: HF checkpointing's allocator peak,"
        f" {budget / 2**20:.1f} MiB; {len(layout.regions)} block regions in the layout.",
        "",
        "| module | regions | peak MiB | recompute s (model) | time vs original | vs hf |",
        "|---|---|---|---|---|---|",
    ]
    for label, module in modules.items():
        made = plans.get(label)
        regions = "" if made is None else str(len(made.result.schedule.regions))
        recompute = "" if made is None else f"{made.profile.recompute_s:.3f}"
        over_original, _ = paired_ratio(times[label], times["original"])
        over_hf, spread = paired_ratio(times[label], times["hf"])
        lines.append(
            f"| {label} | {regions} | {allocator_peak(module, args) / 2**20:.1f} | {recompute} "
            f"| {over_original:.2f} | {over_hf:.2f} ± {spread:.2f} |"
        )
    ops_hf, ops_layout = op_profile(hf, args), op_profile(modules["layout"], args)
    counted = sorted(set(ops_hf) | set(ops_layout))
    other_calls = [
        f"`{op}` {ops_hf.get(op, (0, 0.0))[0]} / {ops_layout.get(op, (0, 0.0))[0]}"
        for op in counted
        if op != "aten::_assert_tensor_metadata"  # the captured program's shape checks
        and ops_hf.get(op, (0, 0.0))[0] != ops_layout.get(op, (0, 0.0))[0]
    ]
    lines += [
        "",
        f"One profiled step each of hf and layout: the same ATen ops the same number of times"
        f" (shape checks aside): {'yes' if not other_calls else 'no: ' + ', '.join(other_calls)};"
        f" step self time"
        f" {sum(t for _, t in ops_hf.values()):.3f} s and"
        f" {sum(t for _, t in ops_layout.values()):.3f} s. Largest differences:",
        "",
        "| op | calls hf / layout | self s hf | self s layout |",
        "|---|---|---|---|",
    ]
    differences = sorted(
        set(ops_hf) | set(ops_layout),
        key=lambda op: -abs(ops_hf.get(op, (0, 0.0))[1] - ops_layout.get(op, (0, 0.0))[1]),
    )
    for op in differences[:6]:
        (c1, t1), (c2, t2) = ops_hf.get(op, (0, 0.0)), ops_layout.get(op, (0, 0.0))
        lines.append(f"| `{op}` | {c1} / {c2} | {t1:.3f} | {t2:.3f} |")
    print(write_markdown(options.output, options.model, lines))


if __name__ == "__main__":
    main()
