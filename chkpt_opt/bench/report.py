"""Paper-ready outputs of a sweep: a LaTeX table and matplotlib figures.

* :func:`latex_table`: one row per graph and budget, one column per solver, the extra
  compute as a percentage of the step (bold where proven optimal, a dagger where infeasible).
* :func:`plot_overhead_vs_budget`: per graph, overhead against budget with one step line
  per solver (the figure style of Checkmate).
* :func:`plot_solve_time`: solve time against graph size per solver.
* :func:`plot_timeline`: the memory timeline of a plan, predicted beside measured.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path


def _float(value: str) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _grid(
    rows: Sequence[dict[str, str]], cell: Callable[[dict[str, str], float | None], str]
) -> tuple[list[str], dict[tuple[str, str], dict[str, str]], dict[str, int]]:
    """The solvers, the cell text of every (graph, budget fraction) and solver, and each
    graph's op count. ``cell`` gets a row and its overhead (None: nothing fits the budget)."""
    solvers = sorted({r["solver"] for r in rows})
    cells: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    nodes: dict[str, int] = {}
    for r in rows:
        overhead = _float(r["overhead"])
        fits = r["status"] in ("optimal", "feasible") and overhead is not None
        cells[(r["graph"], r["budget_fraction"])][r["solver"]] = cell(r, overhead if fits else None)
        nodes[r["graph"]] = int(r["nodes"])
    return solvers, cells, nodes


def latex_table(rows: Sequence[dict[str, str]]) -> str:
    """A booktabs table of overheads (graph x budget rows, solver columns)."""

    def cell(r: dict[str, str], overhead: float | None) -> str:
        if overhead is None:
            return "$\\dagger$"
        text = f"{100 * overhead:.1f}"
        return f"\\textbf{{{text}}}" if r["status"] == "optimal" else text

    solvers, cells, nodes = _grid(rows, cell)
    lines = [
        "\\begin{tabular}{lrr" + "r" * len(solvers) + "}",
        "\\toprule",
        "graph & ops & budget & " + " & ".join(s.replace("_", "\\_") for s in solvers) + " \\\\",
        "\\midrule",
    ]
    for graph, fraction in sorted(cells, key=lambda k: (k[0], -float(k[1]))):
        row = cells[(graph, fraction)]
        lines.append(
            f"{graph.replace('_', chr(92) + '_')} & {nodes[graph]} & "
            f"{100 * float(fraction):.0f}\\% & "
            + " & ".join(row.get(s, "--") for s in solvers)
            + " \\\\"
        )
    lines += [
        "\\bottomrule",
        "\\end{tabular}",
        "% extra compute, % of the step without recomputation; bold: proven optimal;",
        "% dagger: no schedule found within the budget.",
    ]
    return "\n".join(lines) + "\n"


def markdown_summary(rows: Sequence[dict[str, str]]) -> str:
    """One Markdown row per graph and budget: each solver's extra compute and status.

    ``12.3%*``: proven optimal; ``12.3%``: feasible; ``12.3% (gap 0.5%)``: feasible with a
    proven gap; ``-``: no schedule within the budget (infeasible or not found).
    """

    def cell(r: dict[str, str], overhead: float | None) -> str:
        if overhead is None:
            return "-"
        text = f"{100 * overhead:.1f}%"
        if r["status"] == "optimal":
            text += "*"
        elif _float(r["gap"]) is not None:
            text += f" (gap {100 * float(r['gap']):.1f}%)"
        return text + f" {float(r['solve_s']):.0f}s"

    solvers, cells, nodes = _grid(rows, cell)
    lines = [
        "| graph | ops | budget | " + " | ".join(solvers) + " |",
        "|---|---|---|" + "---|" * len(solvers),
    ]
    for graph, fraction in sorted(cells, key=lambda k: (nodes[k[0]], k[0], -float(k[1]))):
        row = cells[(graph, fraction)]
        lines.append(
            f"| {graph} | {nodes[graph]} | {100 * float(fraction):.0f}% | "
            + " | ".join(row.get(s, "") for s in solvers)
            + " |"
        )
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_overhead_vs_budget(rows: Sequence[dict[str, str]], path: str | Path) -> Path:
    """One panel per graph: overhead (%) against budget (% of keep-all), a step line per solver."""
    plt = _pyplot()
    graphs = sorted({r["graph"] for r in rows})
    cols = min(4, len(graphs)) or 1
    nrows = max(1, (len(graphs) + cols - 1) // cols)  # one empty panel when nothing finished
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
    for ax, graph in zip(axes.flat, graphs):
        by_solver: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in rows:
            overhead = _float(r["overhead"])
            if (
                r["graph"] == graph
                and overhead is not None
                and r["status"] in ("optimal", "feasible")
            ):
                by_solver[r["solver"]].append((100 * float(r["budget_fraction"]), 100 * overhead))
        for solver, points in sorted(by_solver.items()):
            points.sort()
            ax.step(
                [p[0] for p in points],
                [p[1] for p in points],
                where="post",
                marker="o",
                markersize=3,
                label=solver,
            )
        ax.set_title(graph, fontsize=9)
        ax.set_xlabel("budget (% of store-everything peak)", fontsize=8)
        ax.set_ylabel("extra compute (%)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(graphs) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_solve_time(rows: Sequence[dict[str, str]], path: str | Path) -> Path:
    """Solve seconds against graph size (ops), log-log, one series per solver."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    by_solver: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        by_solver[r["solver"]].append((int(r["nodes"]), max(float(r["solve_s"]), 1e-4)))
    for solver, points in sorted(by_solver.items()):
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=10, label=solver)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ops in the graph")
    ax.set_ylabel("solve time (s)")
    ax.grid(alpha=0.3)
    if by_solver:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_timeline(
    predicted: Sequence[int], measured: Sequence[int], path: str | Path, *, title: str = ""
) -> Path:
    """Predicted and measured memory over the step, both on a 0..1 progress axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for series, label in ((predicted, "predicted (simulator)"), (measured, "measured")):
        if series:
            n = max(len(series) - 1, 1)
            ax.plot([i / n for i in range(len(series))], [b / 2**20 for b in series], label=label)
    ax.set_xlabel("progress through the step (forward, then backward)")
    ax.set_ylabel("live bytes (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
