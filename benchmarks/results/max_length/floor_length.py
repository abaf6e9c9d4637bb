"""The longest sequence any executable schedule could fit in the budget of
``benchmarks/max_length.py``: where the recompute bound's floor (a lower bound on the
forward/backward peak of every schedule, :mod:`chkpt_opt.solvers.bounds.recompute_bound`)
exceeds the activation budget, no schedule fits; the floor is a linear program, seconds
per length, so the longest length it allows is found by bisection on a fine grid.

Run (from the repository root):
    OMP_NUM_THREADS=1 python benchmarks/results/max_length/floor_length.py \
        --lo 1152 --hi 1280 --step 16 --batches 2 3 -o floor_length.json

``--lo`` is a length the floor allows (chkpt_opt's longest), ``--hi`` one it refuses; the
graph is the one ``max_length.py`` plans (logits dropped before the backward pass), the
budget its HF checkpointing peak at 512 tokens (``--budget-bytes``). ``--batches``: the
floor at those batches of ``--batch-tokens`` tokens too (``largest_batch_floor_allows``:
the largest of them it allows).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import max_length  # noqa: E402

from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound  # noqa: E402


def probe(layers: int, mode: str, tokens: int, budget_bytes: int, batch: int = 1) -> dict:
    """The floor at ``batch`` x ``tokens`` against the activation budget there."""
    data = max_length.make_batch(batch, tokens, 0)
    graph, static, act = max_length.graph_at(max_length.build(layers, mode), data, budget_bytes)
    start = time.perf_counter()
    floor = recompute_bound(graph, act).floor_bytes
    return {
        "batch": batch,
        "tokens": tokens,
        "ops": graph.number_of_nodes(),
        "activation_budget_bytes": act,
        "floor_bytes": floor,
        "floor_step_bytes": static.step_peak_bytes(floor),
        "fits": floor <= act,
        "bound_s": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--mode", default="lora", choices=["lora", "full"])
    parser.add_argument("--budget-bytes", type=int, default=138_755_848)
    parser.add_argument("--lo", type=int, required=True, help="a length the floor allows")
    parser.add_argument("--hi", type=int, required=True, help="a length the floor refuses")
    parser.add_argument("--step", type=int, default=16, help="grid, tokens")
    parser.add_argument(
        "--batches", type=int, nargs="*", default=[], help="batches probed at --batch-tokens"
    )
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    batches = [
        probe(args.layers, args.mode, args.batch_tokens, args.budget_bytes, batch=b)
        for b in args.batches
    ]
    for p in batches:
        print(json.dumps(p), flush=True)
    probes = [probe(args.layers, args.mode, n, args.budget_bytes) for n in (args.lo, args.hi)]
    for p in probes:
        print(json.dumps(p), flush=True)
    if not probes[0]["fits"] or probes[1]["fits"]:
        raise SystemExit(f"--lo must fit and --hi must not: {probes}")
    lo, hi = args.lo, args.hi
    while hi - lo > args.step:
        mid = lo + (hi - lo) // (2 * args.step) * args.step
        probes.append(probe(args.layers, args.mode, mid, args.budget_bytes))
        print(json.dumps(probes[-1]), flush=True)
        lo, hi = (mid, hi) if probes[-1]["fits"] else (lo, mid)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    out = {
        "command": " ".join(sys.argv),
        "commit": commit,
        "budget_bytes": args.budget_bytes,
        "longest_floor_allows": lo,
        "shortest_floor_refuses": hi,
        "probes": sorted(probes, key=lambda p: p["tokens"]),
        "largest_batch_floor_allows": max((p["batch"] for p in batches if p["fits"]), default=0),
        "batch_probes": batches,
    }
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    keys = ("longest_floor_allows", "shortest_floor_refuses", "largest_batch_floor_allows")
    print(json.dumps({k: out[k] for k in keys}))


if __name__ == "__main__":
    main()
