"""Step time on CUDA of plans made on the roofline model against plans made on measured op
times (``profile_times=True``), side by side in one run.

Run (on a GPU machine; benchmarks/cuda_validate.sh does):
    python benchmarks/cuda_times.py -o results/cuda

For the zoo GPT and ResNet at half their activations (AdamW counted, the budget of
tests/test_cuda.py): one plan made on the roofline model, one on op times measured on the
device (which also measures what a recompute region costs beyond its ops). Each plan's
peak is validated against the original's step once; then the original and the plans run
in interleaved rounds, and each plan's step time over the original's in the same round
gives its ratio (median, with twice the median absolute deviation). Per plan: the time
model's estimated extra compute beside the measured ratio, the region cost it charged,
the peak predicted and measured, and the schedule's size. ``--device cpu`` runs the same
comparison on the CPU. Writes cuda_times.csv and cuda_times.md. (At 00cb197 and 5b6db49
the script compared a third and fourth way of costing regions, since dropped with them:
``benchmarks/results/cuda/README.md``.)
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path
from typing import Any

import torch
from peers import paired_ratio, timings

import chkpt_opt
from chkpt_opt import zoo

FIELDS = [
    "model",
    "plan",
    "step budget MB",
    "fwd+bwd predicted MB",
    "fwd+bwd measured MB",
    "prediction",
    "estimated extra compute",
    "measured step time ratio",
    "spread",
    "region ms",
    "regions",
    "recomputed ops",
    "plan s",
]


def half_activations(name: str, device: str) -> tuple[torch.nn.Module, tuple[Any, ...], int]:
    """The model on ``device``, its inputs, and the whole-step budget that leaves half the
    keep-all plan's activations (AdamW counted)."""
    model, args, _ = zoo.on_device(getattr(zoo, name)(), device)
    full = chkpt_opt.plan(model, args, budget=10**15, optimizer="adamw", solver="keep_all")
    s = full.static
    return model, args, s.resident_bytes + s.optimizer_phase_bytes + full.profile.peak_bytes // 2


VARIANTS = {"roofline": False, "measured": True}
"""Plan label: profile_times."""


def model_rows(name: str, device: str, rounds: int) -> list[dict[str, Any]]:
    model, args, budget = half_activations(name, device)
    rows: dict[str, dict[str, Any]] = {}
    modules: dict[str, torch.nn.Module] = {"original": model}
    for label in VARIANTS:
        start = time.perf_counter()
        plan = chkpt_opt.plan(
            model,
            args,
            budget=budget,
            optimizer="adamw",
            time_limit_s=20,
            profile_times=VARIANTS[label],
        )
        plan_s = time.perf_counter() - start
        modules[label] = plan.apply()
        report = chkpt_opt.validate(
            model, modules[label], args, predicted_peak_bytes=plan.profile.peak_bytes, repeats=1
        )
        error = report.prediction_error
        attrs = plan.graph.graph
        rows[label] = {
            "model": name,
            "plan": label,
            "step budget MB": f"{budget / 1e6:.1f}",
            "fwd+bwd predicted MB": f"{plan.profile.peak_bytes / 1e6:.1f}",
            "fwd+bwd measured MB": f"{report.measured_peak_bytes / 1e6:.1f}",
            "prediction": "" if error is None else f"{error:+.2%}",
            "estimated extra compute": f"{plan.profile.overhead:.1%}",
            "region ms": f"{attrs.get('region_overhead_s', 0.0) * 1e3:.3f}",
            "regions": len(plan.schedule.regions),
            "recomputed ops": len(plan.schedule.recomputed_nodes()),
            "plan s": f"{plan_s:.1f}",
        }
        print(rows[label], flush=True)
    samples = timings(modules, args, rounds)
    for p in model.parameters():
        p.grad = None
    for label, row in rows.items():
        middle, spread = paired_ratio(samples[label], samples["original"])
        row["measured step time ratio"] = f"{middle:.2f}"
        row["spread"] = f"{spread:.2f}"
    return list(rows.values())


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--out", type=Path, default=Path("benchmarks/results/cuda"))
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=15)
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --device cpu to compare on the CPU.")
    options.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in options.models:
        rows += model_rows(name, options.device, options.rounds)
    with (options.out / "cuda_times.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Step time of plans on {device_name(options.device)}: roofline vs measured op times",
        "",
        "| " + " | ".join(FIELDS) + " |",
        "|" + "---|" * len(FIELDS),
        *("| " + " | ".join(str(r[k]) for k in FIELDS) + " |" for r in rows),
    ]
    (options.out / "cuda_times.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
