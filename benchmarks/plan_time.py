"""How long ``chkpt_opt.plan`` takes under its time limit on a Hugging Face model.

Run:
    python benchmarks/plan_time.py --model llama --time-limit 60

``plan``'s ``time_limit_s`` covers the whole call, tracing included. This calls it as a new
user would, on a model of :mod:`chkpt_opt.zoo.huggingface` built from its config with random
weights, at the budget of the model's own ``gradient_checkpointing_enable()`` (its peak of
one forward+backward from the allocator's events, with ``optimizer=None``), with and
without ``profile_times``, and reports the wall time of each call beside the limit, the
solver's status and gap, and the plan's predicted peak against the budget. Writes
``<model>.md`` to the output directory.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from hf_models import allocator_peak, hf_checkpointed, relative_gap, write_markdown

import chkpt_opt
from chkpt_opt.zoo import huggingface as hf_zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=list(hf_zoo.FAMILIES))
    parser.add_argument("--time-limit", type=float, default=60.0, help="plan's time_limit_s")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/plan_time"))
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    model, args, _ = hf_zoo.FAMILIES[options.model]()
    peer_bytes = allocator_peak(hf_checkpointed(model), args)
    keep_all = chkpt_opt.plan(model, args, budget=10**15, optimizer=None, solver="keep_all")
    budget_bytes = keep_all.static.step_peak_bytes(peer_bytes)  # resident bytes added
    lines = [
        f"# {options.model}: `chkpt_opt.plan` under `time_limit_s={options.time_limit:g}`",
        "",
        f"`python benchmarks/plan_time.py --model {options.model} --time-limit "
        f"{options.time_limit:g}`; budget: the whole step at HF checkpointing's "
        f"forward+backward peak, {peer_bytes / 2**20:.1f} MiB, plus the resident bytes: "
        f"{budget_bytes} bytes (`optimizer=None`).",
        "",
        "| profile_times | wall s | limit s | status | gap | predicted forward+backward MiB |",
        "|---|---|---|---|---|---|",
    ]
    for profile_times in (False, True):
        start = time.perf_counter()
        made = chkpt_opt.plan(
            model,
            args,
            budget=budget_bytes,
            optimizer=None,
            time_limit_s=options.time_limit,
            profile_times=profile_times,
        )
        wall_s = time.perf_counter() - start
        result = made.result
        gap = relative_gap(result)
        gap_text = gap if isinstance(gap, str) else f"{gap:.1%}"
        lines.append(
            f"| {profile_times} | {wall_s:.1f} | {options.time_limit:g} | "
            f"{result.status.value} | {gap_text} | {made.profile.peak_bytes / 2**20:.1f} |"
        )
    print(write_markdown(options.output, options.model, lines))


if __name__ == "__main__":
    main()
