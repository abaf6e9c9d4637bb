"""The peers side by side: checkpointing strategies against chkpt_opt plans, measured in one run.

Run:
    python benchmarks/peers.py                  # GPT-style model and ResNet, all peers
    python benchmarks/peers.py --skip-compile   # without the torch.compile peers (faster)

For each model it measures, on the CPU and in one process:

* no checkpointing;
* ``torch.utils.checkpoint`` on every block;
* ``checkpoint_sequential`` over the blocks (ceil(sqrt(n)) segments);
* selective activation checkpointing per block saving matmul/convolution/attention outputs;
* ``torch.compile`` with ``activation_memory_budget`` 0.5 and 0.2;
* for every peer, the chkpt_opt plan (solver ``auto``, op times measured on this machine)
  whose measured peak is at most that peer's; for the ``torch.compile`` peers, the chkpt_opt
  plan compiled with its decisions honoured (``chkpt_opt.compile_module``).

Peak memory is measured exactly from the CPU allocator's events (the profiler), the same
ruler for eager and compiled code; it is the peak of one forward + backward above the
parameters and inputs (optimizer state not included, as no optimizer steps). Step time is
the median of interleaved steps, reported as a ratio to no checkpointing measured in the
same run. Writes peers.csv, peers.md and peers.png to the output directory.
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.measurement.step import measure_step_allocator, run_step

aten = torch.ops.aten
SAVE_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.convolution.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


class Checkpointed(nn.Module):
    """A block run through non-reentrant checkpoint (optionally selective)."""

    def __init__(self, block: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context_fn is None:
            return checkpoint(self.block, x, use_reentrant=False)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn)


class Sequentially(nn.Module):
    """Blocks run through ``checkpoint_sequential``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.segments = math.ceil(math.sqrt(len(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _blocks(model: nn.Module) -> tuple[nn.Module, str]:
    """The container of the model's repeated blocks and its attribute name."""
    for name in ("blocks", "layers"):
        if hasattr(model, name):
            return getattr(model, name), name
    raise ValueError(f"{type(model).__name__} has no blocks or layers")


def with_blocks(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """A deep copy of ``model`` with every block wrapped."""
    clone = copy.deepcopy(model)
    container, name = _blocks(clone)
    wrapped = [wrap(b) for b in container]
    setattr(
        clone,
        name,
        type(container)(wrapped)
        if isinstance(container, nn.ModuleList)
        else nn.Sequential(*wrapped),
    )
    return clone


def with_sequential(model: nn.Module) -> nn.Module:
    clone = copy.deepcopy(model)
    container, name = _blocks(clone)
    seq = Sequentially(list(container))
    setattr(clone, name, nn.ModuleList([seq]) if isinstance(container, nn.ModuleList) else seq)
    return clone


class _Compiled(nn.Module):
    """``inner`` compiled through a function whose code object is new for every instance.

    Dynamo caches compiled frames per code object and does not guard on the partitioner's
    settings: two copies of one model compiled under different ``activation_memory_budget``
    values would otherwise share the first compilation.
    """

    def __init__(self, inner: nn.Module, compile_fn: Callable[..., Any] = torch.compile) -> None:
        super().__init__()
        self.inner = inner
        namespace: dict[str, Any] = {"inner": inner}
        exec("def step(*args, **kwargs):\n    return inner(*args, **kwargs)", namespace)
        self.step = compile_fn(namespace["step"])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.step(*args, **kwargs)


def compiled(model: nn.Module, budget: float, args: tuple[Any, ...]) -> nn.Module:
    module = _Compiled(copy.deepcopy(model))
    with torch._functorch.config.patch(activation_memory_budget=budget):
        for _ in range(2):  # compile forward and backward, then warm up
            run_step(module, args, {})
    return module


def peers(model: nn.Module, args: tuple[Any, ...], *, skip_compile: bool) -> dict[str, nn.Module]:
    sac = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    out: dict[str, nn.Module] = {
        "no checkpointing": model,
        "checkpoint every block": with_blocks(model, Checkpointed),
        "checkpoint_sequential": with_sequential(model),
        "selective, save matmuls": with_blocks(model, lambda b: Checkpointed(b, sac)),
    }
    if not skip_compile:
        for budget in (0.5, 0.2):
            print(
                f"  compiling with activation_memory_budget={budget}", file=sys.stderr, flush=True
            )
            out[f"torch.compile budget {budget}"] = compiled(model, budget, args)
    return out


def timings(
    modules: dict[str, nn.Module], args: tuple[Any, ...], repeats: int
) -> dict[str, list[float]]:
    """Interleaved step times: every round runs every module once (on CUDA, from a
    synchronized start to the step's last kernel)."""
    on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in modules}
    for module in modules.values():
        run_step(module, args, {})  # warm up
    for _ in range(repeats):
        for name, module in modules.items():
            for p in module.parameters():
                p.grad = None
            sync()
            start = time.perf_counter()
            run_step(module, args, {})
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(ours: list[float], peer: list[float]) -> tuple[float, float]:
    """The median of the per-round time ratios ``ours / peer`` and twice their median
    absolute deviation: the two were timed in the same rounds, so load that slows a
    round slows both, and the ratio's own spread is the margin that matters."""
    ratios = [a / b for a, b in zip(ours, peer, strict=True)]
    middle = statistics.median(ratios)
    return middle, 2 * statistics.median(abs(r - middle) for r in ratios)


def chkpt_opt_for(
    model: nn.Module,
    args: tuple[Any, ...],
    peak_bytes: int,
    *,
    solver: str,
    for_compile: bool = False,
    tries: int = 6,
) -> tuple[nn.Module | None, int, str]:
    """The chkpt_opt plan whose measured allocator peak is at most ``peak_bytes``.

    Eager: the plan's forward/backward budget starts at the peer's peak; if the measured peak
    comes out higher (kernel workspace the tracer does not see), it is lowered by the excess.
    Compiled: inductor frees buffers earlier than eager, so a plan made for a larger eager
    budget may still fit; the budget is bisected between the peer's peak and the
    store-everything peak, keeping the largest one whose compiled step fits (first trying no
    region at all: compiled code alone may already fit).
    """
    base = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=True
    )
    resident = base.static.resident_bytes

    def build(dynamic_bytes: int) -> tuple[nn.Module, int, str] | None:
        try:
            plan = chkpt_opt.plan(
                model,
                args,
                budget=resident + dynamic_bytes,
                optimizer=None,
                solver=solver,
                profile_times=True,
            )
        except chkpt_opt.InfeasibleBudgetError:
            return None
        module = plan.apply(for_compile=for_compile)
        if for_compile:
            module = _Compiled(module, chkpt_opt.compile_module)
            for _ in range(2):
                run_step(module, args, {})
        torch.manual_seed(0)
        return module, measure_step_allocator(module, args), plan.result.status.value

    if not for_compile:
        target = peak_bytes
        for _ in range(tries):
            built = build(target)
            if built is None:
                return None, 0, "infeasible"
            if built[1] <= peak_bytes:
                return built
            # Solves under a time limit may differ a little from run to run: step past the
            # excess by a further 0.5% of the peak.
            target -= built[1] - peak_bytes + peak_bytes // 200
        return None, 0, "not reached"
    best = None
    lo, hi = peak_bytes, base.profile.peak_bytes
    built = build(hi)  # no recompute region: plain torch.compile may already fit
    if built is not None and built[1] <= peak_bytes:
        return built
    built = build(lo)
    if built is None or built[1] > peak_bytes:
        return None, 0, "not reached" if built else "infeasible"
    best = built
    for _ in range(tries - 1):
        mid = (lo + hi) // 2
        built = build(mid)
        if built is not None and built[1] <= peak_bytes:
            best, lo = built, mid
        else:
            hi = mid
    return best


def run(
    model_name: str,
    build: Callable[[], zoo.Built],
    *,
    repeats: int,
    skip_compile: bool,
    solver: str,
) -> list[dict[str, Any]]:
    model, args, _ = build()
    print(f"{model_name}: building peers", file=sys.stderr, flush=True)
    modules = peers(model, args, skip_compile=skip_compile)
    peaks = {}
    for name, module in modules.items():
        torch.manual_seed(0)
        peaks[name] = measure_step_allocator(module, args)
        print(f"  {name}: peak {peaks[name] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    ours: dict[str, nn.Module] = {}
    ours_peak: dict[str, int] = {}
    ours_status: dict[str, str] = {}
    for name in modules:
        if name == "no checkpointing":
            continue
        is_compiled = name.startswith("torch.compile")
        module, measured, status = chkpt_opt_for(
            model, args, peaks[name], solver=solver, for_compile=is_compiled
        )
        ours_status[name] = status
        if module is not None:
            ours[f"chkpt_opt @ {name}"] = module  # compiled too when the peer is compiled
            ours_peak[f"chkpt_opt @ {name}"] = measured
            print(
                f"  chkpt_opt at the peak of {name}: {measured / 2**20:.1f} MiB ({status})",
                file=sys.stderr,
                flush=True,
            )
    all_modules = {**modules, **ours}
    print(
        f"{model_name}: timing {len(all_modules)} strategies x {repeats} rounds",
        file=sys.stderr,
        flush=True,
    )
    times = timings(all_modules, args, repeats)
    base = statistics.median(times["no checkpointing"])
    spread = statistics.median(abs(t - base) for t in times["no checkpointing"]) / base
    rows = []
    for name in all_modules:
        ratio = statistics.median(times[name]) / base
        rows.append(
            {
                "model": model_name,
                "strategy": name,
                "peak_bytes": ours_peak.get(name, peaks.get(name)),
                "peak_mib": round(ours_peak.get(name, peaks.get(name, 0)) / 2**20, 1),
                "time_ratio": round(ratio, 3),
                "noise": round(spread, 3),
                "matches": name.split(" @ ", 1)[1] if name.startswith("chkpt_opt @ ") else "",
            }
        )
    for name, status in ours_status.items():
        if f"chkpt_opt @ {name}" not in ours:
            rows.append(
                {
                    "model": model_name,
                    "strategy": f"chkpt_opt @ {name}",
                    "peak_bytes": "",
                    "peak_mib": "",
                    "time_ratio": "",
                    "noise": round(spread, 3),
                    "matches": name,
                    "status": status,
                }
            )
    return rows


def dominance(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: per model and peer, the peer's point beside chkpt_opt's."""
    lines = [
        "| model | peer | peer peak MiB | peer time | chkpt_opt peak MiB | chkpt_opt time "
        "| dominates |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row["strategy"].startswith("chkpt_opt @ "):
            continue
        peer = next(
            r for r in rows if r["model"] == row["model"] and r["strategy"] == row["matches"]
        )
        margin = 2 * row["noise"]
        if row["time_ratio"] == "":
            verdict = f"no ({row.get('status', 'not found')})"
        else:
            ok = row["peak_bytes"] <= peer["peak_bytes"] and row["time_ratio"] <= peer[
                "time_ratio"
            ] * (1 + margin)
            verdict = "yes" if ok else "no"
        ours_time = "" if row["time_ratio"] == "" else f"{row['time_ratio']:.2f}"
        lines.append(
            f"| {row['model']} | {peer['strategy']} | {peer['peak_mib']} | "
            f"{peer['time_ratio']:.2f} | {row['peak_mib']} | {ours_time} | {verdict} |"
        )
    return lines


NOISE_NOTE = "Noise margin: twice the median absolute deviation of the no-checkpointing steps."


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes.flat, models):
        pts = [r for r in rows if r["model"] == model and r["time_ratio"] != ""]
        for r in pts:
            ours = r["strategy"].startswith("chkpt_opt")
            ax.scatter(
                r["peak_mib"],
                r["time_ratio"],
                marker="o" if ours else "s",
                s=40,
                color="tab:blue" if ours else "tab:red",
                zorder=3,
            )
            label = "" if ours else r["strategy"]
            ax.annotate(
                label,
                (r["peak_mib"], r["time_ratio"]),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ours_pts = sorted(
            (r["peak_mib"], r["time_ratio"]) for r in pts if r["strategy"].startswith("chkpt_opt")
        )
        if ours_pts:
            ax.plot(
                [p[0] for p in ours_pts],
                [p[1] for p in ours_pts],
                color="tab:blue",
                alpha=0.5,
                label="chkpt_opt plans",
            )
        ax.scatter([], [], marker="s", color="tab:red", label="peers")
        ax.set_title(f"{model}: forward+backward peak vs step time (CPU)", fontsize=9)
        ax.set_xlabel("measured peak (MiB, allocator)")
        ax.set_ylabel("step time / no checkpointing")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"], choices=["gpt", "resnet"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/peers"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builders = {"gpt": zoo.gpt, "resnet": zoo.resnet}
    rows: list[dict[str, Any]] = []
    for name in args.models:
        rows += run(
            name,
            builders[name],
            repeats=args.repeats,
            skip_compile=args.skip_compile,
            solver=args.solver,
        )
    args.output.mkdir(parents=True, exist_ok=True)
    fields = [
        "model",
        "strategy",
        "peak_bytes",
        "peak_mib",
        "time_ratio",
        "noise",
        "matches",
        "status",
    ]
    with (args.output / "peers.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    table = ["| model | strategy | peak MiB | time vs none |", "|---|---|---|---|"]
    table += [
        f"| {r['model']} | {r['strategy']} | {r['peak_mib']} | {r['time_ratio']} |" for r in rows
    ]
    text = "\n".join(
        [
            *table,
            "",
            *dominance(rows),
            "",
            NOISE_NOTE,
        ]
    )
    (args.output / "peers.md").write_text(text + "\n")
    plot(rows, args.output / "peers.png")
    print(text)


if __name__ == "__main__":
    main()
