"""``auto`` on the layer-level conv nets against Checkmate's program (issue 34).

Per graph of the corpus family ``layers`` (``graphs/*_layers.json``: VGG16, VGG19, FCN-8,
SegNet, U-Net at one node per layer) and budget (a share of the keep-all peak):

* ``auto``: ``get_solver("auto")(graph, budget, time_limit_s=...)``, its extra compute as a
  share of the step (recompute seconds over the step without recomputation), status, time;
* the registered solvers ``cached`` and ``milp_cached`` run alone (the two that beat
  ``auto`` in the issue), and the best of them;
* Checkmate's program (:mod:`chkpt_opt.solvers.bounds.general_milp`): its best schedule,
  its proven bound over every schedule (general rematerialization, ours included), its gap,
  and the peak of its schedule run as Checkmate runs it (over the budget where the
  program's relaxed memory rows let it through);
* the recompute bound (``stats["recompute_bound"]`` of ``auto``) and the floor under every
  peak (budgets below it are infeasible for every schedule).

Results go to ``benchmarks/results/convnets_general/`` (``results.json``, ``results.md``),
written after every row so a cut run keeps what it finished. Not timing-sensitive: only
the solvers' time limits matter.

Usage::

    python benchmarks/convnets_general.py                       # every graph and budget
    python benchmarks/convnets_general.py --graphs vgg19 segnet --budgets 0.8 0.5 \
        --out benchmarks/results/convnets_general_some   # a part, beside the full results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chkpt_opt.errors import ChkptOptError  # noqa: E402
from chkpt_opt.graphs.costgraph import total_compute_s  # noqa: E402
from chkpt_opt.graphs.io import load_graph  # noqa: E402
from chkpt_opt.memory_model.schedule import Schedule  # noqa: E402
from chkpt_opt.memory_model.simulate import simulate  # noqa: E402
from chkpt_opt.solvers import get_solver  # noqa: E402
from chkpt_opt.solvers.bounds.general_milp import general_bound  # noqa: E402
from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound  # noqa: E402

GRAPHS = ("vgg16", "vgg19", "fcn8", "segnet", "unet")
BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5)
ALONE = ("cached", "milp_cached")
OUT = ROOT / "benchmarks" / "results" / "convnets_general"


def _pct(seconds: float | None, step_s: float) -> float | None:
    return None if seconds is None else round(100 * seconds / step_s, 3)


def _run(name: str, graph, budget: int, limit_s: float, step_s: float, **kw) -> dict:
    start = time.monotonic()
    try:
        result = get_solver(name, **kw)(graph, budget, time_limit_s=limit_s)
    except ChkptOptError as err:
        return {"status": "error", "error": str(err)[:200], "s": round(time.monotonic() - start, 1)}
    fits = result.schedule is not None and result.peak_bytes <= budget
    return {
        "status": result.status.value,
        "extra_pct": _pct(result.objective, step_s) if fits else None,
        "s": round(time.monotonic() - start, 1),
        "stats": {k: result.stats[k] for k in ("chosen", "recompute_bound") if k in result.stats},
    }


def run_one(family: str, share: float, args: argparse.Namespace) -> dict:
    graph = load_graph(ROOT / "graphs" / f"{family}_layers.json")
    keep_all = simulate(graph, Schedule()).peak_bytes
    budget = int(share * keep_all)
    step_s = total_compute_s(graph)
    row: dict = {"graph": family, "ops": graph.number_of_nodes(), "share": share}
    row["keep_all_mib"] = round(keep_all / 2**20, 1)
    cover = recompute_bound(graph, budget)
    row["floor_share"] = round(cover.floor_bytes / keep_all, 4)
    row["recompute_bound_pct"] = _pct(cover.bound_s, step_s)
    if cover.proves_infeasible:
        row["infeasible"] = True
        return row
    row["auto"] = _run("auto", graph, budget, args.time_limit, step_s)
    for name in ALONE:
        row[name] = _run(name, graph, budget, args.alone_limit, step_s)
    found = [row[n]["extra_pct"] for n in ALONE if row[n].get("extra_pct") is not None]
    row["best_alone_pct"] = min(found, default=None)
    milp = general_bound(graph, budget, time_limit_s=args.milp_limit)
    row["milp"] = {
        "status": milp.status,
        "best_pct": _pct(milp.objective_s, step_s),
        "bound_pct": _pct(milp.bound_s, step_s),
        "checkmate_peak_share": (
            None
            if milp.checkmate_peak_bytes is None
            else round(milp.checkmate_peak_bytes / budget, 4)
        ),
        "s": round(milp.solve_s, 1),
        "recomputed": [list(x) for x in milp.recomputed],
    }
    return row


def _cell(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}%"


CHEAP = ("pool", "unpool", "cat", "up")
"""Layers that save no input of their own worth keeping: max-pool, unpool, concat, upsample."""


def why(row: dict) -> str:
    """Where ``auto`` is more than 0.3 points above the general optimum: what the general
    schedule recomputes, the cheap layers (pools, unpools, concats, upsamples) first. Since
    recompute on unpack (issue 34) ``auto`` can rebuild a cheap layer's output from what is
    kept anyway; what remains is a chain of them (a concat of an upsample: our recipe keeps
    the inner layer's output) or a search that stops short (docs/general-optimum.md)."""
    done = sorted({op for _, ops in row["milp"]["recomputed"] for op in ops})
    cheap = [op for op in done if op.startswith(CHEAP)]
    convs = [op for op in done if not op.startswith(CHEAP)]
    if not done:
        return "the general schedule recomputes nothing"
    return f"the general schedule recomputes {', '.join(cheap + convs)}"


def table(rows: list[dict]) -> str:
    lines = [
        "| graph (ops, keep-all MiB) | budget | auto | best of cached / milp_cached alone "
        "| Checkmate program: best (its peak run as Checkmate runs it) | proven bound | "
        "auto - bound, points | why, where above +0.3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"{r['graph']} ({r['ops']}, {r['keep_all_mib']:.0f})"
        if r.get("infeasible"):
            lines.append(
                f"| {head} | {r['share']:.0%} | infeasible: every schedule peaks above "
                f"{r['floor_share']:.1%} of keep-all | | | | | |"
            )
            continue
        auto, milp = r["auto"], r["milp"]
        best = milp["best_pct"]
        peak = milp["checkmate_peak_share"]
        bound = milp["bound_pct"]
        if milp["status"] == "infeasible":
            best_cell = "infeasible"
        else:
            fits = "fits" if peak is not None and peak <= 1 else f"{peak:.2f}x budget"
            best_cell = f"{_cell(best)} ({fits})"
        diff = (
            None
            if auto.get("extra_pct") is None or bound is None
            else round(auto["extra_pct"] - bound, 2)
        )
        lines.append(
            f"| {head} | {r['share']:.0%} | {_cell(auto.get('extra_pct'))} ({auto['status']}, "
            f"{auto['s']:.0f} s) | {_cell(r['best_alone_pct'])} | {best_cell} | "
            f"{_cell(bound)} ({milp['status']}, {milp['s']:.0f} s) | "
            f"{'—' if diff is None else f'{diff:+.2f}'} | {why(r) if diff and diff > 0.3 else ''} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="*", default=list(GRAPHS), choices=GRAPHS)
    parser.add_argument("--budgets", nargs="*", type=float, default=list(BUDGETS))
    parser.add_argument("--time-limit", type=float, default=60.0, help="auto's, seconds")
    parser.add_argument("--alone-limit", type=float, default=30.0, help="each solver alone")
    parser.add_argument("--milp-limit", type=float, default=180.0, help="Checkmate's program")
    parser.add_argument("--table-only", action="store_true", help="rewrite results.md")
    parser.add_argument("--out", type=Path, default=OUT, help="folder of the results")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        rows = json.loads((out / "results.json").read_text())["rows"]
        (out / "results.md").write_text(table(rows))
        return
    rows: list[dict] = []
    for family in args.graphs:
        for share in args.budgets:
            rows.append(run_one(family, share, args))
            settings = {k: str(v) if k == "out" else v for k, v in vars(args).items()}
            (out / "results.json").write_text(
                json.dumps({"settings": settings, "rows": rows}, indent=1)
            )
            (out / "results.md").write_text(table(rows))
            print(table(rows[-1:]).splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
