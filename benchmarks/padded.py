"""Padded batches: predicted against measured peaks, and plans against HF's checkpointing.

Run:
    python benchmarks/padded.py                       # Llama, GPT-2, BERT, T5, Mixtral
    python benchmarks/padded.py --families llama --time-limit 20

Models: the token families of :mod:`chkpt_opt.zoo.huggingface` (ViT takes images and is
skipped), 4 layers of width 256 by default, on a batch of 4 x 256 tokens fed as keyword
inputs, in two forms: padded (``attention_mask`` 0 on the last 48 positions, ``labels``
-100 there) and unpadded (no mask). The step is the one a training loop runs:
``outputs = model(**batch); outputs.loss.backward()``: the loss alone is differentiated, the
logits are held by ``outputs`` until the backward returns (``chkpt_opt.measurement.step``).
The step with the outputs dropped at once (``model(**batch).loss.backward()``, Trainer) is
measured beside it: it is lower by what the held outputs take.

Per family and batch, on the CPU, in one process:

* the keep-all plan's predicted forward/backward peak against the measured peak of the
  original model and of the keep-all rewrite (the storage tracker's exact peak: the
  quantity the tracer models);
* on the padded batch, the peak of ``gradient_checkpointing_enable()`` (non-reentrant), and
  the chkpt_opt plan for that peak (solver ``auto``, op times measured here; the whole-step
  budget is the resident bytes plus that peak, planned on the keep-all plan's trace, i.e.
  ``chkpt_opt.plan`` without its second trace), with its predicted and measured peaks;
  step times of the original, HF's checkpointing and the plan measured interleaved, as
  ratios to the original, and the plan against HF's checkpointing as the median of their
  per-round ratios ± twice its median absolute deviation;
* beside it, the keep-set plan at the same budget (solver ``hierarchical``, or ``pruned``
  where it finds no repeated blocks: no cached ops, so no selective-checkpoint policy),
  timed in the same rounds.

Writes padded.csv and padded.md to the output directory.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hf_models import hf_checkpointed, log, tracked_peak, write_markdown
from peers import paired_ratio, timings
from torch import nn

import chkpt_opt
from chkpt_opt.api import Plan, plan_traced
from chkpt_opt.errors import InfeasibleBudgetError, SolverError
from chkpt_opt.zoo import huggingface as hf_zoo

FAMILIES = [name for name in hf_zoo.FAMILIES if name != "vit"]
KEEP_SET_SOLVERS = ("hierarchical", "pruned")
"""The keep-set plan's solvers: the block solver, or on graphs without repeated blocks
(T5's encoder and decoder stacks), the pruned every-cut program."""
MIB = 2**20
FIELDS = [
    "family",
    "batch",
    "ops",
    "predicted_mib",
    "original_mib",
    "error",
    "rewrite_mib",
    "outputs_dropped_mib",
    "hf_ckpt_mib",
    "plan_status",
    "plan_predicted_mib",
    "plan_mib",
    "plan_fits",
    "original_time",
    "hf_ckpt_time",
    "plan_time",
    "plan_vs_hf",
    "plan_vs_hf_noise",
    "plan_s",
    "plan_cached_ops",
    "plan_timed_choice",
    "keep_set_solver",
    "keep_set_predicted_mib",
    "keep_set_time",
    "keep_set_vs_hf",
    "keep_set_vs_hf_noise",
    "note",
]


class OutputsOf(hf_zoo.LossOf):
    """The Hugging Face model called with keyword inputs, returning its whole output (loss
    and logits): a step differentiates the loss and holds the logits, as
    ``outputs = model(**batch); outputs.loss.backward()`` does."""

    def forward(self, *inputs: torch.Tensor) -> Any:
        kwargs = dict(zip(self.names, inputs))
        if "use_cache" in self.hf.config.to_dict():
            kwargs["use_cache"] = False
        return self.hf(**kwargs)


def batch_of(
    family: str, sizes: dict[str, int], padded: int
) -> tuple[OutputsOf, tuple[torch.Tensor, ...]]:
    """The family's model wrapped by :class:`OutputsOf` and its batch (the last ``padded``
    positions masked and ignored by the loss; no mask at all when ``padded`` is 0)."""
    built, (ids, labels), _ = hf_zoo.FAMILIES[family](**sizes)
    labels = labels.clone()
    if not padded:
        return OutputsOf(built.hf, ("input_ids", "labels")).train(), (ids, labels)
    mask = torch.ones_like(ids)
    mask[:, -padded:] = 0
    labels[:, -padded:] = -100
    model = OutputsOf(built.hf, ("input_ids", "attention_mask", "labels")).train()
    return model, (ids, mask, labels)


def keep_all_row(
    family: str, label: str, model: nn.Module, args: tuple[Any, ...]
) -> tuple[dict[str, Any], Plan]:
    """Predicted against measured keep-all peaks of one batch."""
    start = time.perf_counter()
    base = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=True
    )
    log(
        f"{family} {label}: {base.graph.number_of_nodes()} ops traced in "
        f"{time.perf_counter() - start:.1f} s"
    )
    original = tracked_peak(model, args)
    dropped = tracked_peak(hf_zoo.LossOf(model.hf, model.names).train(), args)
    predicted = base.profile.peak_bytes
    row = {
        "family": family,
        "batch": label,
        "ops": base.graph.number_of_nodes(),
        "predicted_mib": round(predicted / MIB, 2),
        "original_mib": round(original / MIB, 2),
        "error": round(predicted / original - 1, 4),
        "rewrite_mib": round(tracked_peak(base.apply(), args) / MIB, 2),
        "outputs_dropped_mib": round(dropped / MIB, 2),
    }
    return row, base


def against_hf(
    row: dict[str, Any],
    model: nn.Module,
    args: tuple[Any, ...],
    base: Plan,
    *,
    time_limit_s: float,
    repeats: int,
) -> None:
    """HF's checkpointing on the batch, the plan for its peak, and their step times."""
    hf_ckpt = hf_checkpointed(model)
    hf_peak = tracked_peak(hf_ckpt, args)
    row["hf_ckpt_mib"] = round(hf_peak / MIB, 2)
    modules: dict[str, nn.Module] = {"original": model, "hf": hf_ckpt}

    def plan_for(solver: str) -> Plan:
        """The plan of ``solver`` at HF checkpointing's peak, on the keep-all trace."""
        return plan_traced(
            base.traced,
            budget=base.static.resident_bytes + hf_peak,
            optimizer=None,
            solver=solver,
            time_limit_s=time_limit_s,
        )  # base.traced carries the op times and region costs plan() measured

    start = time.perf_counter()
    try:
        made = plan_for("auto")
    except InfeasibleBudgetError as err:
        row["plan_status"] = "infeasible"
        row["note"] = str(err)
        log(f"  plan at HF's peak: {err}")
    else:
        row["plan_s"] = round(time.perf_counter() - start, 1)
        row["plan_status"] = made.result.status.value
        row["plan_predicted_mib"] = round(made.profile.peak_bytes / MIB, 2)
        modules["plan"] = made.apply()
        measured = tracked_peak(modules["plan"], args)
        row["plan_mib"] = round(measured / MIB, 2)
        row["plan_fits"] = "yes" if measured <= hf_peak else "no"
        row["plan_cached_ops"] = len(made.schedule.saved)
        timed = made.result.stats.get("timed_choice")
        if timed is not None and timed.get("skipped"):
            row["plan_timed_choice"] = f"not timed: {timed['skipped']}"
        elif timed is not None:  # the solver's schedule timed against HF's own layouts
            row["plan_timed_choice"] = (
                f"{timed['chosen']} ("
                + ", ".join(f"{k} {v:.3f}" for k, v in timed["ratios"].items())
                + ")"
            )
        # The best keep-set plan at the same budget (no cached ops, so no selective-
        # checkpoint policy): what a region that caches ops costs beyond the model.
        keep_set = None
        for solver in KEEP_SET_SOLVERS:  # the first that accepts the graph
            try:
                keep_set = plan_for(solver)
                break
            except SolverError as err:
                log(f"  keep-set plan: {solver} refused the graph ({err})")
        assert keep_set is not None, "pruned accepts every graph of these sizes"
        row["keep_set_solver"] = keep_set.result.solver
        row["keep_set_predicted_mib"] = round(keep_set.profile.peak_bytes / MIB, 2)
        modules["keep_set"] = keep_set.apply()
        log(
            f"  HF {hf_peak / MIB:.2f} MiB; plan predicted {row['plan_predicted_mib']} "
            f"measured {row['plan_mib']} MiB ({row['plan_status']}, {row['plan_s']} s)"
        )
    times = timings(modules, args, repeats)
    base_time = statistics.median(times["original"])
    for name, samples in times.items():
        row[f"{'hf_ckpt' if name == 'hf' else name}_time"] = round(
            statistics.median(samples) / base_time, 3
        )
    if "plan" in times:
        ratio, spread = paired_ratio(times["plan"], times["hf"])
        row["plan_vs_hf"], row["plan_vs_hf_noise"] = round(ratio, 3), round(spread, 3)
    if "keep_set" in times:
        ratio, spread = paired_ratio(times["keep_set"], times["hf"])
        row["keep_set_vs_hf"], row["keep_set_vs_hf_noise"] = round(ratio, 3), round(spread, 3)


def markdown(rows: list[dict[str, Any]], command: str) -> list[str]:
    lines = [
        f"Command: `{command}`",
        "",
        "Keep-all peaks (MiB; step: `outputs = model(**batch); outputs.loss.backward()`):",
        "",
        "| family | batch | ops | predicted | original | error | keep-all rewrite "
        "| outputs dropped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['batch']} | {r['ops']} | {r['predicted_mib']} | "
            f"{r['original_mib']} | {r['error']:+.2%} | {r['rewrite_mib']} | "
            f"{r['outputs_dropped_mib']} |"
        )
    lines += [
        "",
        "Padded batch: HF's `gradient_checkpointing_enable()` against the plan for its peak "
        "(MiB; times as ratios to the original's step):",
        "",
        "| family | HF ckpt | plan status | plan predicted | plan measured | fits "
        "| original time | HF time | plan time | plan vs HF | plan s | cached ops "
        "| timed choice | keep-set plan vs HF |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "hf_ckpt_mib" not in r:
            continue
        versus = f"{r['plan_vs_hf']:.2f} ± {r['plan_vs_hf_noise']:.2f}" if "plan_vs_hf" in r else ""
        plan_time = f"{r['plan_time']:.2f}" if "plan_time" in r else ""
        keep_set = (
            f"{r['keep_set_vs_hf']:.2f} ± {r['keep_set_vs_hf_noise']:.2f} ({r['keep_set_solver']})"
            if "keep_set_vs_hf" in r
            else ""
        )
        lines.append(
            f"| {r['family']} | {r['hf_ckpt_mib']} | {r.get('plan_status', '')} | "
            f"{r.get('plan_predicted_mib', '')} | {r.get('plan_mib', '')} | "
            f"{r.get('plan_fits', '')} | {r['original_time']:.2f} | {r['hf_ckpt_time']:.2f} | "
            f"{plan_time} | {versus} | {r.get('plan_s', '')} | {r.get('plan_cached_ops', '')} | "
            f"{r.get('plan_timed_choice', '')} | {keep_set} |"
        )
    lines += [
        "",
        "Error: the keep-all plan's predicted peak over the original's measured one (storage "
        'tracker, exact). "outputs dropped": the same step as `model(**batch).loss.backward()` '
        "(the logits freed when the forward returns, as Trainer does), below the prediction by "
        'the held outputs. "plan vs HF": the median of the per-round step-time ratios of the '
        "plan over HF's checkpointing, ± twice their median absolute deviation. \"keep-set "
        'plan": the plan of a keep-set solver (named) at the same budget (no cached ops, so no '
        'selective-checkpoint policy), timed in the same rounds. "timed choice": where '
        "HF's own layouts fit the budget too, the solver's schedule was timed against them "
        "at planning (median step-time ratios to it) and the faster kept "
        "(`chkpt_opt.measurement.timed_choice`).",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--padded", type=int, default=48, help="padded positions per row")
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/padded"))
    options = parser.parse_args()
    if not 0 < options.padded < options.seq:
        parser.error(f"--padded {options.padded} must lie in 1..{options.seq - 1} (--seq)")
    torch.set_num_threads(options.threads)
    sizes = {k: getattr(options, k) for k in ("layers", "width", "batch", "seq")}
    command = "python " + " ".join(sys.argv)
    rows: list[dict[str, Any]] = []
    options.output.mkdir(parents=True, exist_ok=True)
    for family in options.families:
        for label, padded in (("padded", options.padded), ("unpadded", 0)):
            model, args = batch_of(family, sizes, padded)
            row, base = keep_all_row(family, label, model, args)
            if padded:
                against_hf(
                    row,
                    model,
                    args,
                    base,
                    time_limit_s=options.time_limit,
                    repeats=options.repeats,
                )
            rows.append(row)
            with (options.output / "padded.csv").open("w", newline="") as handle:
                writer = csv.DictWriter(handle, FIELDS, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
    print(write_markdown(options.output, "padded", markdown(rows, command)))


if __name__ == "__main__":
    main()
