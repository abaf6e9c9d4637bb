"""What planning costs the first training step: wall time by stage, host memory, and the step
time after it, against Hugging Face's own checkpointing.

Run:
    python benchmarks/plan_cost.py                      # 2, 8 and 32 layers, default and 10 s
    python benchmarks/plan_cost.py --layers 2 8 --limits default 10

Model: ``LlamaForCausalLM`` from ``LlamaConfig`` (width 256, vocabulary 2048, random weights,
``benchmarks/finetune.py``'s ``build``), one batch of 8 sequences of lengths drawn in
[32, 128] and padded (``finetune.make_batch``, seed 0), fed at every step. The loop is
``optimizer.zero_grad(); model(**batch).loss.backward(); optimizer.step()`` with AdamW (the
logits are dropped before the backward pass, as ``Trainer`` does). The first plan counts
them held until the first backward pass shows they are not (the schedule made then still
fits and keeps serving); with ``--outputs-dropped``, ``optimize(outputs_held=False)`` plans
for them dropped from the start (at 8 and 32 layers HF checkpointing's peak is below what
fits with them held: 0.3 and 2.3 MB).

Budget: the whole step (chkpt_opt's resident formula plus the measured forward/backward peak)
of the same loop with ``gradient_checkpointing_enable()``, measured in a process of its own.

Each configuration (layers, time limit) runs in a fresh process (``--child``), so that its
peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is its own:

* ``hf``: the loop with HF's checkpointing, 3 steps: peak RSS, then the budget;
* ``ours``: ``chkpt_opt.optimize(model, budget=B, time_limit_s=L)`` and the loop: the first
  step's wall time and its planning split (``attachment_of(model).stats.planning_s``:
  capture, op timing, solve, timed choice), the peak RSS after the first step and after the
  third, the threads and child processes alive after the first step, whether the second step
  planned again, then the step time against HF's checkpointing (a copy with it enabled,
  stepped alternately with the planned model, the order swapped each round: the median of
  the per-round ratios and twice their median absolute deviation), and how long the
  process took to exit after its last line.

Writes ``plan_cost.json`` and ``plan_cost.md`` to ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "PLAN_COST_RESULT "
WIDTH = 256
BATCH = 8
MAX_LEN = 128
SEED = 0
ROUNDS = 8
"""Interleaved timing rounds after planning."""


def _rss_mib() -> float:
    """This process's peak resident set size so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _children() -> list[int]:
    tasks = Path(f"/proc/{os.getpid()}/task")
    return [int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()]


def _setup(layers: int) -> tuple[Any, Any]:
    import torch
    from finetune import build, make_batch

    torch.set_num_threads(1)
    model = build("llama", layers=layers, width=WIDTH, max_len=MAX_LEN, seed=SEED)
    batch = make_batch("llama", torch.Generator().manual_seed(SEED), BATCH, MAX_LEN)
    return model, batch


def _step(model: Any, optimizer: Any, batch: Any) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(**batch.inputs).loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def _hf(model: Any) -> Any:
    clone = copy.deepcopy(model)
    clone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return clone


def child_hf(layers: int) -> dict[str, Any]:
    """The loop with HF's checkpointing: its peak RSS over 3 steps, and its whole-step peak
    (the budget)."""
    import torch
    from finetune import LR, fwd_bwd_peak, resident_of

    model, batch = _setup(layers)
    hf = _hf(model)
    del model
    base_mib = _rss_mib()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=LR)
    times = [_step(hf, optimizer, batch) for _ in range(3)]
    rss_mib = _rss_mib()
    budget = resident_of(hf, batch).step_peak_bytes(fwd_bwd_peak(hf, batch, SEED))
    return {
        "base_rss_mib": base_mib,
        "loop_rss_mib": rss_mib,
        "budget_bytes": budget,
        "step_s": times,
    }


def child_ours(layers: int, limit: str, budget: int, held: bool) -> dict[str, Any]:
    """The planned loop (see the module docstring)."""
    import torch
    from finetune import LR
    from peers import paired_ratio

    import chkpt_opt

    model, batch = _setup(layers)
    reference = _hf(model)  # HF's checkpointing on the same weights, for the step times
    base_mib = _rss_mib()
    threads_before = set(threading.enumerate())
    held_or_seen = None if held else False  # None: as the first backward pass shows
    # 'default': optimize's own default (the whole planning); 'none': no limit at all
    limits = (
        {} if limit == "default" else {"time_limit_s": None if limit == "none" else float(limit)}
    )
    chkpt_opt.optimize(model, budget=budget, outputs_held=held_or_seen, **limits)
    attachment = chkpt_opt.attachment_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    first_s = _step(model, optimizer, batch)
    first_rss = _rss_mib()
    solver_children_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    threads = [t.name for t in threading.enumerate() if t not in threads_before]
    children = _children()
    stats = attachment.stats
    planning = dict(stats.planning_s)
    solves_after_first = stats.solves
    second_s = _step(model, optimizer, batch)
    _step(model, optimizer, batch)
    loop_rss = _rss_mib()
    runner = attachment.runners[-1]
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    ours, peer = [], []
    for i in range(ROUNDS + 1):
        order = [(model, optimizer, ours), (reference, ref_optimizer, peer)]
        for module, opt, out in order if i % 2 else order[::-1]:
            elapsed = _step(module, opt, batch)
            if i:  # the first round warms up
                out.append(elapsed)
    ratio, spread = paired_ratio(ours, peer)
    return {
        "base_rss_mib": base_mib,
        "first_step_s": first_s,
        "planning_s": planning,
        "prepare_s": stats.prepare_s,
        "first_step_rss_mib": first_rss,
        "solver_child_rss_mib": solver_children_rss,
        "loop_rss_mib": loop_rss,
        "threads_after_first_step": threads,
        "children_after_first_step": children,
        "solves_after_first_step": solves_after_first,
        "solves_after_third_step": stats.solves,
        "captures": stats.captures,
        "second_step_s": second_s,
        "regions": len(runner.schedule.regions),
        "predicted_peak_bytes": runner.predicted_peak_bytes,
        "step_ratio_vs_hf": ratio,
        "step_ratio_spread": spread,
        "step_s_median": statistics.median(ours),
        "hf_step_s_median": statistics.median(peer),
    }


def run_child(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """Runs this script as ``--child ...`` and returns its result, with ``exit_lag_s``: the
    seconds between its last line and its exit."""
    command = [sys.executable, __file__, "--child", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    exited = time.time()
    line = next((x for x in done.stdout.splitlines() if x.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"{argv} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(line[len(MARK) :])
    result["exit_lag_s"] = exited - result.pop("last_line_at")
    return result


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    )
    return out.stdout.strip()


def markdown(rows: list[dict[str, Any]], command: str, seconds: float) -> list[str]:
    lines = [
        "# What planning costs the first training step",
        "",
        f"Command: `{command}`; commit {_commit()}; {platform.processor() or 'CPU'}, "
        f"{os.cpu_count()} cores (shared), torch threads 1; run took {seconds / 60:.1f} min.",
        "",
        f"Llama width {WIDTH}, batch {BATCH} x up to {MAX_LEN} tokens, AdamW, loop drops the "
        "logits; budget = HF checkpointing's measured whole-step peak. Each row is a fresh "
        "process (`benchmarks/plan_cost.py` docstring).",
        "",
        "| layers | limit s | first step s | capture s | op timing s | solve s | timed choice "
        "s | planning total s | solves (1st/3rd step) | RSS base MiB | RSS after 1st step MiB "
        "(+ HiGHS child) "
        "| HF loop RSS MiB | threads / children left | exit lag s | step vs HF ckpt |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layers']} | {r['limit']} | failed: {r['error']} |")
            continue
        p = r["planning_s"]
        left = len(r["threads_after_first_step"]), len(r["children_after_first_step"])
        lines.append(
            f"| {r['layers']} | {r['limit']} | {r['first_step_s']:.1f} | "
            f"{p.get('capture', 0):.1f} | {p.get('op timing', 0):.1f} | {p.get('solve', 0):.1f} "
            f"| {p.get('timed choice', 0):.1f} | {sum(p.values()):.1f} | "
            f"{r['solves_after_first_step']}/{r['solves_after_third_step']} | "
            f"{r['base_rss_mib']:.0f} | {r['first_step_rss_mib']:.0f} "
            f"(+{r['solver_child_rss_mib']:.0f}) | "
            f"{r['hf']['loop_rss_mib']:.0f} | {left[0]} / {left[1]} "
            f"({', '.join(r['threads_after_first_step']) or '-'}) | {r['exit_lag_s']:.1f} | "
            f"{r['step_ratio_vs_hf']:.3f} ± {r['step_ratio_spread']:.3f} |"
        )
    lines += [
        "",
        "First step: wall time of the first `zero_grad/forward/backward/step` (planning "
        "included); the split is `attachment_of(model).stats.planning_s`. RSS: peak resident "
        "set size of the process (`ru_maxrss`): base after building the model (and, for the "
        "planned loop, the HF copy used for timing); (+ HiGHS child): the largest peak of the "
        "HiGHS processes the solve ran (0: none ran); HF loop: a process running 3 steps of "
        "the same loop with HF's checkpointing. Threads / children left: threads started and "
        "child processes alive after the first step (tqdm's monitor, started by torch.export's "
        "progress bar, is tqdm's). Exit lag: seconds from the child's last line to its exit. "
        f"Step vs HF ckpt: median of {ROUNDS} interleaved per-round ratios of step time "
        "(planned / HF checkpointing) ± twice their median absolute deviation.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument(
        "--limits",
        nargs="+",
        default=["default", "10"],
        help="time_limit_s values; 'default' leaves it unset (optimize's default, 60 s for "
        "the whole planning), 'none' passes None (no limit)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    parser.add_argument(
        "--outputs-dropped",
        action="store_true",
        help="optimize(outputs_held=False): plan for the logits dropped from the first step "
        "(else counted held until the first backward pass shows they are not)",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        kind, layers = options.child[0], int(options.child[1])
        if kind == "hf":
            result = child_hf(layers)
        else:
            limit = options.child[2]
            result = child_ours(layers, limit, int(options.child[3]), options.child[4] == "held")
        result["last_line_at"] = time.time()
        print(MARK + json.dumps(result), flush=True)
        return
    start = time.perf_counter()
    command = "python benchmarks/plan_cost.py " + shlex.join(sys.argv[1:])
    rows: list[dict[str, Any]] = []
    held = "dropped" if options.outputs_dropped else "held"
    options.out.mkdir(parents=True, exist_ok=True)
    for layers in options.layers:
        hf = run_child(["hf", str(layers)], options.timeout)
        print(f"{layers} layers: HF loop {hf}", file=sys.stderr, flush=True)
        for limit in options.limits:
            try:
                row = run_child(
                    ["ours", str(layers), limit, str(hf["budget_bytes"]), held], options.timeout
                )
            except (RuntimeError, subprocess.TimeoutExpired) as err:  # reported in the table
                row = {"error": str(err).strip().splitlines()[-1][:300]}
            row.update(layers=layers, limit=limit, hf=hf)
            rows.append(row)
            print(f"{layers} layers, limit {limit}: {row}", file=sys.stderr, flush=True)
            (options.out / "plan_cost.json").write_text(json.dumps(rows, indent=1) + "\n")
            text = "\n".join(markdown(rows, command, time.perf_counter() - start))
            (options.out / "plan_cost.md").write_text(text + "\n")
    print("\n".join(markdown(rows, command, time.perf_counter() - start)))


if __name__ == "__main__":
    main()
