"""Real models side by side: chkpt_opt against each model's own checkpointing, in one run.

Run:
    python benchmarks/hf_models.py                      # every model, every peer
    python benchmarks/hf_models.py --models llama bert --skip-compile
    python benchmarks/hf_models.py --compile-models llama   # compiled peers on Llama only
    python benchmarks/hf_models.py --device cuda --models llama gpt2 --skip-compile \
        --width 1024 --batch 8 --seq 512 -o results/cuda/hf_models   # on a GPU

Models: Hugging Face families built from configs with random weights (Llama, GPT-2, BERT,
T5, ViT, Mixtral; :mod:`chkpt_opt.zoo.huggingface`, 6 layers of width 256, batch 4 x 256
tokens; --width and the like resize them) and the project's GPT-style zoo model. Per model,
measured in one process on the CPU (or the GPU with --device cuda):

* the original model, and the captured keep-all rewrite beside it (fidelity: the program
  chkpt_opt rewrites must cost what the model costs);
* ``gradient_checkpointing_enable()`` (non-reentrant; for the zoo model, checkpoint on
  every block);
* per-layer selective checkpointing saving matmul and attention outputs (torchtitan's
  selective op AC), through the same per-layer checkpoint;
* ``torch.compile`` with ``activation_memory_budget`` 0.5 and 0.2 (unless --skip-compile);
* for every peer, the chkpt_opt plan (solver ``auto``, op times measured here, the time
  limit given) whose measured peak is at most the peer's, compiled with
  ``plan.compile()``'s partitioner when the peer is compiled; "plan s" is the trace plus
  the solve, what ``chkpt_opt.plan`` takes.

Peak: one forward+backward above parameters and inputs, from the CPU allocator's events
(the same ruler for eager and compiled code), with gradients unset before every step; on
CUDA, the caching allocator's peak of a step after a first one.
Prediction error: the plan's predicted peak against the storage tracker's exact peak of
the same step (the quantity the tracer models). Time: median of interleaved steps as a
ratio to the original, and the noise margin (twice the median absolute deviation of the
original's steps). Against its peer a plan is judged on the rounds themselves: the median
of its per-round time over the peer's in the same round, with twice the median absolute
deviation of those ratios as the margin. A plan found for two peers is one module, timed
once. Writes hf_models.csv (with each plan's ``schedule``: its regions, nested regions and
cached ops, as run) and hf_models.md to the output directory.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peers import (
    Checkpointed,
    _Compiled,
    _save_matmuls,
    compiled,
    paired_ratio,
    timings,
    with_blocks,
)
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.api import Plan
from chkpt_opt.measurement.step import device_of, measure_step, measure_step_allocator, run_step
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers import SolveResult
from chkpt_opt.zoo import huggingface as hf_zoo

MODELS: dict[str, Callable[[], Any]] = {
    **{name: build for name, build in hf_zoo.FAMILIES.items()},
    "zoo_gpt": zoo.gpt,
}
FIELDS = [
    "model",
    "ops",
    "strategy",
    "peak_bytes",
    "peak_mib",
    "time_ratio",
    "noise",
    "vs_peer",
    "vs_peer_noise",
    "matches",
    "status",
    "gap",
    "plan_s",
    "predicted_mib",
    "prediction_error",
    "schedule",
    "note",
]


def _unset_grads(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def allocator_peak(module: nn.Module, args: tuple[Any, ...]) -> int:
    """The step's peak above what was allocated before it: on the CPU from the allocator's
    events, on CUDA from the caching allocator's own peak (both see every allocation)."""
    if device_of(module, args).type == "cuda":
        return tracked_peak(module, args)
    _unset_grads(module)
    torch.manual_seed(0)
    return measure_step_allocator(module, args)


def tracked_peak(module: nn.Module, args: tuple[Any, ...]) -> int:
    """The step's peak as the tracer models it: the storage tracker's exact peak on the
    CPU, the caching allocator's peak on CUDA (after a first step: cuBLAS takes its
    workspaces on first use and keeps them, memory of the process, not of a step)."""
    if device_of(module, args).type == "cuda":
        _unset_grads(module)
        run_step(module, args, {})
    _unset_grads(module)
    torch.manual_seed(0)
    return measure_step(module, args).peak_bytes


def hf_checkpointed(model: nn.Module, context_fn: Callable[[], Any] | None = None) -> nn.Module:
    """A copy of ``model`` with Hugging Face's own per-layer checkpointing enabled."""
    clone = copy.deepcopy(model)
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    clone.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return clone


def peers(
    name: str, model: nn.Module, args: tuple[Any, ...], *, skip_compile: bool
) -> dict[str, nn.Module]:
    sac = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    if isinstance(model, hf_zoo.LossOf):
        out = {
            "HF gradient checkpointing": hf_checkpointed(model),
            "selective, save matmuls": hf_checkpointed(model, sac),
        }
    else:
        out = {
            "checkpoint every block": with_blocks(model, Checkpointed),
            "selective, save matmuls": with_blocks(model, lambda b: Checkpointed(b, sac)),
        }
    if not skip_compile:
        for budget in (0.5, 0.2):
            log(f"  {name}: compiling with activation_memory_budget={budget}")
            out[f"torch.compile budget {budget}"] = compiled(model, budget, args)
    return out


class CompileFailed(Exception):
    """torch.compile refused a plan's module (the reason is the message)."""


@dataclasses.dataclass
class Matched:
    """The chkpt_opt plan found for one peer, and what it measured."""

    module: nn.Module
    peak_bytes: int
    plan: Plan
    plan_s: float
    tracked_bytes: int | None  # eager plans: the storage tracker's peak


def plan_for(base: Plan, budget_bytes: int, time_limit_s: float) -> tuple[Plan, float] | None:
    """A plan of ``base``'s traced model for a forward+backward budget (no retrace)."""
    start = time.perf_counter()
    result = chkpt_opt.get_solver("auto")(base.graph, budget_bytes, time_limit_s=time_limit_s)
    if not result.feasible:
        return None
    return with_result(base, result, budget_bytes), time.perf_counter() - start


def with_result(
    base: Plan, result: SolveResult, budget_bytes: int, profile: MemoryProfile | None = None
) -> Plan:
    """``base`` (a traced plan) planned with ``result`` for ``budget_bytes``; ``profile`` is
    ``result``'s simulated schedule, simulated here when not given."""
    if profile is None:
        profile = simulate(base.graph, result.schedule)
    return dataclasses.replace(
        base, result=result, activation_budget_bytes=budget_bytes, profile=profile
    )


def match(
    base: Plan,
    args: tuple[Any, ...],
    peer_bytes: int,
    *,
    compiled_peer: bool,
    time_limit_s: float,
    tries: int = 4,
) -> Matched | str:
    """The plan whose measured allocator peak is at most ``peer_bytes`` (see peers.py)."""

    def build(budget_bytes: int) -> Matched | None:
        found = plan_for(base, budget_bytes, time_limit_s)
        if found is None:
            return None
        made, plan_s = found
        module = made.apply(for_compile=compiled_peer)
        tracked = None
        if compiled_peer:
            module = _Compiled(module, chkpt_opt.compile_module)
            try:
                for _ in range(2):
                    run_step(module, args, {})
            except torch._dynamo.exc.BackendCompilerFailed as err:
                raise CompileFailed(str(err).splitlines()[0]) from err
        else:
            tracked = tracked_peak(module, args)
        return Matched(module, allocator_peak(module, args), made, plan_s, tracked)

    target = peer_bytes
    try:
        if compiled_peer:
            keep_all = build(base.profile.peak_bytes)  # Inductor alone may already fit
            if keep_all is not None and keep_all.peak_bytes <= peer_bytes:
                return keep_all
        for _ in range(tries):
            built = build(target)
            if built is None:
                return "infeasible"
            if built.peak_bytes <= peer_bytes:
                return built
            target -= built.peak_bytes - peer_bytes + peer_bytes // 200
    except CompileFailed as err:
        log(f"  torch.compile failed on the plan at {target} bytes: {err}")
        return "compile failed"
    return "not reached"


def relative_gap(result: SolveResult) -> float | str:
    """The result's gap to its bound as a share of its objective; "" without a bound."""
    if result.bound is None:
        return ""
    return (result.objective - result.bound) / result.objective if result.objective > 0 else 0.0


def write_markdown(directory: Path, name: str, lines: list[str]) -> str:
    """Writes ``lines`` to ``directory/name.md`` (made if missing); returns the text."""
    text = "\n".join(lines) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.md").write_text(text)
    return text


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def built_on(name: str, device: str, sizes: dict[str, int]) -> tuple[nn.Module, tuple[Any, ...]]:
    """Model ``name`` (the Hugging Face families at ``sizes``) and its inputs on ``device``."""
    model, args, _ = zoo.on_device(
        MODELS[name](**(sizes if name in hf_zoo.FAMILIES else {})), device
    )
    return model, args


def run(
    name: str,
    *,
    repeats: int,
    skip_compile: bool,
    time_limit_s: float,
    device: str = "cpu",
    sizes: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    model, args = built_on(name, device, sizes or {})
    start = time.perf_counter()
    base = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=True
    )
    trace_s = time.perf_counter() - start
    ops = base.graph.number_of_nodes()
    log(f"{name}: {ops} ops traced in {trace_s:.1f} s")
    modules: dict[str, nn.Module] = {"original": model, "keep-all rewrite": base.apply()}
    modules.update(peers(name, model, args, skip_compile=skip_compile))
    peaks = {label: allocator_peak(module, args) for label, module in modules.items()}
    rows: dict[str, dict[str, Any]] = {}
    original_tracked = tracked_peak(model, args)
    rewrite_tracked = tracked_peak(modules["keep-all rewrite"], args)
    for label, peak in peaks.items():
        log(f"  {label}: {peak / 2**20:.1f} MiB")
        rows[label] = {"model": name, "ops": ops, "strategy": label, "peak_bytes": peak}
    rows["keep-all rewrite"]["note"] = (
        f"tracked peak {rewrite_tracked / original_tracked - 1:+.2%} vs original"
    )
    rows["keep-all rewrite"]["predicted_mib"] = round(base.profile.peak_bytes / 2**20, 1)
    rows["keep-all rewrite"]["prediction_error"] = round(
        base.profile.peak_bytes / rewrite_tracked - 1, 4
    )
    first_with: dict[tuple[Schedule, bool], str] = {}  # (schedule, compiled) -> its first row
    for label in list(peaks):
        if label in ("original", "keep-all rewrite"):
            continue
        compiled_peer = label.startswith("torch.compile")
        found = match(
            base,
            args,
            peaks[label],
            compiled_peer=compiled_peer,
            time_limit_s=time_limit_s,
        )
        ours = f"chkpt_opt @ {label}"
        if isinstance(found, str):
            rows[ours] = {
                "model": name,
                "ops": ops,
                "strategy": ours,
                "matches": label,
                "status": found,
            }
            log(f"  {ours}: {found}")
            continue
        result = found.plan.result
        gap = relative_gap(result)
        row = {
            "model": name,
            "ops": ops,
            "strategy": ours,
            "peak_bytes": found.peak_bytes,
            "matches": label,
            "status": result.status.value,
            "gap": gap if gap == "" else round(gap, 4),
            "plan_s": round(trace_s + found.plan_s, 1),
            "predicted_mib": round(found.plan.profile.peak_bytes / 2**20, 1),
            # What runs: a nested plan compiles its plan without nesting.
            "schedule": schedule_shape(
                (found.plan.for_compile() if compiled_peer else found.plan).schedule
            ),
        }
        if found.tracked_bytes:
            row["prediction_error"] = round(
                found.plan.profile.peak_bytes / found.tracked_bytes - 1, 4
            )
        rows[ours] = row
        first = first_with.setdefault((result.schedule, compiled_peer), ours)
        modules[ours] = modules[first] if first != ours else found.module  # one module a plan
        log(
            f"  {ours}: {found.peak_bytes / 2**20:.1f} MiB ({result.status.value}, "
            f"{found.plan_s:.1f} s)"
        )
    distinct = {id(module): module for module in modules.values()}
    log(f"{name}: timing {len(distinct)} modules x {repeats} rounds")
    by_id = timings({str(key): module for key, module in distinct.items()}, args, repeats)
    times = {label: by_id[str(id(module))] for label, module in modules.items()}
    base_time = statistics.median(times["original"])
    noise = 2 * statistics.median(abs(t - base_time) for t in times["original"]) / base_time
    for label, samples in times.items():
        rows[label]["time_ratio"] = round(statistics.median(samples) / base_time, 3)
    for row in rows.values():
        row["noise"] = round(noise, 3)
        if row.get("matches") and row["strategy"] in times:
            ratio, spread = paired_ratio(times[row["strategy"]], times[row["matches"]])
            row["vs_peer"], row["vs_peer_noise"] = round(ratio, 3), round(spread, 3)
        if row.get("peak_bytes") is not None:
            row["peak_mib"] = round(row["peak_bytes"] / 2**20, 1)
    return list(rows.values())


def schedule_shape(schedule: Schedule) -> str:
    """What a schedule is made of: its outermost regions, nested regions and cached ops."""
    return (
        f"{len(schedule.regions)} regions, {len(schedule.nested)} nested, "
        f"{len(schedule.saved)} cached"
    )


def verdict(row: dict[str, Any], peer: dict[str, Any]) -> str:
    if row.get("time_ratio") is None:
        return f"no ({row.get('status')})"
    fits = row["peak_bytes"] <= peer["peak_bytes"]
    fast = row["vs_peer"] <= 1 + row["vs_peer_noise"]
    return "yes" if fits and fast else "no (" + ("peak" if not fits else "time") + ")"


def markdown(rows: list[dict[str, Any]]) -> str:
    fidelity = [
        "| model | ops | original MiB | keep-all rewrite MiB | rewrite time | prediction |",
        "|---|---|---|---|---|---|",
    ]
    table = [
        "| model | peer | peer MiB | peer time | chkpt_opt MiB | chkpt_opt time | status (gap) "
        "| vs peer | plan s | prediction | dominates |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["model"], r["strategy"]): r for r in rows}
    for row in rows:
        if row["strategy"] == "keep-all rewrite":
            original = by_key[(row["model"], "original")]
            fidelity.append(
                f"| {row['model']} | {row['ops']} | {original['peak_mib']} | {row['peak_mib']} "
                f"({row['peak_bytes'] / original['peak_bytes'] - 1:+.2%}) | "
                f"{row['time_ratio']:.2f} | {row['prediction_error']:+.2%} |"
            )
        if not row["strategy"].startswith("chkpt_opt @ "):
            continue
        peer = by_key[(row["model"], row["matches"])]
        gap = "" if row.get("gap") in (None, "") else f" ({row['gap']:.1%})"
        ours = f"{row['peak_mib']} | {row['time_ratio']:.2f}" if row.get("time_ratio") else " | "
        versus = (
            f"{row['vs_peer']:.2f} ± {row['vs_peer_noise']:.2f}" if row.get("time_ratio") else ""
        )
        pred = (
            "" if row.get("prediction_error") in (None, "") else (f"{row['prediction_error']:+.2%}")
        )
        table.append(
            f"| {row['model']} | {peer['strategy']} | {peer['peak_mib']} | "
            f"{peer['time_ratio']:.2f} | {ours} | {row.get('status', '')}{gap} | {versus} | "
            f"{row.get('plan_s', '')} | {pred} | {verdict(row, peer)} |"
        )
    noise = {r["model"]: r["noise"] for r in rows}
    margins = ", ".join(f"{m} {v:.1%}" for m, v in noise.items())
    return "\n".join(
        [
            *fidelity,
            "",
            *table,
            "",
            "Noise margin of the times against the original (twice the median absolute "
            f'deviation of the original\'s steps): {margins}. "vs peer": the median of the '
            "per-round time ratios of the plan over its peer, ± twice their median absolute "
            "deviation; a plan is as fast as its peer when the median is at most 1 plus that "
            "margin.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument(
        "--compile-models",
        nargs="+",
        choices=list(MODELS),
        help="measure the torch.compile peers on these models only (default: every model)",
    )
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (peaks from its allocator)")
    for size in ("layers", "width", "batch", "seq"):
        parser.add_argument(
            f"--{size}", type=int, help=f"the Hugging Face models' {size} (default: the zoo's)"
        )
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/hf_models"))
    options = parser.parse_args()
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {options.device}: torch sees no CUDA device here; use cpu")
    sizes = {
        size: getattr(options, size)
        for size in ("layers", "width", "batch", "seq")
        if getattr(options, size) is not None
    }
    torch.set_num_threads(options.threads)
    options.output.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for name in options.models:
        skip = options.skip_compile or (
            options.compile_models is not None and name not in options.compile_models
        )
        rows += run(
            name,
            repeats=options.repeats,
            skip_compile=skip,
            time_limit_s=options.time_limit,
            device=options.device,
            sizes=sizes,
        )
        with (options.output / "hf_models.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    text = markdown(rows)
    (options.output / "hf_models.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
