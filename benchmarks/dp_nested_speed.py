"""dp_nested's solve time, against another revision of chkpt_opt, interleaved in one run.

    python benchmarks/dp_nested_speed.py --against HEAD~1 --repeats 3
    python benchmarks/dp_nested_speed.py --against HEAD~1 --only within -o out/  # timed

Cases: the zoo's VGG at 64² images (the benchmark's conv net where nesting wins most) at
0.7, 0.6 and 0.5 of its keep-all peak and its lowest peak (a budget of 0); the 32-layer
deep chain of ``general_space.py`` at its lowest peak (its budget solves take minutes;
the corpus's ``mlp_large`` at its lowest peak runs past 180 s in both revisions); two
corpus transformers over their blocks (``CORPUS_CASES``). The
graphs are built once, here, and saved, so both revisions solve the same graphs. Every
solve runs in its own process (a fresh interpreter, nothing cached), with the revisions in
alternating order from one round to the next; the ``--against`` revision is checked out
into a temporary git worktree.

Per case: the median solve time of each revision, the median of the per-round ratios
(this tree over the other) with twice their median absolute deviation, and whether both
returned the same status, recompute time and peak (an exact solver must, unless its time
limit cut it short: the ``TIMED_CASES``, where the median recompute time of each revision's
incumbent is what to compare). ``--only`` runs the cases whose names contain one of its
words. Writes ``results.json`` and ``results.md`` to the output directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SOLVE = """
import json, sys, time
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.solvers import get_solver
graph = load_graph(sys.argv[1])
start = time.perf_counter()
result = get_solver("dp_nested")(graph, int(sys.argv[2]), time_limit_s=float(sys.argv[3]))
print(json.dumps({
    "solve_s": time.perf_counter() - start,
    "status": result.status.value,
    "objective_s": result.objective,
    "peak_bytes": result.peak_bytes,
    "frames": result.stats.get("frames_solved"),
}))
"""

DEFAULT_OUTPUT = ROOT / "benchmarks/results/dp_nested_speed"

CORPUS_CASES = (("gpt_small", 0.29), ("gpt_reference", 0.16))
"""Corpus graphs planned as blocks between separators, each block free to run its keep-set
options, below their smallest keep-set peaks (0.306 and 0.202 of keep-all), where ``auto``
runs ``dp_nested`` over blocks."""

TIMED_CASES = (("deep_chain", 0.189, 30.0), ("encoder_large", 0.15, 60.0))
"""Solves that their time limit (seconds) cuts short, so that the incumbent of the coarse
cuts is the answer and its recompute time is what to compare: the deep chain at about
0.75 of its smallest keep-set budget (its full solve takes minutes), and the corpus's
``encoder_large`` (53 block cuts) below its smallest keep-set peak (0.166 of keep-all)."""


def build_cases(directory: Path) -> list[tuple[str, Path, int, float | None]]:
    """``(name, graph file, activation budget, time limit or None)`` of every case (module
    docstring)."""
    import chkpt_opt
    from chkpt_opt import zoo
    from chkpt_opt.graphs.io import load_graph, save_graph
    from chkpt_opt.memory_model.schedule import Schedule
    from chkpt_opt.memory_model.simulate import simulate

    cases: list[tuple[str, Path, int, float | None]] = []
    saved: dict[str, tuple[Path, int]] = {}  # built graphs: file, keep-all peak
    built = {
        "vgg64": zoo.vgg(widths=(16, 32, 64, 128), convs_per_stage=3, image=64, batch=8),
        "deep_chain": zoo.relu_chain(width=256, depth=32, batch=4096),
    }
    fractions = {"vgg64": (0.7, 0.6, 0.5, 0.0), "deep_chain": (0.0,)}
    for name, (model, args, _) in built.items():
        graph = chkpt_opt.trace(model, args)
        path = directory / f"{name}.json"
        save_graph(graph, path)
        keep_all = simulate(graph, Schedule()).peak_bytes
        saved[name] = path, keep_all
        cases += [(f"{name} @ {f}", path, int(keep_all * f), None) for f in fractions[name]]
    for name, f, limit in [*((name, f, None) for name, f in CORPUS_CASES), *TIMED_CASES]:
        if name in saved:
            path, keep_all = saved[name]
        else:
            path = ROOT / "graphs" / f"{name}.json"
            keep_all = simulate(load_graph(path), Schedule()).peak_bytes
        label = f"{name} @ {f}" + (f" within {limit:g} s" if limit else "")
        cases.append((label, path, int(keep_all * f), limit))
    return cases


def solve(tree: Path, graph: Path, budget: int, time_limit_s: float) -> dict:
    """One dp_nested solve by the chkpt_opt of ``tree``, in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", SOLVE, str(graph), str(budget), str(time_limit_s)],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def same(a: dict, b: dict) -> bool:
    """Whether two solves returned the same answer (status, cost to 1e-12 s, peak)."""
    return (
        a["status"] == b["status"]
        and a["peak_bytes"] == b["peak_bytes"]
        and abs(a["objective_s"] - b["objective_s"]) <= 1e-12
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="git revision to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per solve")
    parser.add_argument(
        "--only", nargs="+", default=[], help="run the cases whose names contain one of these"
    )
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT)
    options = parser.parse_args()
    revision = subprocess.run(
        ["git", "rev-parse", "--short", options.against],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    here = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "other"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(other), revision],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            cases = [
                case
                for case in build_cases(Path(scratch))
                if not options.only or any(word in case[0] for word in options.only)
            ]
            trees = {"this": ROOT, "other": other}
            runs: dict[str, dict[str, list[dict]]] = {
                c[0]: {"this": [], "other": []} for c in cases
            }
            for k in range(options.repeats):
                for name, graph, budget, limit in cases:
                    order = ["this", "other"] if k % 2 == 0 else ["other", "this"]
                    for which in order:
                        out = solve(trees[which], graph, budget, limit or options.time_limit)
                        runs[name][which].append(out)
                        print(json.dumps({"case": name, "tree": which, **out}), flush=True)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False
            )
    rows = []
    for name, _, budget, _ in cases:
        mine, theirs = runs[name]["this"], runs[name]["other"]
        ratios = [a["solve_s"] / b["solve_s"] for a, b in zip(mine, theirs)]
        ratio = statistics.median(ratios)
        rows.append(
            {
                "case": name,
                "budget_bytes": budget,
                "this_s": round(statistics.median(r["solve_s"] for r in mine), 2),
                "other_s": round(statistics.median(r["solve_s"] for r in theirs), 2),
                "ratio": round(ratio, 3),
                "spread": round(2 * statistics.median(abs(r - ratio) for r in ratios), 3),
                "same_answer": all(same(a, b) for a, b in zip(mine, theirs)),
                "status": mine[0]["status"],
                "frames_this": mine[0]["frames"],
                "frames_other": theirs[0]["frames"],
                "recompute_this_s": statistics.median(r["objective_s"] for r in mine),
                "recompute_other_s": statistics.median(r["objective_s"] for r in theirs),
            }
        )
    command = (
        f"python benchmarks/dp_nested_speed.py --against {options.against} "
        f"--repeats {options.repeats}"
        + (f" --only {' '.join(options.only)}" if options.only else "")
        + (f" -o {options.output}" if options.output != DEFAULT_OUTPUT else "")
    )
    options.output.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "this": here, "other": revision, "rows": rows}
    (options.output / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"`{command}`: this tree ({here}) against {revision}; median of {options.repeats} "
        "interleaved rounds, each solve in a fresh process.",
        "",
        "| case | status | this s | other s | ratio (± 2 MAD) | frames this / other "
        "| recompute this / other (s) | same answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['status']} | {r['this_s']} | {r['other_s']} | "
            f"{r['ratio']:.2f} ± {r['spread']:.2f} | {r['frames_this']} / {r['frames_other']} "
            f"| {r['recompute_this_s']:.4g} / {r['recompute_other_s']:.4g} "
            f"| {'yes' if r['same_answer'] else 'NO'} |"
        )
    (options.output / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
