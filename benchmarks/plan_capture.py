"""``chkpt_opt.plan`` on a Hugging Face Llama as it comes: its default config, a padded batch
of keyword inputs, the loop's own step; against HF's checkpointing, in one run.

Run:
    python benchmarks/plan_capture.py                  # 4 layers of width 256, 4 x 256 tokens
    python benchmarks/plan_capture.py --rounds 9 -o benchmarks/results/plan_capture

The model is ``LlamaForCausalLM`` from :func:`chkpt_opt.zoo.huggingface.llama` (its config
keeps ``use_cache=True``, the default); the batch is ``input_ids``, ``attention_mask`` 0 on
the last 48 positions and ``labels`` -100 there, passed as ``chkpt_opt.plan(model, (),
example_kwargs=batch, ...)``: no ``use_cache`` given, ``plan`` adds ``use_cache=False`` as
the attachment does. Two loops: ``held`` (``outputs = model(**batch);
outputs.loss.backward()``, ``outputs_held=True``) and ``dropped``
(``model(**batch).loss.backward()``, Trainer's, ``outputs_held=False``). Per loop, on the
CPU, peaks by the storage tracker (exact; bytes above what lives before the step):

* the original model's step against the keep-all plan's prediction;
* ``gradient_checkpointing_enable()`` (non-reentrant): its peak is the budget of a plan
  (``plan`` with its defaults: op times measured here, the timed choice), whose predicted and
  measured peaks are reported, and whose step time against HF's is the median of per-round
  ratios, the original, HF and the plan interleaved in the same rounds.

Writes plan_capture.md to the output directory.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import chkpt_opt
from chkpt_opt.graphs.tracer.storage import StorageTracker
from chkpt_opt.measurement.timed_choice import describe
from chkpt_opt.zoo import huggingface as hf_zoo

MIB = 2**20


def padded_batch(batch: int, seq: int, padded: int) -> tuple[nn.Module, dict[str, Any]]:
    built, (ids, labels), _ = hf_zoo.llama(layers=4, width=256, batch=batch, seq=seq)
    mask = torch.ones_like(ids)
    mask[:, -padded:] = 0
    labels = labels.clone()
    labels[:, -padded:] = -100
    return built.hf.train(), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step(module: nn.Module, batch: dict[str, Any], *, held: bool) -> None:
    if held:
        outputs = module(**batch)
        outputs.loss.backward()
        del outputs
    else:
        module(**batch).loss.backward()


def peak(module: nn.Module, batch: dict[str, Any], *, held: bool) -> int:
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(0)
    with StorageTracker() as tracker:
        step(module, batch, held=held)
    return tracker.peak_bytes


def interleaved(
    modules: dict[str, nn.Module], batch: dict[str, Any], *, held: bool, rounds: int
) -> dict[str, list[float]]:
    """Step times, the modules in a rotating order each round (the first round warms up)."""
    names = list(modules)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            module = modules[name]
            for p in module.parameters():
                p.grad = None
            start = time.perf_counter()
            step(module, batch, held=held)
            if r:
                times[name].append(time.perf_counter() - start)
    return times


def ratio(times: dict[str, list[float]], name: str, base: str) -> tuple[float, float]:
    per_round = [a / b for a, b in zip(times[name], times[base], strict=True)]
    median = statistics.median(per_round)
    spread = 2 * statistics.median(abs(x - median) for x in per_round)
    return median, spread


def run_loop(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    held: bool,
    rounds: int,
    time_limit_s: float | None,
) -> list[str]:
    label = "held" if held else "dropped"
    keep_all = chkpt_opt.plan(
        model,
        (),
        example_kwargs=batch,
        budget=10**15,
        optimizer=None,
        solver="keep_all",
        outputs_held=held,
        profile_times=False,
    )
    original = peak(model, batch, held=held)
    predicted = keep_all.profile.peak_bytes
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_peak = peak(hf, batch, held=held)
    start = time.perf_counter()
    made = chkpt_opt.plan(
        model,
        (),
        example_kwargs=batch,
        budget=keep_all.static.resident_bytes + hf_peak,
        optimizer=None,
        outputs_held=held,
        time_limit_s=time_limit_s,
    )
    plan_s = time.perf_counter() - start
    applied = made.apply()
    plan_kwargs = {**batch, "use_cache": False}  # the call plan() captured
    measured = peak(applied, plan_kwargs, held=held)
    times = interleaved(
        {"original": model, "hf": hf, "plan": _Bound(applied, use_cache=False)},
        batch,
        held=held,
        rounds=rounds,
    )
    hf_ratio = ratio(times, "hf", "original")
    plan_ratio = ratio(times, "plan", "original")
    versus = ratio(times, "plan", "hf")
    timed = made.result.stats.get("timed_choice", {})
    return [
        f"| {label} | {predicted / MIB:.2f} | {original / MIB:.2f} | "
        f"{predicted / original - 1:+.2%} | {hf_peak / MIB:.2f} | "
        f"{made.profile.peak_bytes / MIB:.2f} | {measured / MIB:.2f} | "
        f"{made.profile.peak_bytes / measured - 1:+.2%} | "
        f"{'yes' if measured <= hf_peak else 'NO'} | {len(made.schedule.regions)} | "
        f"{len(made.schedule.saved)} | {hf_ratio[0]:.3f} | {plan_ratio[0]:.3f} | "
        f"{versus[0]:.3f} ± {versus[1]:.3f} | {made.result.status.value} | "
        f"{describe(made.result.stats) or timed.get('chosen', '')} | {plan_s:.0f} |"
    ]


class _Bound(nn.Module):
    """A module called as the original is (``**batch``), with fixed extra keywords."""

    def __init__(self, module: nn.Module, **extra: Any) -> None:
        super().__init__()
        self.inner = module
        self.extra = extra

    def forward(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs, **self.extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--time-limit", type=float, default=None, help="plan()'s time_limit_s (default: none)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--loops", nargs="+", default=["dropped", "held"])
    parser.add_argument(
        "-o", "--output", type=Path, default=Path("benchmarks/results/plan_capture")
    )
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    torch.manual_seed(0)
    model, batch = padded_batch(4, 256, 48)
    lines = [
        f"Command: `python {' '.join(sys.argv)}` (CPU, {options.threads} thread(s))",
        "",
        "LlamaForCausalLM from `chkpt_opt.zoo.huggingface.llama(layers=4, width=256)` (config "
        "default `use_cache=True`), batch 4 x 256, last 48 positions masked, labels -100 there; "
        "`chkpt_opt.plan(model, (), example_kwargs=batch, ...)`. Peaks in MiB above the "
        "resident bytes (storage tracker, exact); times as ratios to the original's step, "
        f"{options.rounds} interleaved rounds; plan vs HF: median of per-round ratios ± twice "
        "their median absolute deviation.",
        "",
        "| loop | keep-all predicted | original | error | HF ckpt | plan predicted "
        "| plan measured | error | within HF | regions | cached ops | HF time | plan time "
        "| plan vs HF | status | timed choice | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for loop in options.loops:
        lines += run_loop(
            model,
            batch,
            held=loop == "held",
            rounds=options.rounds,
            time_limit_s=options.time_limit,
        )
        print(lines[-1], flush=True)
    options.output.mkdir(parents=True, exist_ok=True)
    (options.output / "plan_capture.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
