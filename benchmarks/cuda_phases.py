"""Where a GPU plan's extra time goes: the zoo GPT's plan at half its activations (AdamW
counted, op times measured), run with its regions as made, with RNG replay turned off in
every region, and the original; forward and backward timed apart (medians of 12 rounds
after 3, interleaved), then the per-region overhead that ``profile_times`` measures, three
times. (Per schedule, from fine regions to coarse ones, ``region_cost.py`` measures the
same phases.)

Run (on a GPU machine; ``cpu`` as the argument runs it on the CPU):
    python benchmarks/cuda_phases.py cuda | tee results/cuda/cuda_phases.txt
"""

from __future__ import annotations

import statistics
import sys

import torch
from cuda_times import half_activations
from region_cost import phases_s

import chkpt_opt
from chkpt_opt.codegen.runtime import CheckpointRegion
from chkpt_opt.measurement.region_costs import measure_region_costs

ROUNDS = 15
WARMUP_ROUNDS = 3


def main(device: str) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model, args, budget = half_activations("gpt", device)
    plan = chkpt_opt.plan(
        model, args, budget=budget, optimizer="adamw", time_limit_s=20, profile_times=True
    )
    print(
        "regions",
        len(plan.schedule.regions),
        "nested",
        len(plan.schedule.nested),
        "overhead_s",
        plan.graph.graph.get("region_overhead_s"),
        "est recompute ms",
        plan.profile.recompute_s * 1e3,
        "est compute ms",
        plan.profile.compute_s * 1e3,
    )
    made = plan.apply()
    no_rng = plan.apply()
    regions = [m for m in no_rng.modules() if isinstance(m, CheckpointRegion)]
    print("regions replaying rng:", sum(m.replays_rng for m in regions), "of", len(regions))
    for region in regions:
        region.replays_rng = False
    modules = {"orig": model, "plan": made, "plan_no_rng": no_rng}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in modules}
    for _ in range(ROUNDS):
        for name, module in modules.items():
            samples[name].append(phases_s(module, args, sync))
    for name, values in samples.items():
        fwd = statistics.median(v[0] for v in values[WARMUP_ROUNDS:])
        bwd = statistics.median(v[1] for v in values[WARMUP_ROUNDS:])
        print(f"{name:12s} fwd ms {fwd * 1e3:.2f} bwd ms {bwd * 1e3:.2f}")
    for _ in range(3):
        print("measure_region_costs", measure_region_costs(device))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
