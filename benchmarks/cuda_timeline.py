"""Per-op memory of a plan's step on CUDA, for finding where a prediction and the caching
allocator part ways.

Run (on a GPU machine; benchmarks/cuda_validate.sh does):
    python benchmarks/cuda_timeline.py -o results/cuda

For the zoo ResNet (at half its activations, AdamW counted) and issue 13's deep chain
(dp_nested at 39.2 MiB, or the least it meets; no optimizer): the plan's schedule and
prediction, then the original and the plan each stepped twice (cold, then warm), every
ATen op recorded with the allocator's bytes after it and its peak during it (dispatch
mode; backward ops on the autograd device thread included). Writes cuda_timeline.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from cuda_times import half_activations
from torch.utils._python_dispatch import TorchDispatchMode

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.measurement.step import run_step


class AllocatorTimeline(TorchDispatchMode):
    """Records (op, bytes allocated after it, peak bytes during it) for every ATen op."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.rows.append(
            (str(func), torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
        )
        torch.cuda.reset_peak_memory_stats()
        return out


def stepped(module: torch.nn.Module, args: tuple[Any, ...]) -> dict[str, Any]:
    """One step's per-op rows, its peak above what was allocated before it, and that base."""
    for p in module.parameters():
        p.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with AllocatorTimeline() as recorder:
        run_step(module, args, {})
    torch.cuda.synchronize()
    peak = max(row[2] for row in recorder.rows)
    return {
        "before_bytes": before,
        "peak_bytes": peak - before,
        "ops": [[op, after - before, top - before] for op, after, top in recorder.rows],
    }


def case(name: str) -> dict[str, Any]:
    if name == "resnet":
        model, args, budget = half_activations("resnet", "cuda")
        plan = chkpt_opt.plan(model, args, budget=budget, optimizer="adamw", time_limit_s=20)
    else:
        model, args, _ = zoo.on_device(zoo.relu_chain(), "cuda")
        try:
            plan = chkpt_opt.plan(
                model, args, budget="39.2MiB", optimizer=None, solver="dp_nested", time_limit_s=30
            )
        except chkpt_opt.InfeasibleBudgetError as err:  # at the smallest budget it meets
            plan = chkpt_opt.plan(
                model,
                args,
                budget=err.min_feasible_bytes,
                optimizer=None,
                solver="dp_nested",
                time_limit_s=30,
            )
    optimized = plan.apply()
    steps = {}
    for label, module in (("original", model), ("plan", optimized)):
        steps[f"{label} cold"] = stepped(module, args)
        steps[f"{label} warm"] = stepped(module, args)
    return {
        "budget_bytes": plan.budget.total_bytes,
        "predicted_peak_bytes": plan.profile.peak_bytes,
        "keep_all_predicted_bytes": chkpt_opt.simulate(plan.graph, chkpt_opt.Schedule()).peak_bytes,
        "schedule": plan.result.schedule.to_dict(),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["relu_chain", "resnet"])
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/cuda"))
    options = parser.parse_args()
    options.output.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"torch": torch.__version__}
    for name in options.cases:
        out[name] = case(name)
        (options.output / "cuda_timeline.json").write_text(json.dumps(out))
        steps = out[name]["steps"]
        print(
            name,
            "predicted",
            out[name]["predicted_peak_bytes"],
            {k: v["peak_bytes"] for k, v in steps.items()},
            flush=True,
        )


if __name__ == "__main__":
    main()
