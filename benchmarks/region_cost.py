"""What recompute regions really cost on a model's own ops, against what the time model
charges: the data behind the cost model of regions, on the CPU or a GPU.

For each model (the zoo GPT and ResNet by default), traced with op times measured on the
device and the per-region cost measured as ``plan(profile_times=True)`` measures it: the
original, its keep-all rewrite, regions over every k consecutive cut spans (k = 1, 2, 4,
8: the model's own ops, from fine to coarse), and the plan at half its activations;
forward and backward timed apart, interleaved rounds, medians. Per schedule: its regions,
the ops inside them and the tensors those save (packed by the checkpoint's hooks in the
forward pass), the ops its backward replays and the tensors they save, the time model's
charge beyond the keep-all step (replayed ops' forward times, and the per-region cost),
and the measured time beyond the keep-all rewrite's, forward and backward apart.

Run:
    python benchmarks/region_cost.py --device cuda -o results/region_cost
Writes region_cost.csv and region_cost.md.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cuda_times import half_activations

import chkpt_opt
from chkpt_opt.codegen.rewrite import rewrite_module
from chkpt_opt.graphs.costgraph import region_overhead_s
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule, cut_positions
from chkpt_opt.memory_model.simulate import simulate

FIELDS = [
    "model",
    "schedule",
    "regions",
    "ops in regions",
    "saved in regions",
    "replayed ops",
    "replayed saved tensors",
    "replayed fwd ms",
    "charged ms",
    "measured fwd ms",
    "measured bwd ms",
    "measured ms",
    "spread ms",
]


def phases_s(
    module: torch.nn.Module, args: tuple[Any, ...], sync: Callable[[], None]
) -> tuple[float, float]:
    """Seconds of one step's forward (to the loss) and backward."""
    for p in module.parameters():
        p.grad = None
    sync()
    start = time.perf_counter()
    out = module(*args)
    loss = (out if torch.is_tensor(out) else out[0]).float().sum()
    sync()
    middle = time.perf_counter()
    loss.backward()
    sync()
    return middle - start, time.perf_counter() - middle


def grouped(cuts: list[int], k: int) -> list[tuple[int, int]]:
    """Spans over every ``k`` consecutive cut spans."""
    return list(
        itertools.pairwise(cuts[::k] if cuts[::k][-1] == cuts[-1] else cuts[::k] + cuts[-1:])
    )


def model_rows(name: str, device: str, rounds: int) -> list[dict[str, Any]]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model, args, budget = half_activations(name, device)
    plan = chkpt_opt.plan(
        model, args, budget=budget, optimizer="adamw", time_limit_s=20, profile_times=True
    )
    graph = plan.graph
    cuts = [p for p, ok in enumerate(cut_positions(graph)) if ok]
    schedules = {"keep-all": Schedule()}
    for k in (1, 2, 4, 8):
        if k == 1 or len(cuts) > 2 * k:
            schedules[f"every {k} cut spans"] = Schedule.from_spans(graph, grouped(cuts, k))
    schedules["plan"] = plan.schedule
    modules: dict[str, torch.nn.Module] = {"original": model}
    for label, schedule in schedules.items():
        modules[label] = rewrite_module(plan.traced.captured.fresh_module(), graph, schedule)
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label in modules}
    for round_ in range(rounds + 2):
        for label, module in modules.items():
            torch.manual_seed(round_)
            value = phases_s(module, args, sync)
            if round_ >= 2:
                samples[label].append(value)
    base = samples["keep-all"]
    rows = []
    for label, values in samples.items():
        schedule = schedules.get(label)
        fwd = statistics.median(v[0] for v in values)
        bwd = statistics.median(v[1] for v in values)
        extra = [sum(v) - sum(b) for v, b in zip(values, base, strict=True)]
        middle = statistics.median(extra)
        spread = 2 * statistics.median(abs(e - middle) for e in extra)
        row: dict[str, Any] = {"model": name, "schedule": label}
        if schedule is not None:
            replayed = [s.node for s in lower(graph, schedule) if s.kind == "recompute"]
            replayed_s = sum(graph.nodes[v]["fwd_time_s"] for v in replayed)
            inside = [v for region in schedule.regions for v in region]
            row |= {
                "regions": len(schedule.regions) + len(schedule.nested),
                "ops in regions": len(inside),
                "saved in regions": sum(graph.nodes[v]["n_saved"] for v in inside),
                "replayed ops": len(replayed),
                "replayed saved tensors": sum(graph.nodes[v]["n_saved"] for v in replayed),
                "replayed fwd ms": f"{replayed_s * 1e3:.2f}",
                "charged ms": f"{simulate(graph, schedule).recompute_s * 1e3:.2f}",
            }
        fwd_base = statistics.median(b[0] for b in base)
        bwd_base = statistics.median(b[1] for b in base)
        row |= {
            "measured fwd ms": f"{(fwd - fwd_base) * 1e3:.2f}",
            "measured bwd ms": f"{(bwd - bwd_base) * 1e3:.2f}",
            "measured ms": f"{middle * 1e3:.2f}",
            "spread ms": f"{spread * 1e3:.2f}",
        }
        rows.append(row)
    rows.append(
        {
            "model": name,
            "schedule": f"(keep-all step {statistics.median(sum(b) for b in base) * 1e3:.2f} ms; "
            f"charged {region_overhead_s(graph) * 1e3:.3f} ms a region)",
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("-o", "--out", default="benchmarks/results/region_cost")
    ns = parser.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for name in ns.models for r in model_rows(name, ns.device, ns.rounds)]
    with open(out / "region_cost.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(FIELDS) + " |", "|" + "---|" * len(FIELDS)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in FIELDS) + " |" for r in rows]
    (out / "region_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
