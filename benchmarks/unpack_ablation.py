"""``auto`` on a layer-level conv net with and without recompute on unpack (issue 34).

Without: in this process, the cached-op search (:mod:`chkpt_opt.solvers.cached.local_search`,
the stage of ``auto`` that unpacks ops) gets no unpacked start and no unpack move; the rest
of the search (its other moves, how it moves while nothing fits) is the same. What changes
between the two is then what unpacking buys, not what the search's other changes buy.
``auto`` stops at its time limit, so on a loaded machine it may stop elsewhere: run it alone.

Usage::

    python benchmarks/unpack_ablation.py segnet 0.6 on
    python benchmarks/unpack_ablation.py segnet 0.6 off
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chkpt_opt.solvers.cached.local_search as local_search  # noqa: E402
from chkpt_opt.graphs.costgraph import total_compute_s  # noqa: E402
from chkpt_opt.graphs.io import load_graph  # noqa: E402
from chkpt_opt.memory_model.schedule import Schedule  # noqa: E402
from chkpt_opt.memory_model.simulate import simulate  # noqa: E402
from chkpt_opt.solvers import get_solver  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graph", choices=("vgg16", "vgg19", "fcn8", "segnet", "unet"))
    parser.add_argument("share", type=float, help="budget as a share of keep-all")
    parser.add_argument("unpack", choices=("on", "off"))
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    if args.unpack == "off":
        every_move = local_search.neighbours
        local_search.unpacked_starts = lambda graph, schedule: []  # type: ignore[assignment]
        local_search.neighbours = lambda graph, schedule, allowed, unpack=True: every_move(  # type: ignore[assignment]
            graph, schedule, allowed, unpack=False
        )
    graph = load_graph(ROOT / "graphs" / f"{args.graph}_layers.json")
    budget = int(args.share * simulate(graph, Schedule()).peak_bytes)
    start = time.monotonic()
    result = get_solver("auto")(graph, budget, time_limit_s=args.time_limit)
    extra = 100 * result.objective / total_compute_s(graph) if result.feasible else None
    print(
        f"{args.graph} {args.share:.0%} unpack {args.unpack}: "
        f"{'-' if extra is None else f'{extra:.3f}%'} extra compute "
        f"({result.status.value}, chosen {result.stats.get('chosen')}, "
        f"unpacked {sorted(result.schedule.unpacked)}, {time.monotonic() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
